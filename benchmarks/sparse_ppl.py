"""ΔPPL of sparsity policies on SmolLM2-135M: prefill the first half of N tokens of
kvcompress/data/eval.txt, decode the rest token by token (teacher forcing), perplexity of the decoded half.

    python benchmarks/sparse_ppl.py 1024 [config,config,...]
"""
import importlib.resources as ir
import math
import sys
import time

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress import CompressedCache, KVCompressConfig, LayerPolicy, ModelLayout, SparsitySpec
from kvcompress.compat import with_cache

torch.set_num_threads(1)
N = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
only = sys.argv[2].split(",") if len(sys.argv) > 2 else None
model, tok = kvcompress.load_model()
model.eval()
text = (ir.files("kvcompress") / "data" / "eval.txt").read_text()
ids = tok(text, return_tensors="pt").input_ids[:, :N]
layout = ModelLayout.from_model_config(model.config)


def config(name, spec):
    return KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=spec) for _ in range(layout.num_layers)], name=name)


CONFIGS = {
    "h2o-50": "h2o-50",
    "h2o-25": config("h2o-25", SparsitySpec("h2o", ratio=0.25, page_size=16)),
    "quest-50%": config("quest-50%", SparsitySpec("quest", ratio=0.5, page_size=8, dense_layers=2)),
    "quest-25%": config("quest-25%", SparsitySpec("quest", ratio=0.25, page_size=8, dense_layers=2)),
    "snapkv-50": "snapkv-50",
    "streaming-50%": config("streaming-50%", SparsitySpec("streaming", ratio=0.5, sinks=4, page_size=16)),
}


def ppl(cache):
    half, nll, read = N // 2, 0.0, []
    with torch.inference_mode():
        logits = model(ids[:, :half], **with_cache(cache)).logits[:, -1]
        for t in range(half, N):
            nll -= torch.log_softmax(logits.float(), -1)[0, ids[0, t]].item()
            if t == N - 1:
                break
            logits = model(ids[:, t:t + 1], **with_cache(cache)).logits[:, -1]
            if hasattr(cache, "tokens_read_last_step"):
                read.append(cache.tokens_read_last_step())
    return math.exp(nll / (N - half)), (sum(read) / len(read) if read else float("nan"))


import os

# BASE=<ppl> skips the uncompressed run (when configs are measured in several processes)
base = float(os.environ["BASE"]) if "BASE" in os.environ else ppl(DynamicCache(config=model.config))[0]
print("| config | PPL | ΔPPL | tokens held (max layer, end) | tokens read / step (mean over layers, decode) | held bytes | time |")
print("|---|---|---|---|---|---|---|")
print(f"| uncompressed | {base:.4f} | - | {N} | {N} (end) | - | - |", flush=True)
with kvcompress.enabled(model):
    for name, cfg in CONFIGS.items():
        if only and name not in only:
            continue
        t0 = time.time()
        cache = CompressedCache(model.config, cfg)
        v, read = ppl(cache)
        r = cache.memory_report()
        print(f"| {name} | {v:.4f} | {100 * (v / base - 1):+.3f}% | {r['tokens_held']} | {read:.1f} | {r['held_bytes']} | {time.time() - t0:.0f}s |", flush=True)
