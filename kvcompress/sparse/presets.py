"""Sparsity presets, registered into kvcompress.presets.

- streaming: StreamingLLM, 4 sinks + the newest 1020 tokens.
- h2o-20 / h2o-50: H2O keeping 20% / 50% of the context, half heavy hitters, half recent window.
- h2o-25: H2O keeping 25% of the context with 4 sinks: the base that `kvcompress calibrate -p h2o-25` gives
  per-kv-head budgets (head_shares, kvcompress.calib.head_budgets).
- h2o-merge-50: h2o-50 with 4 sinks always kept and each evicted token merged into its most similar kept
  token (means weighted by the attention each token received, log-size attention bias;
  kvcompress.sparse.merge) instead of dropped; full-precision layers only. SmolLM2-135M, 8 windows of 1024
  tokens (eval.txt and calib.txt): -0.34 % perplexity on average and 38 % less KL than merging with means
  weighted by size (+0.30 %), against +0.48 % for h2o-50 (BENCHMARKS.md, "H2O merges weighted by
  attention"). At 25 % of the context merging loses more than dropping (+3.8 % against +3.4 % on the first
  window), so there is no merged 20 % preset.
- snapkv-50: SnapKV keeping 50% of the prompt (window 64, pooling 5: kvpress's SnapKVPress defaults).
- quest-512 / quest-1024 / quest-2048: Quest reading that many tokens per step (pages of 8), the
  first 2 layers dense.
- nuq4+h2o-20: the same over nuq4 storage, in pages of 16 tokens (H2O evicts whole packed pages, so
  smaller pages keep its choices fine-grained).
- nuq4+quest-1024: Quest over nuq4 storage, nuq4 and Quest pages of 64 tokens (a step reads every page
  summary, so larger pages read fewer bytes; see QUEST_NUQ_PAGE) and no separate sinks (Quest always
  reads the first page), so that Quest's pages are the body's pages and the fused kernel serves it.
- quest-25: Quest reading 25% of the context per step in pages of 4, every layer sparse, the layers'
  kv heads and the layers themselves sharing the step's pages by their estimated attention mass
  (budget_sharing="layers"; SmolLM2-135M at 1024 tokens: +0.69% / +1.21% perplexity on eval.txt /
  calib.txt, against +1.52% / +2.40% without sharing), and every page a step skips attended as one token
  (its key box's centre, its mean value, weighted by its 4 tokens: unread_means, kvcompress.sparse.unread;
  over 4 windows of 1024 of eval.txt / calib.txt +0.09% / +0.12% against +1.75% / +0.93% skipping them,
  KL 37% / 41% lower; BENCHMARKS.md, "Quest's skipped pages as one token each").
- pyramid-h2o-20: H2O with budgets decreasing linearly over depth (PyramidKV, arXiv:2406.02069),
  from 1.8x to 0.2x of 20% of the context, 20% on average.
"""

from __future__ import annotations

from dataclasses import replace

from kvcompress.config import LayerPolicy, SparsitySpec
from kvcompress.layout.arch import ModelLayout
from kvcompress.presets import MLA_PRESETS, PRESETS, LayerFn, register_preset

SPARSE_PAGE = 16  # H2O eviction chunk / packed pages under sparsity
# Quest pages: 8-token pages bound q.k tighter than 16 (SmolLM2-135M, reading 50% of the context:
# even choosing 16-token pages by their true attention mass costs +0.75% perplexity)
QUEST_PAGE = 8
# nuq4+quest-1024: nuq4 and Quest pages of 64. On SmolLM2, 4096 tokens of eval.txt (decode the second
# half), per step K/V bytes read against an uncompressed cache and Δppl (BENCHMARKS.md): nuq4 pages of
# 16 with Quest pages of 8: 17.3 %, +0.41 %; pages of 16: 11.6 %, +0.33 %; 32: 8.4 %, +0.89 %; 64: 7.7 %,
# +0.58 %; pages of 64 without the 4 exact sinks (what the fused kernel needs: Quest pages must be body
# pages) 7.7 %, +1.03 %. (Those runs had float32 min / max summaries; they are bfloat16 since, rounded
# outward.) Every page's summaries are read each step: 2 / P of the bytes of the keys in the model dtype.
QUEST_NUQ_PAGE = 64


