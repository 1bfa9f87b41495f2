"""Quest: query-aware page selection (Tang et al. 2024, arXiv:2406.10774).

Nothing is evicted. Keys are grouped in pages of `page_size` tokens, each summarised by its
per-channel min and max key (float32, from the full-precision keys as the page completes). At each
decode step a page's score is the upper bound of q.k over its keys, sum_i max(q_i*min_i, q_i*max_i),
taken as the max over the GQA group's query heads; the attention reads the top pages within the
token budget plus the newest page (the one holding the current token). Prefill is dense, and so
are the first `dense_layers` layers (their inputs matter most).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.config import SparsitySpec
from kvcompress.sparse.base import SparsePolicy, top_indices


def page_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """query: [B, H, G, D] (a kv head's group), page_min/max: [B, H, P, D] -> upper bounds [B, H, P]."""
    q = query.float()[:, :, :, None, :]  # [B, H, G, 1, D]
    bound = torch.maximum(q * page_min[:, :, None], q * page_max[:, :, None]).sum(-1)  # [B, H, G, P]
    return bound.amax(2)


@dataclass
class QuestPolicy(SparsePolicy):
    keeps_page_summaries = True

    @classmethod
    def from_spec(cls, spec: SparsitySpec) -> "QuestPolicy":
        return cls(budget=spec.budget, ratio=spec.ratio, page_size=spec.page_size)

    def select(self, state, query, mask):
        """query: [B, Hq, 1, D]; mask: [B, H, 1, held] -> held indices [B, H, n] or None (read all)."""
        held, p = mask.shape[-1], self.page_size
        budget = self.token_budget(held)
        if query.shape[2] != 1 or held <= budget or state.page_min is None:
            return None
        n_full, partial = held // p, held % p
        newest = partial if partial else p  # the newest page holds the current token
        n_cand = n_full if partial else n_full - 1
        k = min(max((budget - newest) // p, 0), n_cand)
        b, h = mask.shape[:2]
        group = query.reshape(b, h, -1, query.shape[-1])  # [B, H, G, D]
        bound = page_bounds(group, state.page_min[:, :, :n_cand], state.page_max[:, :, :n_cand])
        real = mask[:, :, -1, : n_cand * p].reshape(b, h, n_cand, p).any(-1)
        pages = top_indices(bound.masked_fill(~real, float("-inf")), k)  # [B, H, k]
        arange = torch.arange(p, device=mask.device)
        tokens = (pages[..., None] * p + arange).flatten(2)
        last = torch.arange(held - newest, held, device=mask.device).expand(b, h, newest)
        return torch.cat([tokens, last], dim=-1)
