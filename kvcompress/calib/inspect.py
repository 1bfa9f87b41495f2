"""A readable view of a config file: format version, model fingerprint, per-layer policy, calibration notes."""

from __future__ import annotations

from kvcompress.config import KVCompressConfig, QuantSpec


def describe_spec(spec: QuantSpec, widths=None) -> str:
    """"nuq4/channel +1% outliers", "fp8 e4m3", "none", ...; with channel widths [H, D] (a nuq page stream's
    calibrated bits per channel) "nuq~3.25/page (widths 0-7)"."""
    if spec.method == "none":
        return "none"
    if spec.method == "fp8":
        return f"fp8 {spec.fp8_format}"
    if spec.method == "bnb":
        return f"bnb {spec.bnb_type}"
    s = f"{spec.method}{spec.bits}/{spec.axis}"
    if widths is not None:
        w = widths.float()
        s = f"{spec.method}~{float(w.mean()):.3g}/{spec.axis} (widths {int(w.min())}-{int(w.max())})"
    if spec.group_size:
        s += f" g{spec.group_size}"
    if spec.rotation:
        s += " +rot"
    if spec.outlier_fraction:
        s += f" +{spec.outlier_fraction:.1%} outliers" + (" per token" if spec.outlier_scope == "token" else "")
    return s


def describe_sparsity(s, layer_idx: int) -> str:
    """One layer's sparsity as `inspect` prints it, e.g. "quest 25% (pages of 4, shared by layers, unread means)",
    "h2o 25% (4 sinks, kv heads x 0.40/1.10/1.50)" (each kv head's share of the budget)."""
    if s.method == "none":
        return "none"
    if layer_idx < s.dense_layers:
        return f"none (dense below layer {s.dense_layers})"
    extras = []
    if s.method == "quest":
        extras.append(f"pages of {s.page_size}")
    if s.budget_sharing != "none":
        extras.append(f"shared by {s.budget_sharing}")
    if s.unread_means:
        extras.append("unread means")
    if s.sinks:
        extras.append(f"{s.sinks} sinks")
    if s.recent:
        extras.append(f"recent {s.recent}")
    if s.merge:
        extras.append("merge")
    if s.head_shares:
        extras.append("kv heads x " + "/".join(f"{x:.2f}" for x in s.head_shares))
    budget = f"{s.budget} tok" if s.budget else f"{s.ratio:.0%}"
    return f"{s.method} {budget}" + (f" ({', '.join(extras)})" if extras else "")


def layer_rows(cfg: KVCompressConfig) -> list[dict]:
    rows = []
    for i, p in enumerate(cfg.layers):
        sparsity = describe_sparsity(p.sparsity, i)
        calibrated = sorted(k for k in p.tensors)
        rows.append({
            "layer": i,
            "type": "sliding" if cfg.layout.is_sliding(i) else "full",
            "keys": describe_spec(p.key, p.tensors.get("key.channel_widths")),
            "values": describe_spec(p.value),
            "page/sinks/residual": f"{p.page_size}/{p.sinks}/{p.residual}",
            "sparsity": sparsity,
            "calibrated": ", ".join(calibrated) if calibrated else "-",
        })
    return rows


def head_budget_line(notes: dict) -> str:
    """One line on a per-kv-head H2O allocation from its notes (calib/head_budgets.py): the replayed costs with
    every head at its layer's budget -> as allocated. Files written before the expected KL was measured have
    only the missed mass."""
    ratios = [r for row in notes.get("ratios", []) for r in row]
    n, t = (notes.get("windows") or [0, 0])[:2]
    costs = [f"{what} {notes[key]['even']:.4g} -> {notes[key]['allocated']:.4g}"
             for key, what in (("expected_kl", "expected KL (nats/position)"), ("missed_mass", "missed attention mass"))
             if key in notes]
    return (f"per-kv-head H2O budgets: {len(notes.get('layers', []))} layers, head ratios {min(ratios, default=0):.3f}-"
            f"{max(ratios, default=0):.3f}, replayed on {n} x {t} tokens; even -> allocated: " + ", ".join(costs))


def print_config(cfg: KVCompressConfig, path: str, show_tensors: bool = False) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvcompress.calib.estimate import _groups

    console = Console()
    fp = cfg.layout.fingerprint()
    console.print(f"[bold]{path}[/bold]: kvcompress config {cfg.name!r}, format version {cfg.version}")
    console.print(
        f"model: {fp['model_type']}, {fp['num_layers']} layers, {fp['num_kv_heads']} kv heads "
        f"({fp['num_query_heads']} query heads), key/value head dims {fp['key_head_dim']}/{fp['value_head_dim']}, "
        f"attention {fp['attention']}" + (f", sliding window {fp['sliding_window']}" if fp["sliding_window"] else "")
    )
    t = Table(title="per-layer policy")
    rows = layer_rows(cfg)
    for col in rows[0]:
        t.add_column("layers" if col == "layer" else col)
    for first, last, r in _groups(rows):
        t.add_row(str(first) if first == last else f"{first}-{last}", *[str(v) for k, v in r.items() if k != "layer"])
    console.print(t)
    calib = cfg.notes.get("calibration")
    if calib:
        console.print(
            f"calibrated on {calib.get('windows')} tokens of text sha256 {str(calib.get('text_sha256'))[:12]}..., "
            f"preset {calib.get('preset')}, codebooks {'per kv head' if calib.get('per_head') else 'per layer'}, "
            f"weighting {calib.get('weighting_used')}, {calib.get('seconds', {}).get('total')} s"
        )
    alloc = cfg.notes.get("allocation")
    if alloc:
        console.print(f"allocation: {alloc['achieved_bits']:.3f} bits per element all-in at {alloc['context']} tokens "
                      f"(target {alloc['target_bits']:.3f})")
    heads = cfg.notes.get("head_budgets")
    if heads:
        console.print(head_budget_line(heads))
    if show_tensors:
        tt = Table(title="tensors")
        for col in ("name", "shape", "dtype"):
            tt.add_column(col)
        for i, p in enumerate(cfg.layers):
            for k, v in sorted(p.tensors.items()):
                tt.add_row(f"layers.{i}.{k}", str(tuple(v.shape)), str(v.dtype).removeprefix("torch."))
        console.print(tt)
