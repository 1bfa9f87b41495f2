"""StreamingLLM: attention sinks + a recent window (Xiao et al. 2023, arXiv:2309.17453).

Keeps the first `sinks` real tokens of each row and the newest `budget - sinks`; evicts after
prefill and, while decoding, every `page_size` tokens (so the layer holds at most budget + page_size).
Query-agnostic: needs neither the query nor the attention weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.config import ConfigError, SparsitySpec
from kvcompress.sparse.base import SparsePolicy, evict_rows, newest_real, sink_mask


@dataclass
class StreamingPolicy(SparsePolicy):
    sinks: int = 4

    def __post_init__(self):
        super().__post_init__()
        if self.sinks < 0 or (self.budget and self.sinks >= self.budget):
            raise ConfigError(
                f"StreamingLLM needs 0 <= sinks < budget; got sinks={self.sinks}, budget={self.budget}"
            )

    @classmethod
    def from_spec(cls, spec: SparsitySpec) -> "StreamingPolicy":
        return cls(budget=spec.budget, ratio=spec.ratio, page_size=spec.page_size, sinks=spec.sinks)

    def after_attention(self, layer, state, mass, valid):
        held, q = valid.shape[-1], state.step.q_len
        state.count_padding(valid, q)  # the rows' budgets follow their real tokens
        slack = 0 if q > 1 else (self.page_size if not layer.compressed else layer.key_store.page_size)
        if held <= self.token_budget(state.least_seen(layer.cumulative_length)) + slack:
            return  # no row can be over its budget
        budgets = self.row_budgets(state.seen_rows(layer.cumulative_length, valid))  # [B]: what each row alone would get
        sinks = (budgets - 1).clamp(max=self.sinks)
        forced = sink_mask(valid, sinks) | newest_real(valid, budgets - sinks)
        evict_rows(layer, state, torch.zeros(valid.shape, device=valid.device), forced, valid, budgets, slack)
