"""The results table of `kvcompress eval` (rich), and the atomic JSON writer."""

from __future__ import annotations

import math
import os

from kvcompress.atomic import write_json as atomic_write_json
from kvcompress.report import fmt_bytes

COLUMNS = ("cache", "ppl", "Δppl", "KL", "top-1", "passkey", "key log-p", "KV held", "ratio", "bits/elem",
           "tokens held/read", "KV read/step", "ms/token")


def _num(x, fmt: str, suffix: str = "") -> str:
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "n/a"
    return f"{x:{fmt}}{suffix}"


def _count(x) -> str:
    return "n/a" if x is None else f"{x:.1f}".removesuffix(".0") if isinstance(x, float) else str(x)


def _delta(r: dict) -> str:
    """Δppl; over several windows the mean, then [min, max] of the per-window deltas."""
    per = r.get("ppl_delta_pct_windows")
    text = _num(r.get("ppl_delta_pct"), "+.3f", "%")
    if per and len(per) > 1:
        text += f" [{min(per):+.2f}, {max(per):+.2f}]"
    return text


def row_cells(r: dict) -> list[str]:
    held, read = r.get("tokens_held"), r.get("tokens_read")
    return [
        r["name"],
        _num(r["ppl"], ".4f"),
        _delta(r),
        _num(r.get("kl_divergence"), ".2e") if r.get("kl_divergence") is not None else "-",
        _num(r.get("top1_agreement"), ".1%") if r.get("top1_agreement") is not None else "-",
        _num(r.get("passkey"), ".0%") if r.get("passkey") is not None else "-",
        _num(r.get("passkey_logprob"), ".3f") if r.get("passkey_logprob") is not None else "-",
        fmt_bytes(r["held_bytes"]) if r.get("held_bytes") is not None else "n/a",
        _num(r.get("compression_ratio"), ".2f", "x"),
        _num(r.get("bits_per_element"), ".2f"),
        f"{held}/{_count(read)}" if held is not None else "n/a",
        _num(100 * r["read_share"], ".1f", "%") if r.get("read_share") is not None else "n/a",
        _num(r.get("ms_per_token"), ".1f"),
    ]


def results_table(rows: list[dict], title: str = "KV cache evaluation"):
    from rich.table import Table

    t = Table(title=title)
    for i, col in enumerate(COLUMNS):
        t.add_column(col, justify="left" if i == 0 else "right")
    for r in rows:
        t.add_row(*row_cells(r))
    return t


def print_results(rows: list[dict], title: str = "KV cache evaluation", console=None) -> None:
    from rich.console import Console

    if console is None:
        console = Console()
        if not console.is_terminal:  # logs and pipes: wide enough that no cell wraps
            console = Console(width=160)
    console.print(results_table(rows, title))


def markdown_table(rows: list[dict]) -> str:
    """The same table as GitHub markdown (for reports)."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(row_cells(r)) + " |" for r in rows]
    return "\n".join(lines)


def write_json(path: str | os.PathLike, doc) -> None:
    """Write JSON atomically (kvcompress.atomic)."""
    atomic_write_json(path, doc)
