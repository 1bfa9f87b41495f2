"""KV cache memory of a model at a context length and batch, uncompressed and with a config or preset.

Uncompressed, a layer holds 2 x tokens x N_kv x D x bytes per sequence (keys and values, per kv head,
never after GQA's repeat); a sliding-window layer holds at most its window; an MLA layer holds its
latent (kv_lora_rank + qk_rope_head_dim values per token) where a per-head cache would hold
heads x (qk_nope + qk_rope + v_head_dim). Compressed sizes come from the codecs (calib/bits.py); a sparse
layer holds what its policy keeps at most (calib/held.py), shown in the tokens column.
"""

from __future__ import annotations

import torch

from kvcompress.calib.bits import layer_bytes, uncompressed_layer_bytes
from kvcompress.calib.held import held_tokens
from kvcompress.config import KVCompressConfig
from kvcompress.layout.arch import ModelLayout


def estimate_memory(layout: ModelLayout, cfg: KVCompressConfig | None, context: int, batch: int = 1,
                    dtype: torch.dtype = torch.bfloat16) -> dict:
    """Per layer and total bytes; `cfg` None gives the uncompressed numbers only."""
    itemsize = torch.finfo(dtype).bits / 8
    layers = []
    for i in range(layout.num_layers):
        sliding = layout.is_sliding(i)
        held = min(context, layout.sliding_window) if sliding and layout.sliding_window else context
        unc = uncompressed_layer_bytes(layout, i, context, batch, dtype)
        row = {
            "layer": i,
            "kind": "mla" if layout.attention == "mla" else ("sliding" if sliding else "full"),
            "tokens_held": held,
            "values_per_token": layout.values_per_token(i),
            "uncompressed_bytes": unc,
        }
        if cfg is not None:
            comp = layer_bytes(cfg.layers[i], layout, i, context, batch, dtype)
            if not sliding:
                row["tokens_held"] = held_tokens(cfg.layers[i], i, context)
            row.update(compressed_bytes=comp, bits_per_element=8 * comp / (unc / itemsize) if unc else 0.0,
                       policy=_policy_name(cfg, i))
        layers.append(row)
    unc_total = sum(r["uncompressed_bytes"] for r in layers)
    out = {
        "model_type": layout.model_type,
        "context": context,
        "batch": batch,
        "dtype": str(dtype).removeprefix("torch."),
        "config": None if cfg is None else cfg.name,
        "layers": layers,
        "uncompressed_bytes": unc_total,
        "values_per_token_per_layer": layout.values_per_token(0),
    }
    if layout.attention == "mla":
        per_head = layout.decompressed_values_per_token()
        out["mla"] = {
            "decompressed_values_per_token_per_layer": per_head,
            "latent_values_per_token_per_layer": layout.values_per_token(0),
            "decompressed_bytes": batch * context * per_head * layout.num_layers * itemsize,
        }
    if cfg is not None:
        comp_total = sum(r["compressed_bytes"] for r in layers)
        out.update(compressed_bytes=comp_total, ratio=unc_total / comp_total if comp_total else 1.0,
                   bits_per_element=8 * comp_total / (unc_total / itemsize))
    return out


def _policy_name(cfg: KVCompressConfig, i: int) -> str:
    p = cfg.layers[i]
    short = [s.method if s.method in ("none", "fp8", "bnb") else f"{s.method}{s.bits}" for s in (p.key, p.value)]
    sparse = "" if p.sparsity.method == "none" else f" +{p.sparsity.method}"
    return f"K {short[0]} V {short[1]}{sparse}"


def print_estimate(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    from kvcompress.report import fmt_bytes

    has_cfg = result["config"] is not None
    t = Table(title=f"KV cache of {result['model_type']} at {result['context']} tokens x batch {result['batch']} "
                    f"({result['dtype']})" + (f" with {result['config']}" if has_cfg else ""))
    for col in ("layers", "kind", "tokens", "values/token", "uncompressed") + (("compressed", "bits/elem", "policy") if has_cfg else ()):
        t.add_column(col, justify="right" if col not in ("kind", "policy") else "left")
    for first, last, r in _groups(result["layers"]):
        cells = [f"{first}" if first == last else f"{first}-{last}", r["kind"], str(r["tokens_held"]),
                 str(r["values_per_token"]), fmt_bytes(r["uncompressed_bytes"])]
        if has_cfg:
            cells += [fmt_bytes(r["compressed_bytes"]), f"{r['bits_per_element']:.2f}", r["policy"]]
        t.add_row(*cells)
    total = ["total", "", "", "", fmt_bytes(result["uncompressed_bytes"])]
    if has_cfg:
        total += [fmt_bytes(result["compressed_bytes"]), f"{result['bits_per_element']:.2f}", f"{result['ratio']:.2f}x smaller"]
    t.add_row(*total, style="bold")
    console = Console()
    console.print(t)
    if "mla" in result:
        m = result["mla"]
        console.print(
            f"MLA: {m['latent_values_per_token_per_layer']} cached values per token and layer instead of "
            f"{m['decompressed_values_per_token_per_layer']:,} for per-head K/V "
            f"({m['decompressed_values_per_token_per_layer'] / m['latent_values_per_token_per_layer']:.1f}x); "
            f"per-head K/V would take {fmt_bytes(m['decompressed_bytes'])}"
        )


def _groups(rows: list[dict]):
    """Consecutive layers with identical numbers, as (first, last, row)."""
    keys = [k for k in rows[0] if k != "layer"] if rows else []
    start = 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or any(rows[i][k] != rows[start][k] for k in keys):
            yield rows[start]["layer"], rows[i - 1]["layer"], rows[start]
            start = i
