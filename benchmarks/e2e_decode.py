"""End-to-end decode: a Llama-3.1-8B-shaped model, CompressedCache(nuq4) on the fused path vs DynamicCache + SDPA.

The model (32 layers, hidden 4096, 32 query / 8 kv heads, head dim 128, intermediate 14336, vocab 128256)
is built from a LlamaConfig directly on the GPU with random bf16 weights (nothing is downloaded; decode
speed does not depend on the weights). Both caches run in the same process on the same model:

- dynamic: `DynamicCache` with the "sdpa" attention;
- nuq4:    `CompressedCache(config, "nuq4")` with `kvcompress.enable(model)` (decode steps run the fused
           Triton kernel over the packed pages; prefill runs SDPA over the dequantized chunks).

Per cache: the prompt is prefilled in chunks of --chunk tokens (logits of the last token only, so no
[B, chunk, vocab] tensor), then --steps greedy decode steps are timed with CUDA events after --warmup
steps (which must cover a page being filled and encoded, so that no kernel compiles inside the timing). Tokens/s = batch * steps / time.

With --graph the compressed cache decodes through `kvcompress.DecodeGraph`: after two eager steps, each step
is replayed from one CUDA graph, so the host no longer sets the pace (DynamicCache cannot be captured: its
tensors grow every step).

Each cache runs in its own fresh process by default (--in-process runs both in this one). At batch 8
and 32K tokens both decode steps are bound by the host (eager transformers: about 1,050 launches per
step), and on an H200 the host time of the same step varied up to 2.5-fold between runs (BENCHMARKS.md);
--profile N prints how long the device was busy per step, which does not depend on the host.

Longest context at this batch: the peak memory (torch.cuda.max_memory_allocated over prefill + decode)
is measured at two prompt lengths, L/2 and L; it is linear in the length, peak(n) = a + b*n, and the
longest context is the n where a + b*n reaches the memory this process can use (free memory at start
plus what it already held, i.e. the model). Cache bytes per token (the cache's own tensors: memory_report
for CompressedCache, the K/V tensors for DynamicCache) are printed beside it.

    python benchmarks/e2e_decode.py --out e2e.md                  # H200: batch 8, 32K prompt, 64 steps
    python benchmarks/e2e_decode.py --graph --out e2e_graph.md    # the compressed decode replayed from a CUDA graph
    TRITON_INTERPRET=1 KVCOMPRESS_KERNELS=triton python benchmarks/e2e_decode.py --tiny --out /tmp/e2e.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

import kvcompress
from kvcompress.cache import CompressedCache
from kvcompress.compat import with_cache
from kvcompress.kernels.backend import select_backend

LLAMA_8B = dict(
    num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
    intermediate_size=14336, vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0,
)
TINY = dict(
    num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
    intermediate_size=512, vocab_size=1000, max_position_embeddings=4096,
)


def build_model(tiny: bool, device: torch.device):
    """Random-weight Llama built on `device` (bf16 on CUDA, fp32 on CPU); init is the config's normal_."""
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(**(TINY if tiny else LLAMA_8B))
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.set_attn_implementation("sdpa")
    return model


def warmup_steps(preset: str, tiny: bool) -> int:
    """Untimed steps that fill and encode one page of every layer of `preset` (its largest page + 8)."""
    from transformers import LlamaConfig

    config = kvcompress.KVCompressConfig.from_preset(preset, LlamaConfig(**(TINY if tiny else LLAMA_8B)))
    return max(layer.page_size for layer in config.layers) + 8


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, cache, chunk: int) -> torch.Tensor:
    """ids [B, T] in chunks of `chunk` tokens; returns the next tokens [B, 1]."""
    logits = None
    for lo in range(0, ids.shape[1], chunk):
        logits = model(ids[:, lo:lo + chunk], logits_to_keep=1, **with_cache(cache)).logits
    return logits[:, -1:].argmax(-1)


