"""ΔPPL of sparsity policies on SmolLM2-135M: prefill the first half of N tokens of
kvcompress/data/eval.txt, decode the rest token by token (teacher forcing), perplexity of the decoded half.

    python benchmarks/sparse_ppl.py 1024 [config,config,...]
"""
import importlib.resources as ir
import math
import os
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
# TEXT=calib / OFFSET=<tokens>: a held-out check on another text or another slice of eval.txt
text = (ir.files("kvcompress") / "data" / (os.environ.get("TEXT", "eval") + ".txt")).read_text()
OFFSET = int(os.environ.get("OFFSET", "0"))
ids = tok(text, return_tensors="pt").input_ids[:, OFFSET:OFFSET + N]
layout = ModelLayout.from_model_config(model.config)


def config(name, spec):
    return KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=spec) for _ in range(layout.num_layers)], name=name)


def layered(name, method, ratios, recent_share=0.0, recent=0, **kw):
    """One ratio per layer (1.0: the layer stays dense, counted as holding/reading the whole context).

    recent_share: H2O's recent window as a share of the layer's budget at the mean decode context
    (768 tokens here; SparsitySpec.recent is a token count), 0: half of the budget."""
    specs = [
        SparsitySpec(method, ratio=r, recent=int(recent_share * r * 768) if recent_share else recent, **kw)
        if r < 1.0 else SparsitySpec()
        for r in ratios
    ]
    return KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=s) for s in specs], name=name)


def dense_first(n_dense, share):
    """n_dense dense layers, the others at the ratio that keeps the mean over all layers at `share`."""
    n = layout.num_layers
    return [1.0] * n_dense + [(share * n - n_dense) / (n - n_dense)] * (n - n_dense)


def fixed(share, ratios):
    """Ratios {layer: ratio} for some layers, the others equal at the ratio that keeps the mean at `share`."""
    n = layout.num_layers
    rest = (share * n - sum(ratios.values())) / (n - len(ratios))
    assert 0.0 < rest <= 1.0, rest
    return [ratios.get(i, rest) for i in range(n)]


def dense(layers):
    return {i: 1.0 for i in layers}


CONFIGS = {
    "h2o-50": "h2o-50",
    "h2o-25": config("h2o-25", SparsitySpec("h2o", ratio=0.25, page_size=16)),
    "quest-50%": config("quest-50%", SparsitySpec("quest", ratio=0.5, page_size=8, dense_layers=2)),
    "quest-25%": config("quest-25%", SparsitySpec("quest", ratio=0.25, page_size=8, dense_layers=2)),
    "snapkv-50": "snapkv-50",
    # the paper's settings (window 32, pooling kernel 7), the preset's before it took kvpress's 64 / 5
    "snapkv-50-w32k7": config("snapkv-50-w32k7", SparsitySpec("snapkv", ratio=0.5, observation_window=32,
                                                              pool_kernel=7)),
    "streaming-50%": config("streaming-50%", SparsitySpec("streaming", ratio=0.5, sinks=4, page_size=16)),
    # per-layer budgets at the same mean share (a dense layer counts as 100%)
    "h2o-50-d2": layered("h2o-50-d2", "h2o", dense_first(2, 0.5), page_size=16),
    "h2o-50-p8": config("h2o-50-p8", SparsitySpec("h2o", ratio=0.5, page_size=8)),
    "quest-25-d4": layered("quest-25-d4", "quest", dense_first(4, 0.25), page_size=8),
    # H2O: the layers whose pair costs most at 25% alone (probes below) kept dense or at a higher ratio
    "h2o-50-A": layered("h2o-50-A", "h2o", fixed(0.5, dense([2, 3, 6, 7, 14, 15])), page_size=16),
    "h2o-50-C": layered("h2o-50-C", "h2o", fixed(0.5, dense([2, 3, 6, 7])), page_size=16),
    "h2o-50-B": layered("h2o-50-B", "h2o", fixed(0.5, {**dense([2, 3, 6, 7]), **{i: 0.6 for i in (14, 15, 16, 17, 20, 21, 26, 27)}}), page_size=16),
    "h2o-25-A": layered("h2o-25-A", "h2o", fixed(0.25, dense([2, 3, 6, 7])), page_size=16),
    "h2o-25-B": layered("h2o-25-B", "h2o", fixed(0.25, {**dense([6, 7]), **{i: 0.5 for i in (2, 3, 14, 15)}}), page_size=16),
    "h2o-25-C": layered("h2o-25-C", "h2o", fixed(0.25, {i: 0.5 for i in (2, 3, 6, 7, 14, 15)}), page_size=16),
    # H2O at 25%: tiers from the probes (insensitive pairs 4-5, 12-13, 18-19, 22-23, 24-25 get least)
    "h2o-25-D": layered("h2o-25-D", "h2o", fixed(0.25, {
        **{i: 0.6 for i in (6, 7)}, **{i: 0.45 for i in (2, 3, 14, 15)},
        **{i: 0.3 for i in (16, 17, 20, 21, 26, 27)}, **{i: 0.1 for i in (18, 19, 22, 23)}}), page_size=16),
    "h2o-25-E": layered("h2o-25-E", "h2o", fixed(0.25, {
        **{i: 0.5 for i in (2, 3, 6, 7, 14, 15)}, **{i: 0.1 for i in (4, 5, 12, 13, 18, 19, 22, 23)}}), page_size=16),
    "h2o-25-F": layered("h2o-25-F", "h2o", fixed(0.25, {
        **{i: 0.6 for i in (2, 3, 6, 7, 14, 15)}, **{i: 0.08 for i in (4, 5, 12, 13, 18, 19, 22, 23, 24, 25)}}), page_size=16),
}
H2O_25_C = fixed(0.25, {i: 0.5 for i in (2, 3, 6, 7, 14, 15)})
H2O_25_D = fixed(0.25, {
    **{i: 0.6 for i in (6, 7)}, **{i: 0.45 for i in (2, 3, 14, 15)},
    **{i: 0.3 for i in (16, 17, 20, 21, 26, 27)}, **{i: 0.1 for i in (18, 19, 22, 23)}})
