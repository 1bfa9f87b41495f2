"""Perplexity change against bits per element, one point per cache; passkey accuracy in the marker."""

from __future__ import annotations

import os

from kvcompress.atomic import atomic_path

PLOT_HINT = 'pip install "kvcompress[plot]"'


def plot_results(rows: list[dict], path: str, title: str | None = None) -> None:
    """Save a scatter of Δppl (%) vs bits per element to `path` (png, pdf, svg).

    Marker: filled circle = passkey 100%, half-filled = partly found, cross = 0%, hollow = not run.
    Rows without a bits-per-element figure (memory n/a) are left out.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise ImportError(f"--plot needs matplotlib; install it with: {PLOT_HINT}") from e

    fig, ax = plt.subplots(figsize=(8, 5))
    for r in rows:
        x, y = r.get("bits_per_element"), r.get("ppl_delta_pct")
        if x is None or y is None:
            continue
        marker, fill = _marker(r.get("passkey"))
        ax.plot([x], [y], linestyle="none", marker=marker, markersize=8, markerfacecolor=fill, markeredgecolor="C0")
        label = r["name"] if r.get("passkey") is None else f"{r['name']} (pk {r['passkey']:.0%})"
        ax.annotate(label, (x, y), textcoords="offset points", xytext=(5, 4), fontsize=8)
    ax.set_xlabel("bits per element (all-in: codes, scales, codebooks, outliers, windows)")
    ax.set_ylabel("perplexity change vs uncompressed (%)")
    ax.axhline(0.0, color="gray", lw=0.8)
    ax.set_xscale("log", base=2)
    ctx = next((r["context"] for r in rows), None)
    ax.set_title(title or f"KV cache: quality vs size (context {ctx})")
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    ext = os.path.splitext(os.fspath(path))[1]
    with atomic_path(path, ext or ".png") as tmp:  # an interrupted save leaves no half-written image
        fig.savefig(tmp, dpi=120, format=ext[1:] or "png")
    plt.close(fig)


def _marker(passkey):
    if passkey is None:
        return "o", "none"
    if passkey >= 1.0:
        return "o", "C0"
    if passkey <= 0.0:
        return "x", "C0"
    return "D", "none"
