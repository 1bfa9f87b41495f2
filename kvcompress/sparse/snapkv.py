"""SnapKV: prefill-time selection from the observation window (Li et al. 2024, arXiv:2404.14469).

At prefill, the attention of the last `observation_window` queries to every key is summed over the
window and over the GQA group's query heads (per kv head), smoothed by average pooling over
`pool_kernel` neighbouring tokens, and the top tokens are kept with the window itself, within the
budget. Decoding appends without evicting.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F

from kvcompress.config import ConfigError, SparsitySpec
from kvcompress.sparse.base import SparsePolicy, evict_rows, newest_real


@dataclass
class SnapKVPolicy(SparsePolicy):
    observation_window: int = 32
    pool_kernel: int = 7

    def __post_init__(self):
        super().__post_init__()
        if self.observation_window < 1 or self.pool_kernel < 1 or self.pool_kernel % 2 == 0:
            raise ConfigError(
                "SnapKV needs observation_window >= 1 and an odd pool_kernel; "
                f"got {self.observation_window}, {self.pool_kernel}"
            )

    @classmethod
    def from_spec(cls, spec: SparsitySpec) -> "SnapKVPolicy":
        return cls(
            budget=spec.budget, ratio=spec.ratio, page_size=spec.page_size,
            observation_window=spec.observation_window, pool_kernel=spec.pool_kernel,
        )

    def mass_queries(self, q_len: int) -> int:
        return min(self.observation_window, q_len) if q_len > 1 else 0

    def after_attention(self, layer, state, mass, valid):
        held, q = valid.shape[-1], state.step.q_len
        state.count_padding(valid, q)  # the rows' budgets follow their real tokens
        if q == 1 or held <= self.token_budget(state.least_seen(layer.cumulative_length)):
            return
        budgets = self.row_budgets(state.seen_rows(layer.cumulative_length, valid))  # [B]: what each row alone would get
        b, h, n = mass.shape
        pooled = F.avg_pool1d(
            mass.float().reshape(b * h, 1, n), self.pool_kernel, stride=1, padding=self.pool_kernel // 2
        ).reshape(b, h, n)
        forced = newest_real(valid, budgets.clamp(max=min(self.observation_window, q)))
        evict_rows(layer, state, pooled, forced, valid, budgets, 0)
