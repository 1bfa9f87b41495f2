"""H2O: heavy hitters + a recent window (Zhang et al. 2023, arXiv:2306.14048).

Each held token accumulates the attention it receives (summed over its GQA group's query heads, per
kv head). The layer keeps the newest `recent` tokens plus the highest-scoring others, within the
budget, and evicts during decoding as well as after prefill: after prefill it compacts to the budget;
while decoding it lets the layer grow by up to `page_size` tokens, then compacts again, so memory
held stays bounded however many tokens are generated (evicted slots are freed, not masked).
With `sinks`, the first real tokens are always kept; with `merge`, evicted tokens are folded into the kept
ones (kvcompress.sparse.merge) instead of dropped. With `head_shares` each kv head keeps its own share of the
budget (its recent window half of its own budget) and the layer holds each head's tokens packed
(kvcompress.sparse.ragged).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.config import ConfigError, SparsitySpec
from kvcompress.sparse.base import SparsePolicy, evict_rows, newest_real, sink_mask
from kvcompress.sparse.merge import merge_compact
from kvcompress.sparse.ragged import evict_heads


@dataclass
class H2OPolicy(SparsePolicy):
    """recent: tokens of the recent window (0: half of the budget, "half heavy, half recent")."""

    recent: int = 0
    sinks: int = 0
    merge: bool = False
    head_shares: tuple[float, ...] = ()

    def __post_init__(self):
        super().__post_init__()
        if self.recent < 0 or (self.budget and self.recent > self.budget):
            raise ConfigError(
                f"H2O recent window must be in [0, budget]; got {self.recent} for budget {self.budget}"
            )

    @classmethod
    def from_spec(cls, spec: SparsitySpec) -> H2OPolicy:
        return cls(budget=spec.budget, ratio=spec.ratio, page_size=spec.page_size, recent=spec.recent,
                   sinks=spec.sinks, merge=spec.merge, head_shares=tuple(spec.head_shares))

    def recent_window(self, budget: int) -> int:
        return min(self.recent, budget) if self.recent else budget // 2

    def mass_queries(self, q_len: int) -> int:
        return q_len

    def after_attention(self, layer, state, mass, valid):
        held, q = valid.shape[-1], state.step.q_len
        state.count_padding(valid, q)  # the rows' budgets follow their real tokens
        old = state.scores if state.scores is not None else mass.new_zeros(mass.shape[:2] + (held - q,))
        state.scores = torch.cat([old, old.new_zeros(old.shape[:2] + (q,))], dim=2) + mass.float()
        if self.due(layer, state, held, q):
            self.evict(layer, state, valid, q)

    def slack(self, layer, q: int) -> int:
        """Tokens a layer may hold past its budget before it evicts: a page while decoding, none at prefill."""
        return 0 if q > 1 else (self.page_size if not layer.compressed else layer.key_store.page_size)

    def due(self, layer, state, held: int, q: int) -> bool:
        """Whether a layer holding `held` tokens after a step of q may be over a row's (or head's) budget: False
        when even the smallest budget covers it (host integers only, no wait on the device)."""
        least = self.token_budget(state.least_seen(layer.cumulative_length))
        if self.head_shares:  # the smallest head's budget
            least = max(1, math.ceil(min(self.head_shares) * least))
        return held > least + self.slack(layer, q)

    def evict(self, layer, state, valid, q: int) -> None:
        """Evict down to each row's budget from the accumulated `state.scores` [B, H, held] (valid: [B, H, held],
        False on padding), where `due` says a row may be over it."""
        slack = self.slack(layer, q)
        budgets = self.row_budgets(state.seen_rows(layer.cumulative_length, valid))  # [B]: what each row alone would get
        if self.head_shares:
            self._evict_heads(layer, state, valid, self._head_budgets(budgets).to(valid.device), slack)
            return
        window = budgets.clamp(max=self.recent) if self.recent else budgets // 2
        forced = newest_real(valid, window)
        if self.sinks:
            forced |= sink_mask(valid, self.sinks)
        if self.merge and getattr(layer, "mla_latent", False):  # quantized layers are refused by LayerPolicy
            raise ConfigError(
                f"layer {layer.layer_idx}: H2O merge needs a GQA layer (this one holds an MLA latent); "
                "use merge=False here"
            )
        evict_rows(layer, state, state.scores, forced, valid, budgets, slack, merge_compact if self.merge else None)

    def _head_budgets(self, budgets: torch.Tensor) -> torch.Tensor:
        """[B] layer budgets -> [B, H] each kv head's (ceil of its share, at least 1)."""
        shares = torch.tensor(self.head_shares, dtype=torch.float64, device=budgets.device)
        return torch.ceil(shares * budgets[:, None].double()).long().clamp_min(1)

    def _evict_heads(self, layer, state, valid, budgets, slack):
        if layer.compressed or getattr(layer, "mla_latent", False):  # LayerPolicy refuses quantized layers
            raise ConfigError(f"layer {layer.layer_idx}: H2O head_shares need a full-precision GQA layer")
        if budgets.shape[1] != valid.shape[1]:
            raise ConfigError(f"layer {layer.layer_idx}: {budgets.shape[1]} head_shares for {valid.shape[1]} kv "
                              "heads; give one share per kv head")
        window = budgets.clamp(max=self.recent) if self.recent else budgets // 2  # [B, H]
        forced = newest_real(valid, window)
        if self.sinks:
            forced |= sink_mask(valid, self.sinks)
        evict_heads(layer, state, state.scores, forced, valid, budgets, slack)
