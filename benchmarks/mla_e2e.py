"""End-to-end decode of an MLA model: DynamicCache vs CompressedCache(nuq4), eager and from a CUDA graph.

The model is DeepSeek-V2-Lite-shaped attention (hidden 2048, 16 heads, latent 512 + 64 RoPE, q without
LoRA, nope 128, v 128, vocab 102400; --shape v3: DeepSeek-V3's 128 heads, hidden 7168, q LoRA 1536, dense
MLPs of width 18432) over --layers layers with dense MLPs (intermediate 10944), random bf16
weights built on the GPU (nothing is downloaded; decode speed does not depend on the weights). All three run
under `kvcompress.enable(model)` (absorbed attention, the fused MLA kernels):

- dynamic:    DynamicCache (the exact bf16 latent, read by the dense-latent kernel);
- nuq4:       CompressedCache(config, "nuq4"), eager steps (the packed-latent kernel);
- nuq4-graph: the same, decoded through `kvcompress.DecodeGraph` (each step replayed from one CUDA graph);
- any other preset name (--kinds), eager; with "@torch" after it, on the torch backend
  (`kvcompress.enable(model, backend="torch")`: a sparse policy's attention in torch), for instance
  `--kinds dynamic nuq4+h2o-20 nuq4+h2o-20@torch`.

The prompt is prefilled in chunks of --chunk tokens; then --warmup greedy steps (a page flush included),
then --steps timed with CUDA events. Tokens/s = batch * steps / time.

    PYTHONPATH=. python benchmarks/mla_e2e.py --batch 8 --prompt 8192 --out mla_e2e.md
    PYTHONPATH=. python benchmarks/mla_e2e.py --kinds dynamic nuq4+h2o-20 nuq4+h2o-20@torch
"""

from __future__ import annotations

import argparse
import datetime

import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, DynamicCache

import kvcompress
from kvcompress.cache import CompressedCache
from kvcompress.compat import with_cache

V2_LITE = dict(hidden_size=2048, num_attention_heads=16, num_key_value_heads=16, q_lora_rank=None, kv_lora_rank=512,
               qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=10944,
               vocab_size=102400, max_position_embeddings=65536)


# DeepSeek-V3's attention (128 heads, q through a 1536 LoRA) with a dense MLP of its width
V3 = dict(hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
          qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, intermediate_size=18432,
          vocab_size=129280, max_position_embeddings=65536)
SHAPES = {"v2-lite": V2_LITE, "v3": V3}


def build(layers: int, device, shape: str = "v2-lite"):
    cfg = DeepseekV3Config(**SHAPES[shape], num_hidden_layers=layers, first_k_dense_replace=layers,
                           attn_implementation="sdpa")
    torch.manual_seed(0)
    with torch.device(device):
        model = DeepseekV3ForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


@torch.no_grad()
def run(model, kind: str, args) -> dict:
    dev = next(model.parameters()).device
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.prompt), generator=g).to(dev)
    preset, _, backend = kind.partition("@")
    preset = "nuq4" if preset == "nuq4-graph" else preset
    kvcompress.enable(model, backend=backend or "fused")
    cache = DynamicCache(config=model.config) if kind == "dynamic" else CompressedCache(model.config, preset)
    for lo in range(0, args.prompt, args.chunk):
        out = model(ids[:, lo: lo + args.chunk], logits_to_keep=1, **with_cache(cache))
    token = out.logits[:, -1:].argmax(-1)
    graph = None
    if kind == "nuq4-graph":
        graph = kvcompress.DecodeGraph(model, cache, max_tokens=args.prompt + args.warmup + args.steps + 1)

    def step(tok):
        if graph is not None:
            return graph.step(tok).argmax(-1, keepdim=True)
        return model(tok, logits_to_keep=1, **with_cache(cache)).logits[:, -1:].argmax(-1)

    for _ in range(args.warmup):
        token = step(token)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(args.steps):
        token = step(token)
    end.record()
    torch.cuda.synchronize()
    ms = start.elapsed_time(end) / args.steps
    held = cache.memory_report()["held_bytes"] if kind != "dynamic" else sum(
        t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    if graph is not None:
        graph.release()
    return {"kind": kind, "ms_step": ms, "tok_s": args.batch * 1e3 / ms, "cache_mb": held / 2**20}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="v2-lite", help="attention sizes (v3: 128 heads)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--warmup", type=int, default=70)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--kinds", nargs="+", default=["dynamic", "nuq4", "nuq4-graph"],
                    help="caches to time, the first the baseline: dynamic, nuq4-graph or a preset[@torch]")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    model = build(args.layers, torch.device("cuda"), args.shape)
    rows = [run(model, kind, args) for kind in args.kinds]
    base = rows[0]["ms_step"]
    lines = [
        f"# MLA decode end to end ({args.layers} layers of DeepSeek-{args.shape}-shaped attention, dense MLPs, bf16)",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; device: {torch.cuda.get_device_name()}; "
        f"batch {args.batch}, prompt {args.prompt}, {args.steps} timed steps after {args.warmup}",
        "",
        f"| cache | ms / step | tokens / s | speed vs {rows[0]['kind']} | cache MB |",
        "|---|---|---|---|---|",
        *(f"| {r['kind']} | {r['ms_step']:.2f} | {r['tok_s']:.0f} | {base / r['ms_step']:.2f}x | {r['cache_mb']:.0f} |"
          for r in rows),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