# without sinks a recent window as large as the budget evicts the attention sinks: +109% (r75 below, 0 sinks)
CONFIGS["h2o-25-D-r75"] = layered("h2o-25-D-r75", "h2o", H2O_25_D, recent_share=0.75, page_size=16)
for _share in (0.15, 0.25, 0.35):  # a smaller recent window (more heavy hitters), sinks not forced
    CONFIGS[f"h2o-25-D-r{round(_share * 100)}"] = layered(f"h2o-25-D-r{round(_share * 100)}", "h2o", H2O_25_D, recent_share=_share, page_size=16)
CONFIGS["h2o-25-D-r25-p8"] = layered("h2o-25-D-r25-p8", "h2o", H2O_25_D, recent_share=0.25, page_size=8)
CONFIGS["h2o-25-D-p8"] = layered("h2o-25-D-p8", "h2o", H2O_25_D, page_size=8)
CONFIGS.update({
    # Quest at 25%: same mean read as quest-25% (ratio 0.25 + 2 dense layers = 0.30 nominal) ...
    "quest-25-E": layered("quest-25-E", "quest", fixed(0.30, dense([6, 7])), page_size=8),
    "quest-25-F": layered("quest-25-F", "quest", fixed(0.30, dense([2, 3, 6, 7])), page_size=8),
    "quest-25-G": layered("quest-25-G", "quest", fixed(0.30, {**dense([6, 7]), **{i: 0.5 for i in (2, 3, 14, 15)}}), page_size=8),
    # ... and strict 25% mean (dense layers counted at 100%)
    "quest-25-A": layered("quest-25-A", "quest", fixed(0.25, dense([6, 7])), page_size=8),
    "quest-25-C": layered("quest-25-C", "quest", fixed(0.25, {**dense([6, 7]), **{i: 0.5 for i in (2, 3, 14, 15)}}), page_size=8),
})
QUEST_25_G = fixed(0.30, {**dense([6, 7]), **{i: 0.5 for i in (2, 3, 14, 15)}})
CONFIGS["quest-25-G-p4"] = layered("quest-25-G-p4", "quest", QUEST_25_G, page_size=4)
CONFIGS["quest-25-E-p4"] = layered("quest-25-E-p4", "quest", fixed(0.30, dense([6, 7])), page_size=4)
CONFIGS["quest-25%-p4"] = config("quest-25%-p4", SparsitySpec("quest", ratio=0.25, page_size=4, dense_layers=2))
# strict 25% mean read with pages of 4
CONFIGS["quest-25-A-p4"] = layered("quest-25-A-p4", "quest", fixed(0.25, dense([6, 7])), page_size=4)
CONFIGS["quest-25-C-p4"] = layered("quest-25-C-p4", "quest", fixed(0.25, {**dense([6, 7]), **{i: 0.5 for i in (2, 3, 14, 15)}}), page_size=4)
CONFIGS["quest-25-U-p4"] = config("quest-25-U-p4", SparsitySpec("quest", ratio=0.25, page_size=4))  # no dense layer
# budget sharing, every layer at 25 %: the layer's kv heads share its pages (S), and the layers share the step's (L)
CONFIGS["quest-25-S-p4"] = config("quest-25-S-p4", SparsitySpec("quest", ratio=0.25, page_size=4, budget_sharing="heads"))
CONFIGS["quest-25-S-p8"] = config("quest-25-S-p8", SparsitySpec("quest", ratio=0.25, page_size=8, budget_sharing="heads"))
CONFIGS["quest-25-L-p4"] = config("quest-25-L-p4", SparsitySpec("quest", ratio=0.25, page_size=4, budget_sharing="layers"))
CONFIGS["quest-25-L-p8"] = config("quest-25-L-p8", SparsitySpec("quest", ratio=0.25, page_size=8, budget_sharing="layers"))
# per-layer sensitivity probes: only layers a, a+1 sparse (at 25%), every other layer dense
for _a in range(0, layout.num_layers, 2):
    _r = [0.25 if i in (_a, _a + 1) else 1.0 for i in range(layout.num_layers)]
    CONFIGS[f"probe-h2o-{_a}"] = layered(f"probe-h2o-{_a}", "h2o", _r, page_size=16)
    CONFIGS[f"probe-quest-{_a}"] = layered(f"probe-quest-{_a}", "quest", _r, page_size=8)


