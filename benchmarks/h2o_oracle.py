"""A ceiling for query-agnostic eviction: H2O against H2O with hindsight, at the same budget, in one run.

The hindsight policy evicts by the attention each held token will receive from every later decode step,
as recorded in a first pass through H2O layers that keep everything (ratio 1.0, which is also the
uncompressed reference: with a budget >= the context H2O is exact). No policy that must decide without
the future queries ranks tokens better by that measure, so its perplexity bounds what better scores
(accumulated, averaged, decayed, value-aware, ...) can give H2O at this budget. "hindsight-recent" also
forces the policy's recent window (half the budget) and ranks only the heavy hitters by the future.

    python benchmarks/h2o_oracle.py [RATIO] [WINDOWS]    # default: 0.25 1 (the issue's window)

Protocol of `kvcompress eval` (1024-token windows of eval.txt, prefill half, decode the rest token by
token, every layer at RATIO of the tokens seen, pages of 16); float32, one thread.
"""
import sys

import torch

import kvcompress
from kvcompress import CompressedCache, KVCompressConfig, LayerPolicy, ModelLayout, SparsitySpec
from kvcompress.evaluation import context_windows, perplexity
from kvcompress.sparse import h2o
from kvcompress.sparse.base import compact, recent_mask

RATIO = float(sys.argv[1]) if len(sys.argv) > 1 else 0.25
WINDOWS = int(sys.argv[2]) if len(sys.argv) > 2 else 1
CONTEXT = 1024

_after = h2o.H2OPolicy.after_attention
_recorded: dict[int, list[torch.Tensor]] = {}  # layer -> per decode step, mass [H, held] (batch 1)
_future: dict[int, torch.Tensor] = {}  # layer -> [steps + 1, H, N]: row s sums the steps >= s
_step: dict[int, int] = {}
_force_recent = [False]


def recording(self, layer, state, mass, valid):
    if state.step.q_len == 1:
        _recorded.setdefault(layer.layer_idx, []).append(mass[0].float().clone())
    return _after(self, layer, state, mass, valid)


def hindsight(self, layer, state, mass, valid):
    """H2O's bookkeeping and budget, but the tokens kept are those with the most future attention."""
    i, q, held = layer.layer_idx, state.step.q_len, valid.shape[-1]
    old = state.scores if state.scores is not None else mass.new_zeros(mass.shape[:2] + (held - q,))
    state.scores = torch.cat([old, old.new_zeros(old.shape[:2] + (q,))], dim=2) + mass.float()
    step = _step[i] = _step.get(i, -1) + 1 if q == 1 else -1  # the decode step just run (-1: prefill)
    budget = self.token_budget(layer.cumulative_length)
    if held <= budget + (0 if q > 1 else self.page_size):
        return
    pos = state.positions(held, valid).long()  # [B, H, held]
    future = _future[i][step + 1]  # [H, N]: attention from the steps after this one
    priority = future[None].expand(pos.shape[0], -1, -1).gather(2, pos)
    forced = recent_mask(held, self.recent_window(budget), valid) if _force_recent[0] else torch.zeros_like(valid)
    compact(layer, state, priority, forced, valid, budget)


def config(layout, ratio):
    spec = SparsitySpec("h2o", ratio=ratio, page_size=16)
    return KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=spec) for _ in range(layout.num_layers)],
                            name=f"h2o-{ratio}")


def main():
    torch.set_num_threads(1)
    model, tok = kvcompress.load_model("smollm2-135m")
    layout = ModelLayout.from_model_config(model.config)

    def ppl(after, ratio, ids):
        h2o.H2OPolicy.after_attention = after
        try:
            with kvcompress.enabled(model):
                return perplexity(model, tok, lambda: CompressedCache(model.config, config(layout, ratio)), ids).ppl
        finally:
            h2o.H2OPolicy.after_attention = _after

    rows = {"H2O (the policy)": [], "hindsight": [], "hindsight-recent": []}
    for ids in context_windows(tok, CONTEXT, WINDOWS):
        _recorded.clear()
        ref = ppl(recording, 1.0, ids)
        for i, masses in _recorded.items():
            m = torch.zeros(len(masses) + 1, masses[0].shape[0], ids.shape[1])
            for t, x in enumerate(masses):
                m[t, :, : x.shape[-1]] = x
            _future[i] = m.flip(0).cumsum(0).flip(0)
        for name in rows:
            _step.clear()
            _force_recent[0] = name == "hindsight-recent"
            p = ppl(_after if name.startswith("H2O") else hindsight, RATIO, ids)
            rows[name].append(100 * (p / ref - 1))
    print(f"H2O at {RATIO:.0%} of the context, {WINDOWS} window(s) of {CONTEXT} tokens of eval.txt")
    print("| eviction ranked by | Δppl per window | mean |\n|---|---|---|")
    for name, d in rows.items():
        print(f"| {name} | " + ", ".join(f"{x:+.3f} %" for x in d) + f" | {sum(d) / len(d):+.3f} % |")


if __name__ == "__main__":
    main()
