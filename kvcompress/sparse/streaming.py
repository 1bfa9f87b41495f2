"""StreamingLLM: attention sinks + a recent window (Xiao et al. 2023, arXiv:2309.17453).

Keeps the first `sinks` real tokens of each row and the newest `budget - sinks`; evicts after
prefill and, while decoding, every `page_size` tokens (so the layer holds at most budget + page_size).
Query-agnostic: needs neither the query nor the attention weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.config import ConfigError, SparsitySpec
from kvcompress.sparse.base import SparsePolicy, compact, recent_mask, sink_mask


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
        budget = self.token_budget(layer.cumulative_length)
        slack = 0 if q > 1 else (self.page_size if not layer.compressed else layer.key_store.page_size)
        if held <= budget + slack:
            return
        sinks = min(self.sinks, budget - 1)
        forced = sink_mask(valid, sinks) | recent_mask(held, budget - sinks, valid)
        compact(layer, state, torch.zeros(valid.shape, device=valid.device), forced, valid, budget)
