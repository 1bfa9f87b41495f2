"""Speed of the fused decode kernel against the number of splits per (batch, kv head), from CUDA graphs.

For each (context, batch) and codec: bf16 SDPA (the baseline, same run), then the kernel at the library's
default split count, the former rule (16 programs per multiprocessor, rounded up) and a set of candidates
(fixed tokens per split, whole waves of 1-8 programs per multiprocessor); three interleaved rounds, the
fastest of each kept. Llama-3.1-8B layer shapes (benchmarks/decode_attention.py builds the packed data).

    PYTHONPATH=. python benchmarks/split_counts.py [--shapes 32768x8 131072x32] [--methods fp8 int4]
"""

from __future__ import annotations

import argparse
import datetime
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import decode_attention as da

from kvcompress.kernels.decode_attention_triton import decode_attention_triton

SHAPES = ["8192x1", "8192x8", "32768x1", "32768x8", "32768x32", "131072x1", "131072x8", "131072x32"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", nargs="+", default=SHAPES, help="CONTEXTxBATCH")
    ap.add_argument("--methods", nargs="+", default=["fp8", "int4"])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name()}, {sms} multiprocessors, {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC")
    print("| T x B | codec | bf16 SDPA | library default | former rule (splits) | best (splits) | all: splits speedup |")
    print("|---|---|---|---|---|---|---|")
    for shape in args.shapes:
        n, b = map(int, shape.split("x"))
        q = torch.randn(b, da.HQ, da.D, device="cuda", dtype=da.DTYPE)
        k = torch.randn(b, da.HKV, n, da.D, device="cuda", dtype=da.DTYPE)
        v = torch.randn(b, da.HKV, n, da.D, device="cuda", dtype=da.DTYPE)

        def sdpa(i, q=q, k=k, v=v):
            return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=da.SCALING,
                                                                    enable_gqa=True)

        base = da.median_ms(sdpa, args.iters)
        del sdpa, k, v
        pairs = b * da.HKV
        former = -(-16 * sms // pairs)
        for method in args.methods:
            parts = da.build_parts(method, b, n)
            cands = {former} | {max(1, -(-n // t)) for t in (256, 512, 1024, 2048, 4096, 8192)}
            cands |= {max(1, w * sms // pairs) for w in (1, 2, 4, 6, 8)}
            times = {s: [] for s in [None, *sorted(cands)]}
            for _ in range(args.rounds):
                for s, got in times.items():
                    got.append(da.graph_time(
                        lambda q=q, p=parts, s=s: decode_attention_triton(q, p, da.SCALING, None, splits=s),
                        args.iters))
            speed = {s: base / min(t) for s, t in times.items()}
            best = max((s for s in speed if s is not None), key=speed.get)
            rest = " ".join(f"{s}:{speed[s]:.2f}" for s in sorted(cands))
            print(f"| {n // 1024}K x {b} | {method} | {base:.4f} ms | {speed[None]:.2f}x | {speed[former]:.2f}x ({former}) "
                  f"| {speed[best]:.2f}x ({best}) | {rest} |", flush=True)
            del parts
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