def _sparse(
    spec: SparsitySpec, base: str = "none", page_size: int | None = None, sinks: int | None = None
) -> LayerFn:
    def fn(layout: ModelLayout, i: int) -> LayerPolicy:
        # the base preset as this layout means it (an MLA latent is coded per channel, its RoPE key in FP8)
        base_fn = MLA_PRESETS.get(base, PRESETS[base]) if layout.attention == "mla" else PRESETS[base]
        policy = base_fn(layout, i)
        # MLA layers keep no page means (kvcompress.sparse.unread): there Quest skips its unread pages
        layer_spec = replace(spec, unread_means=False) if layout.attention == "mla" else spec
        return replace(policy, sparsity=layer_spec, page_size=page_size or policy.page_size,
                       sinks=policy.sinks if sinks is None else sinks)

    return fn


def _pyramid_h2o(ratio: float, top: float = 1.8, bottom: float = 0.2) -> LayerFn:
    def fn(layout: ModelLayout, i: int) -> LayerPolicy:
        depth = i / max(layout.num_layers - 1, 1)
        layer_ratio = min(1.0, ratio * (top + (bottom - top) * depth))
        return LayerPolicy(sparsity=SparsitySpec(method="h2o", ratio=layer_ratio, page_size=SPARSE_PAGE))

    return fn


def h2o(ratio: float = 0.0, budget: int = 0) -> SparsitySpec:
    return SparsitySpec(method="h2o", ratio=ratio, budget=budget, page_size=SPARSE_PAGE)


def quest(budget: int = 0, ratio: float = 0.0, dense_layers: int = 2) -> SparsitySpec:
    return SparsitySpec(
        method="quest", budget=budget, ratio=ratio, page_size=QUEST_PAGE, dense_layers=dense_layers
    )


STREAMING = SparsitySpec(method="streaming", budget=1024, sinks=4, page_size=SPARSE_PAGE)
# Window 64 / pooling 5 (kvpress's defaults) rather than the paper's 32 / 7: on SmolLM2, 1024 tokens of
# eval.txt, prefill 512: +0.432 % against +0.611 % (BENCHMARKS.md), the same as kvpress's own SnapKVPress.
SNAPKV_50 = SparsitySpec(method="snapkv", ratio=0.5, observation_window=64, pool_kernel=5)

register_preset("streaming", _sparse(STREAMING))
register_preset("h2o-20", _sparse(h2o(0.2)))
register_preset("h2o-50", _sparse(h2o(0.5)))
register_preset("h2o-25", _sparse(replace(h2o(0.25), sinks=4)))
register_preset("h2o-merge-50", _sparse(replace(h2o(0.5), sinks=4, merge=True)))
register_preset("snapkv-50", _sparse(SNAPKV_50))
for _n in (512, 1024, 2048):
    register_preset(f"quest-{_n}", _sparse(quest(_n)))
register_preset("nuq4+h2o-20", _sparse(h2o(0.2), base="nuq4", page_size=SPARSE_PAGE))
register_preset("nuq4+quest-1024", _sparse(replace(quest(1024), page_size=QUEST_NUQ_PAGE), base="nuq4",
                                            page_size=QUEST_NUQ_PAGE, sinks=0))
register_preset("pyramid-h2o-20", _pyramid_h2o(0.2))
QUEST_25 = SparsitySpec(method="quest", ratio=0.25, page_size=4, budget_sharing="layers", unread_means=True)
register_preset("quest-25", _sparse(QUEST_25))
