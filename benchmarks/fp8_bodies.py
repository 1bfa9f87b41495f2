"""The fp8 decode kernel's bodies and split merges against bf16 SDPA, from CUDA graphs: the query rows as M
of both dots (`fp8_phase=False`) or tokens as M with the values read by phase (`fp8_phase=None`; see
kvcompress/kernels/decode_fp8_phase_triton.py), and the merge with the exact parts as a launch of its
own or as a programmatic dependent launch (`merge=`; kvcompress/kernels/exact_reduce_triton.py).

Llama-3.1-8B layer shapes (benchmarks/decode_attention.py builds the packed data: the fp8 preset, per-token
scales, or "fp8-static", calibration's static scales on shifted streams). Each variant is checked against
the torch twin on the same data first (relative error), then timed with bf16 SDPA in three interleaved
rounds; the fastest of each kept. The last table is the summary.

    PYTHONPATH=. python benchmarks/fp8_bodies.py [--shapes 32768x8 131072x8] [--methods fp8 fp8-static]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_attention as da

from kvcompress.kernels.decode_attention import decode_attention_torch
from kvcompress.kernels.decode_attention_triton import decode_attention_triton

SHAPES = ["8192x8", "32768x1", "32768x8", "32768x32", "131072x8"]
# (label, keyword arguments of decode_attention_triton)
VARIANTS = [
    ("query rows, merge launch", dict(fp8_phase=False, merge="kernel")),
    ("phase, merge launch", dict(fp8_phase=True, merge="kernel")),
    ("query rows, PDL merge", dict(fp8_phase=False, merge="pdl")),
    ("phase, PDL merge", dict(fp8_phase=True, merge="pdl")),
    ("library default", dict()),
]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="CONTEXTxBATCH")
    ap.add_argument("--methods", nargs="+", default=["fp8"])
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    print(f"{torch.cuda.get_device_name()}, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC", flush=True)
    rows = []
    for shape in args.shapes:
        n, b = map(int, shape.split("x"))
        q = torch.randn(b, da.HQ, da.D, device="cuda", dtype=da.DTYPE)
        k = torch.randn(b, da.HKV, n, da.D, device="cuda", dtype=da.DTYPE)
        v = torch.randn(b, da.HKV, n, da.D, device="cuda", dtype=da.DTYPE)

        def sdpa(q=q, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=da.SCALING,
                                                                    enable_gqa=True)

        for method in args.methods:
            parts = da.build_parts(method, b, n)
            want = decode_attention_torch(q, parts, da.SCALING)[0].float()
            def err(kw):
                got = decode_attention_triton(q, parts, da.SCALING, **kw)[0].float()
                return float((got - want).norm() / want.norm())

            errs = {label: err(kw) for label, kw in VARIANTS}
            times = {label: [] for label in ["bf16 SDPA", *errs]}
            for _ in range(args.rounds):
                times["bf16 SDPA"].append(da.graph_time(sdpa, args.iters))
                for label, kw in VARIANTS:
                    times[label].append(da.graph_time(
                        lambda q=q, p=parts, kw=kw: decode_attention_triton(q, p, da.SCALING, **kw), args.iters))
            after = {label: err(kw) for label, kw in VARIANTS}
            errs = {label: max(errs[label], after[label]) for label in errs}
            best = {label: min(t) for label, t in times.items()}
            base = best["bf16 SDPA"]
            rows.append((shape, method, base, {label: base / best[label] for label in errs}, errs))
            print(shape, method, f"SDPA {base:.4f} ms", {label: f"{base / best[label]:.2f}x err {errs[label]:.1e}"
                                                         for label in errs}, flush=True)
            del parts
        del k, v
        torch.cuda.empty_cache()
    labels = [label for label, _ in VARIANTS]
    print("\n| T x B | cache | bf16 SDPA | " + " | ".join(labels) + " |")
    print("|---|---|---|" + "---|" * len(labels))
    for shape, method, base, speed, errs in rows:
        n, b = map(int, shape.split("x"))
        cells = " | ".join(f"{speed[label]:.2f}x ({errs[label]:.0e})" for label in labels)
        print(f"| {n // 1024}K x {b} | {method} | {base:.4f} ms | {cells} |")


if __name__ == "__main__":
    main()