def ppl(cache):
    half, nll, read, held = N // 2, 0.0, [], []
    with torch.inference_mode():
        logits = model(ids[:, :half], **with_cache(cache)).logits[:, -1]
        for t in range(half, N):
            nll -= torch.log_softmax(logits.float(), -1)[0, ids[0, t]].item()
            if t == N - 1:
                break
            logits = model(ids[:, t:t + 1], **with_cache(cache)).logits[:, -1]
            if hasattr(cache, "tokens_read_last_step"):
                read.append(cache.tokens_read_last_step())
                held.append(sum(lay.held_tokens for lay in cache.layers) / len(cache.layers))
    mean = lambda x: sum(x) / len(x) if x else float("nan")  # noqa: E731
    return math.exp(nll / (N - half)), mean(read), mean(held)


# BASE=<ppl> skips the uncompressed run (when configs are measured in several processes)
base = float(os.environ["BASE"]) if "BASE" in os.environ else ppl(DynamicCache(config=model.config))[0]
ctx = sum(range(N // 2 + 1, N)) / (N // 2 - 1)  # mean context over the decode steps
print(f"mean context over decode steps: {ctx:.1f} tokens")
print("| config | PPL | ΔPPL | tokens held (max layer, end) | tokens held / step (mean over layers, decode) "
      "| tokens read / step (mean over layers, decode) | read share | held bytes | time |")
print("|---|---|---|---|---|---|---|---|---|")
print(f"| uncompressed | {base:.4f} | - | {N} | {ctx:.1f} | {ctx:.1f} | 100% | - | - |", flush=True)
with kvcompress.enabled(model):
    for name, cfg in CONFIGS.items():
        if only and name not in only:
            continue
        t0 = time.time()
        cache = CompressedCache(model.config, cfg)
        v, read, held = ppl(cache)
        r = cache.memory_report()
        print(f"| {name} | {v:.4f} | {100 * (v / base - 1):+.3f}% | {r['tokens_held']} | {held:.1f} | {read:.1f} "
              f"| {100 * read / ctx:.1f}% | {r['held_bytes']} | {time.time() - t0:.0f}s |", flush=True)
