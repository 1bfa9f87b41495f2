"""Decode speed of sparse presets against DynamicCache + SDPA, one process, one Llama-3.1-8B-shaped model.

The model (benchmarks/e2e_decode.py's LLAMA_8B, with --layers of its 32 layers) has random bf16 weights on
the GPU. Each cache prefills the same random prompt (--batch x --prompt tokens, in chunks of --chunk), runs
--warmup decode steps (so that the evicting layers have evicted and every kernel is compiled), then times
--steps eager greedy steps with CUDA events (ms/step), and profiles 4 more steps for the time the device
was busy (the sum of kernel times, ms/step), which does not depend on how fast the host launches kernels:
at these sizes eager transformers is bound by the host, and a step with an eviction in it weighs more in
4 profiled steps than in the timed ones. Evictions: H2O evictions per layer during the timed steps (counted
by wrapping `H2OPolicy.evict`, which the growing layers and the graph's StaticH2O both call), so a row says
whether its timed steps paid for any. Bytes held: `memory_report()` (the K/V tensors for DynamicCache),
after the timed steps. Ratios are against the first cache of --kinds, measured in the same run.

A kind is a preset name, or a preset with `-heads` (its H2O layers get per-kv-head budgets: shares drawn
from 0.2 to 2.0 of the layer's budget, mean 1, as `kvcompress calibrate -p h2o-50` gives SmolLM2's heads),
or with `@cat` (a full-precision sparse layer appends by concatenating, as before the in-place buffers of
kvcompress.layout.grow), or with `@graph` (the decode steps replayed from a CUDA graph by kvcompress.DecodeGraph:
quantized presets, H2O and Quest over quantized pages, e.g. `nuq4+h2o-20@graph`, `nuq4+quest-1024@graph`;
after the prefill, so its warmup steps include the capture).

    PYTHONPATH=. python benchmarks/sparse_decode.py --layers 16 --batch 16 --prompt 8192 \
        --kinds dynamic,h2o-50,h2o-50-heads
    PYTHONPATH=. python benchmarks/sparse_decode.py --layers 16 --batch 16 --prompt 8192 \
        --kinds dynamic,nuq4,nuq4@graph,nuq4+h2o-20,nuq4+h2o-20@graph
    python benchmarks/sparse_decode.py --tiny    # a CPU smoke run
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import e2e_decode as e2e

import kvcompress
import kvcompress.cache as cache_module
from kvcompress.cache import CompressedCache
from kvcompress.layout.grow import append_in_place
from kvcompress.sparse.h2o import H2OPolicy

EVICTIONS = [0]


def count_evictions() -> None:
    """Wrap H2OPolicy.evict (once) so that EVICTIONS[0] counts its calls, over all layers."""
    evict = H2OPolicy.evict
    if getattr(evict, "counted", False):
        return

    def counted(self, *args, **kwargs):
        EVICTIONS[0] += 1
        return evict(self, *args, **kwargs)

    counted.counted = True
    H2OPolicy.evict = counted


def head_shares(n_heads: int, seed: int = 0) -> list[float]:
    """n_heads shares from 0.2 to 2.0 with mean 1, most of them small (a few heads take most of the budget)."""
    s = torch.rand(n_heads, generator=torch.Generator().manual_seed(seed)) ** 2 * 1.8 + 0.2
    return [float(x) for x in (s / s.mean()).clamp(0.2, 2.0)]


def make_cache(kind: str, model):
    from transformers import DynamicCache

    concat = kind.endswith("@cat")
    kind = kind.removesuffix("@cat")
    cache_module.append_in_place = (
        (lambda held, new, buffer, spare: (torch.cat([held, new], 2), None)) if concat else append_in_place)
    if kind == "dynamic":
        kvcompress.disable(model)
        model.set_attn_implementation("sdpa")
        return DynamicCache()
    kvcompress.enable(model)
    if not kind.endswith("-heads"):
        return CompressedCache(model.config, kind)
    cfg = kvcompress.KVCompressConfig.from_preset(kind.removesuffix("-heads"), model.config)
    for i, policy in enumerate(cfg.layers):
        if policy.sparsity.method == "h2o":
            policy.sparsity.head_shares = head_shares(model.config.num_key_value_heads, seed=i)
    return CompressedCache(model.config, cfg)


def busy_ms(model, token, cache, steps: int, device, graph=None) -> float:
    """Device time per decode step (sum of the kernels' times) over `steps` profiled steps; 0 on the CPU."""
    if device.type != "cuda":
        return 0.0
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        e2e.decode(model, token, cache, steps, graph)
        e2e.sync(device)
    return sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model, short prompt (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="layers of the model (default 32, tiny 2)")
    ap.add_argument("--batch", type=int, default=None, help="default 16, tiny 2")
    ap.add_argument("--prompt", type=int, default=None, help="default 8192, tiny 256")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 2048, tiny 64)")
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--kinds", default="dynamic,h2o-20,h2o-50,h2o-50-heads,streaming")
    args = ap.parse_args(argv)
    shape = dict(e2e.TINY if args.tiny else e2e.LLAMA_8B)
    shape["num_hidden_layers"] = args.layers or (2 if args.tiny else 32)
    (e2e.TINY if args.tiny else e2e.LLAMA_8B).update(shape)
    batch, prompt = args.batch or (2 if args.tiny else 16), args.prompt or (256 if args.tiny else 8192)
    chunk = args.chunk or (64 if args.tiny else 2048)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = e2e.build_model(args.tiny, device)
    count_evictions()

    rows = []
    for kind in args.kinds.split(","):
        ids = torch.randint(0, model.config.vocab_size, (batch, prompt),
                            generator=torch.Generator().manual_seed(1)).to(device)
        cache = make_cache(kind.removesuffix("@graph"), model)
        t0 = time.perf_counter()
        token = e2e.prefill(model, ids, cache, chunk)
        e2e.sync(device)
        prefill_s = time.perf_counter() - t0
        graph = None
        if kind.endswith("@graph"):
            graph = kvcompress.DecodeGraph(model, cache, max_tokens=prompt + args.warmup + args.steps + 5,
                                           use_graph=device.type == "cuda")
        token = e2e.decode(model, token, cache, args.warmup, graph)
        e2e.sync(device)
        EVICTIONS[0] = 0
        ms = 1e3 * e2e.timed_decode(model, token, cache, args.steps, device, graph) / args.steps
        evictions = EVICTIONS[0] / shape["num_hidden_layers"]
        held = e2e.cache_bytes(cache)
        rows.append((kind, ms, busy_ms(model, token, cache, 4, device, graph), held, prefill_s, evictions))
        print(rows[-1], flush=True)
        if graph is not None:
            graph.release()
        del cache, ids, token, graph
    cache_module.append_in_place = append_in_place

    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"\nsparse decode, {datetime.date.today()}, {gpu}, {shape['num_hidden_layers']} layers of Llama-3.1-8B "
          f"shape{' (tiny)' if args.tiny else ''}, batch {batch}, prompt {prompt}, {args.steps} timed steps after "
          f"{args.warmup}")
    print("| cache | ms/step | speed | device busy ms/step | speed | evictions/layer | bytes held | prefill s |")
    print("|---|---|---|---|---|---|---|---|")
    base_ms, base_busy, base_held = rows[0][1], rows[0][2] or 1.0, rows[0][3]
    for kind, ms, busy, held, prefill_s, evictions in rows:
        print(f"| {kind} | {ms:.2f} | {base_ms / ms:.2f}x | {busy:.2f} | {base_busy / busy if busy else 0:.2f}x | "
              f"{evictions:g} | {held / base_held:.3f} | {prefill_s:.1f} |")


if __name__ == "__main__":
    main()
