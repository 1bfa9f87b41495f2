"""What a key codec's outlier choice costs attention, layer by layer, on SmolLM2-135M's own activations (CPU).

As `value_attention_error.py`, for keys: one uncompressed forward over a window of eval.txt records every
layer's queries (the last NQ positions), keys and values; each variant codes the layer's key body (after the
nuq4 preset's 4 sinks, before its 16-token tail) with nuq4's key codec and re-runs attention with exact
values. The output's error energy over its energy is the key codec's own cost to attention, per layer.

Variants (nuq4 keys: pages of 32, each channel's range in FP8, 21 exact outliers per page):
  z-score     the preset: each page's 21 largest z-scores;
  none        no outliers;
  equal       the greedy pick of quant/outlier_select.py with every channel weighted 1;
  weighted    the same with the queries' energy per channel E[q_c^2], from a forward over calib.txt (what
              `kvcompress calibrate` writes as key.outlier_weight).

    OMP_NUM_THREADS=1 python benchmarks/key_attention_error.py [--length 4096] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import importlib.resources
from dataclasses import replace

import torch
from value_attention_error import NQ, PAGE, SINKS, TAIL, db, record

import kvcompress
from kvcompress.calib.collect import CollectSettings, collect
from kvcompress.calib.fit import outlier_weights
from kvcompress.calib.sensitivity import relative_error
from kvcompress.config import KVCompressConfig
from kvcompress.evaluation.perplexity import context_ids
from kvcompress.quant.factory import make_codec


def attend(q, keys, vv, scaling: float, future) -> torch.Tensor:
    """Softmax attention of q [1, Hq, NQ, D] over keys [1, H, T, D] (repeated over the GQA group) and vv
    [1, Hq, T, Dv]; future [NQ, T] masks what a query may not see."""
    s = q @ keys.repeat_interleave(q.shape[1] // keys.shape[1], 1).transpose(-1, -2) * scaling
    return s.masked_fill(future, float("-inf")).softmax(-1) @ vv


def coded_keys(spec, body: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
    """body [1, H, N, D] -> decoded float32 with nuq4's key codec (outliers picked by `weight` if given)."""
    tensors = {} if weight is None else {"outlier_weight": weight}
    codec = make_codec(spec, page_size=PAGE, head_dim=body.shape[-1], num_heads=body.shape[1],
                       dtype=body.dtype, tensors=tensors, seed=0)
    row = codec.prepare(body)
    return codec.decode(codec.encode(body, row), row, torch.float32)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = kvcompress.load_model("smollm2-135m", dtype=dtype)
    calib = (importlib.resources.files("kvcompress") / "data" / "calib.txt").read_text()
    # the queries' channel energies as `kvcompress calibrate` collects them, from one window of calib.txt
    window = context_ids(tok, args.length, calib)
    stats = collect(model, window, CollectSettings(samples=1, seq_len=args.length, batch_size=1, sample_tokens=16,
                                                   weighting="none"), progress=False)
    energies = [s.query_energy for s in stats]
    records = record(model, context_ids(tok, args.length))
    spec = KVCompressConfig.from_preset("nuq4", model.config).layers[0].key
    errs: dict[str, list[float]] = {}
    for li, (q, k, v, scaling) in enumerate(records):
        t = k.shape[2]
        n = (t - SINKS - TAIL) // PAGE * PAGE
        g = q.shape[1] // k.shape[1]
        future = torch.arange(t)[None, :] > torch.arange(t - NQ, t)[:, None]
        vv = v.repeat_interleave(g, 1)
        want = attend(q, k, vv, scaling, future)
        body = k[:, :, SINKS:SINKS + n].to(dtype)
        variants = {
            "z-score": (spec, None),
            "none": (replace(spec, outlier_fraction=0.0), None),
            "equal": (spec, torch.ones_like(energies[li])),
            "weighted": (spec, outlier_weights(energies[li])),
        }
        for name, (s, w) in variants.items():
            kq = torch.cat([k[:, :, :SINKS], coded_keys(s, body, w), k[:, :, SINKS + n:]], 2)
            errs.setdefault(name, []).append(relative_error(attend(q, kq, vv, scaling, future), want))
    print(f"eval.txt, {args.length} tokens, {args.dtype}: attention output SNR (dB, of the relative error energy "
          f"averaged over the {len(records)} layers), keys coded, values exact")
    print("| outliers | SNR | mean per-layer gain vs z-score | layers that gain | per layer vs z-score (dB, 0..) |")
    print("|---|---|---|---|---|")
    base = errs["z-score"]
    for name, e in errs.items():
        gains = [db(r) - db(r0) for r, r0 in zip(e, base)]
        print(f"| {name} | {db(sum(e) / len(e)):.2f} | {sum(gains) / len(gains):+.2f} | "
              f"{sum(x > 0 for x in gains)} | {' '.join(f'{x:+.1f}' for x in gains)} |")


if __name__ == "__main__":
    main()
