"""Quest: query-aware page selection (Tang et al. 2024, arXiv:2406.10774).

Nothing is evicted. Keys are grouped in pages of `page_size` tokens, each summarised by its
per-channel min and max key (bfloat16 rounded outward, from the full-precision keys as the page
completes). At each decode step a page's bound for one query head is the upper bound of q.k over its
keys, sum_i max(q_i*min_i, q_i*max_i); the attention reads the first real page (it holds the attention
sinks), the newest page (the one holding the current token) and the top pages by score within the
token budget. Prefill is dense, and so are the first `dense_layers` layers (their inputs matter most).

A page's score for a GQA group is the softmax of its logits over the pages (scaled like the
attention logits), per query head, summed over the group's heads: an estimate of the attention
mass the page receives. Taking the max of the raw bounds instead lets the head with the widest
logits choose for the whole group; on SmolLM2-135M (50% of the context, pages of 8) that costs
+2.6% perplexity against +1.1% for the summed softmax.

A page's logit is q.center + radius_scale * |q|.half_width (center and half width of the per-channel
[min, max] box): radius_scale 1 is Quest's upper bound, exact but loose (every channel at its worst
corner at once); shrinking it ranks pages closer to their true attention. SmolLM2-135M, pages of 8,
perplexity at 50% / 25% of the context: radius_scale 1 +1.05% / +4.4%, 0.5 +0.53% / +3.0%,
0.25 +0.12% / +2.9%. Below 1 a page holding one outlying key can rank under its bound: 0.25
keeps a quarter of the key range's width in the logit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.config import ConfigError, SparsitySpec
from kvcompress.sparse.base import SparsePolicy, top_indices

RADIUS_SCALE = 0.25  # measured on SmolLM2-135M, see the module docstring


def head_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """query: [B, H, G, D] (a kv head's group), page_min/max: [B, H, P, D] -> bounds [B, H, G, P]."""
    return head_logits(query, page_min, page_max, 1.0)


def page_bounds(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor) -> torch.Tensor:
    """The upper bound of q.k over a page's keys and the group's query heads: [B, H, P]."""
    return head_bounds(query, page_min, page_max).amax(2)


def head_logits(query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, radius_scale: float):
    """q.center + radius_scale * |q|.half_width per query head: [B, H, G, P] (1.0: the upper bound)."""
    from kvcompress.kernels.quest import quest_page_logits_torch

    b, h, g, d = query.shape
    return quest_page_logits_torch(query.reshape(b, h * g, d), page_min, page_max, radius_scale).view(b, h, g, -1)


def page_scores(
    query: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, real: torch.Tensor, scaling: float,
    radius_scale: float = 1.0,
) -> torch.Tensor:
    """Estimated attention mass per page, summed over the group: [B, H, P]; -inf on pages of padding.
    On the selected kernel backend (Triton on CUDA): `kvcompress.kernels.quest.quest_page_scores`.

    query: [B, H, G, D]; page_min/max: [B, H, P, D]; real: [B, H, P] False on pages of padding only.
    """
    from kvcompress.kernels.quest import quest_page_scores

    b, h, g, d = query.shape
    return quest_page_scores(query.reshape(b, h * g, d), page_min, page_max, real, scaling=scaling,
                             radius_scale=radius_scale)


@dataclass
class QuestPolicy(SparsePolicy):
    """radius_scale: how much of a page's key range counts in its logit (1.0: Quest's upper bound)."""

    radius_scale: float = RADIUS_SCALE
    keeps_page_summaries = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.radius_scale <= 1.0:
            raise ConfigError(f"Quest radius_scale must be in [0, 1], got {self.radius_scale}")

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
        real = mask[:, :, -1, : n_cand * p].reshape(b, h, n_cand, p).any(-1)  # [B, H, n_cand]
        score = page_scores(group, state.page_min[:, :, :n_cand], state.page_max[:, :, :n_cand], real,
                            state.step.scaling, self.radius_scale)
        score = score.masked_fill(first_true(real), float("inf"))  # the sinks' page
        pages = top_indices(score, k)  # [B, H, k]
        arange = torch.arange(p, device=mask.device)
        tokens = (pages[..., None] * p + arange).flatten(2)
        last = torch.arange(held - newest, held, device=mask.device).expand(b, h, newest)
        return torch.cat([tokens, last], dim=-1)


def first_true(x: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> [..., N] True only at the first True of each row (none where the row has none)."""
    return x & (x.long().cumsum(-1) == 1)