@torch.no_grad()
def decode(model, token: torch.Tensor, cache, steps: int, graph=None) -> torch.Tensor:
    """Greedy steps: eager forwards, or `graph.step` (a kvcompress DecodeGraph) when given."""
    for _ in range(steps):
        if graph is not None:
            token = graph.step(token).argmax(-1, keepdim=True)
        else:
            token = model(token, logits_to_keep=1, **with_cache(cache)).logits[:, -1:].argmax(-1)
    return token


def timed_decode(model, token, cache, steps: int, device, graph=None) -> float:
    """Seconds for `steps` decode steps (CUDA events on the GPU, wall clock on CPU)."""
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        decode(model, token, cache, steps, graph)
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3
    t0 = time.perf_counter()
    decode(model, token, cache, steps, graph)
    return time.perf_counter() - t0


def cache_bytes(cache) -> int:
    if isinstance(cache, CompressedCache):
        return cache.memory_report()["held_bytes"]
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def make_cache(kind: str, model, preset: str):
    from transformers import DynamicCache

    if kind == "dynamic":
        kvcompress.disable(model)
        model.set_attn_implementation("sdpa")
        return DynamicCache()
    kvcompress.enable(model)
    return CompressedCache(model.config, preset)


def run_one(kind, model, args, length, device, timed: bool) -> dict:
    """Prefill `length` tokens and decode; peak memory, cache bytes and (if timed) tokens/s."""
    g = torch.Generator(device="cpu").manual_seed(length)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, length), generator=g).to(device)
    cache = make_cache(kind, model, args.preset)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    token = prefill(model, ids, cache, args.chunk)
    graph = None
    if args.graph and kind != "dynamic":
        graph = kvcompress.DecodeGraph(model, cache, max_tokens=length + args.warmup + args.steps + args.profile + 1,
                                       use_graph=device.type == "cuda")
    token = decode(model, token, cache, args.warmup, graph)
    sync(device)
    row = {"length": length, "cache_bytes": cache_bytes(cache), "tokens": cache.get_seq_length()}
    if timed:
        seconds = timed_decode(model, token, cache, args.steps, device, graph)
        row["tok_s"] = args.batch * args.steps / seconds
        row["ms_step"] = 1e3 * seconds / args.steps
        if args.profile:
            profile_steps(model, token, cache, args.profile, kind, graph)
    row["peak"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    del cache, ids, token
    return row


def profile_steps(model, token, cache, steps: int, kind: str, graph=None) -> None:
    """Print where `steps` decode steps spend their time (torch.profiler: top ops by device and host time)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=acts) as prof:
        decode(model, token, cache, steps, graph)
        sync(token.device)
    busy = sum(e.self_device_time_total for e in prof.key_averages()) / 1e3 / steps
    print(f"--- {kind}: the device was busy {busy:.1f} ms per decode step (sum of kernel times)")
    for key in (["cuda_time_total"] if torch.cuda.is_available() else []) + ["self_cpu_time_total"]:
        print(f"--- {kind}: {steps} decode steps, top ops by {key}")
        print(prof.key_averages().table(sort_by=key, row_limit=18, max_name_column_width=60))


def longest_context(short: dict, long: dict, capacity: int) -> tuple[int, float]:
    """Fit peak(n) = a + b*n through the two runs; the n where it reaches `capacity` bytes."""
    b = (long["peak"] - short["peak"]) / (long["length"] - short["length"])
    a = long["peak"] - b * long["length"]
    return (int((capacity - a) / b) if b > 0 else 0), b


def measure(kind: str, args, device) -> dict:
    """Prefill and decode one cache at L/2 and L tokens: its timed row, peak memory fit and capacity."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    model = build_model(args.tiny, device)
    capacity = free if device.type == "cuda" else 0  # memory this process could use (model included)
    short = run_one(kind, model, args, args.prompt // 2, device, timed=False)
    long = run_one(kind, model, args, args.prompt, device, timed=True)
    fit, per_token = longest_context(short, long, capacity) if device.type == "cuda" else (0, 0.0)
    long.update(short_peak=short["peak"], longest=fit, peak_per_token=per_token,
                cache_per_token=long["cache_bytes"] / long["tokens"], capacity=capacity)
    kvcompress.disable(model)
    del model
    return long


def measure_in_child(kind: str, argv) -> dict:
    """`measure` in a fresh Python process (this script with --only), its row read back from JSON."""
    argv = list(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "row.json")
        i = argv.index("--out") if "--out" in argv else None
        if i is not None:
            argv = argv[:i] + argv[i + 2:]
        argv = [a for a in argv if not a.startswith("--out=")]
        only = "dynamic" if kind == "dynamic" else "compressed"
        subprocess.run([sys.executable, os.path.abspath(__file__), *argv, "--only", only, "--out", out], check=True)
        with open(out) as f:
            return json.load(f)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model and short context (CPU check)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 32768, tiny 96)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk (default 2048, tiny 32)")
    ap.add_argument("--steps", type=int, default=None, help="timed decode steps (default 64, tiny 4)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="untimed decode steps first (default: the preset's largest page + 8, 56 for nuq4's pages of "
                         "48): enough to fill and encode one page so that every kernel is compiled before the timing")
    ap.add_argument("--preset", default="nuq4")
    ap.add_argument("--profile", type=int, default=0, help="also profile this many decode steps per cache")
    ap.add_argument("--graph", action="store_true",
                    help="decode the compressed cache through kvcompress.DecodeGraph (each step replayed from one "
                         "CUDA graph; DynamicCache stays eager, as transformers runs it)")
    ap.add_argument("--out", required=True, help="file the result table is written to")
    ap.add_argument("--in-process", action="store_true",
                    help="run both caches in this process, one after the other (default: a fresh process each)")
    ap.add_argument("--only", choices=("dynamic", "compressed"), help=argparse.SUPPRESS)  # one cache, JSON to --out
    args = ap.parse_args(argv)
    args.batch = args.batch or (2 if args.tiny else 8)
    args.prompt = args.prompt or (96 if args.tiny else 32768)
    args.chunk = args.chunk or (32 if args.tiny else 2048)
    args.steps = args.steps or (4 if args.tiny else 64)
    if args.warmup is None:
        args.warmup = warmup_steps(args.preset, args.tiny)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    backend = select_backend(device)
    kinds = ("dynamic", args.preset)
    if args.only:
        kind = kinds[args.only == "compressed"]
        with open(args.out, "w") as f:
            json.dump(measure(kind, args, device), f)
        return
    if args.in_process:
        results = {kind: measure(kind, args, device) for kind in kinds}
    else:
        results = {kind: measure_in_child(kind, argv) for kind in kinds}

    base, comp = results["dynamic"], results[args.preset]
    capacity = comp["capacity"]
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    head = (f"e2e decode, {datetime.date.today()}, {gpu}, {'tiny' if args.tiny else 'Llama-3.1-8B shape'} "
            f"random weights, batch {args.batch}, prompt {args.prompt} (chunks {args.chunk}), {args.steps} "
            f"timed steps after {args.warmup}; kvcompress kernels: {backend}"
            f"{'; compressed decode replayed from a CUDA graph (DecodeGraph)' if args.graph else ''}")
    lines = [head, "",
             "| cache | tok/s | ms/step | cache bytes/token (batch) | peak bytes/token | peak GiB | longest context |",
             "|---|---|---|---|---|---|---|"]
    for kind, r in results.items():
        lines.append(f"| {kind} | {r['tok_s']:.1f} | {r['ms_step']:.2f} | {r['cache_per_token']:.0f} | "
                     f"{r['peak_per_token']:.0f} | {r['peak'] / 2**30:.2f} | {r['longest']} |")
    speed = comp["tok_s"] / base["tok_s"]
    ctx = comp["longest"] / base["longest"] if base["longest"] else float("nan")
    lines += ["", f"{args.preset} vs dynamic: decode speed {speed:.2f}x, longest context {ctx:.2f}x "
              f"(capacity {capacity / 2**30:.1f} GiB: free memory at start, the model included)"]
    text = "\n".join(lines) + "\n"
    with open(args.out, "w") as f:
        f.write(text)
    print(text)


if __name__ == "__main__":
    main()
