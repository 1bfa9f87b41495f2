"""Where one Quest decode step's time goes: page scoring + top-k, then the fused attention over the
selected pages (nuq4 pages, a 2048-token budget, bfloat16 page summaries, one Llama-3.1-8B layer).

Each part and the whole step are captured in a CUDA graph and replayed (median of 50); one
`torch.profiler` table of 5 whole steps follows per shape. The speedup against bf16 SDPA is in
`decode_attention.py --methods nuq4+quest2048`, which builds the same data.

    PYTHONPATH=. python benchmarks/quest_step.py [--contexts 32768 131072] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import decode_attention as bench  # noqa: E402  (the data builders and timers of the layer benchmark)

from kvcompress.kernels.decode_attention_triton import decode_attention_triton  # noqa: E402
from kvcompress.kernels.quest import quest_select_pages  # noqa: E402
from kvcompress.sparse.quest import RADIUS_SCALE  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    ap.add_argument("--batch", type=int, default=8)
    args = ap.parse_args()
    assert torch.cuda.is_available(), "this benchmark needs a CUDA GPU"
    from torch.profiler import ProfilerActivity, profile

    b = args.batch
    for n in args.contexts:
        parts = bench.build_parts("nuq4", b, n)
        page = parts.key.page_size
        lo, hi = bench.quest_summaries(b, n // page, page)
        q = torch.randn(b, bench.HQ, bench.D, device="cuda", dtype=bench.DTYPE)

        def select():
            return quest_select_pages(q, lo, hi, bench.QUEST_TOKENS // page, scaling=bench.SCALING,
                                      radius_scale=RADIUS_SCALE, backend="triton")

        fixed = select()

        def attention():
            return decode_attention_triton(q, parts, bench.SCALING, fixed)

        def step():
            return decode_attention_triton(q, parts, bench.SCALING, select())

        times = {name: bench.graph_time(fn, 50) for name, fn in
                 (("select", select), ("attention", attention), ("step", step))}
        print(f"{n} x {b}: " + ", ".join(f"{k} {v * 1e3:.1f} us" for k, v in times.items() if v is not None),
              flush=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                step()
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))
        del parts, lo, hi
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
