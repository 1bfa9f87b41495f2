"""Quest: query-aware page selection (Tang et al. 2024, arXiv:2406.10774).

Nothing is evicted. Keys are grouped in pages of `page_size` tokens, each summarised by its
per-channel min and max key (bfloat16 rounded outward, from the full-precision keys as the page
completes). At each decode step a page's bound for one query head is the upper bound of q.k over its
keys, sum_i max(q_i*min_i, q_i*max_i); the attention reads the first real page (it holds the attention
sinks), the newest page (the one holding the current token) and the top pages by score within the
token budget. Over quantized storage it also always reads the exact sink tokens and the whole exact tail
(the full-precision window of newest tokens), as the fused kernel does. Prefill is dense, and so are the
first `dense_layers` layers (their inputs matter most).

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

Budget sharing (SparsitySpec.budget_sharing; the default "none" gives every kv head k pages). The
estimated masses are comparable across heads, so "heads" lets a layer's kv heads share its k * H pages
(`shared_pages`): a head whose attention the estimate finds on a few pages leaves the rest to a head
whose attention is spread out (at most twice its share each). "layers" also splits each step's pages
among the layers (`LayerAllocator`, by the previous step's estimates); every step reads the same
total. SmolLM2-135M, pages of 4, every layer at 25% of the context, 1024 tokens (prefill 512, decode
512), Δppl on eval.txt / calib.txt: none +1.52% / +2.40%, heads +1.01% / +1.42%, layers +0.69% /
+1.21% (benchmarks/sparse_ppl.py; BENCHMARKS.md has more windows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompress.config import ConfigError, SparsitySpec
from kvcompress.sparse.base import SparsePolicy, top_indices

RADIUS_SCALE = 0.25  # measured on SmolLM2-135M, see the module docstring
MAX_HEAD_SHARE = 2.0  # budget sharing: one kv head reads at most twice its even share of the pages


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
    """radius_scale: how much of a page's key range counts in its logit (1.0: Quest's upper bound).
    budget_sharing: "none" (k pages per kv head), "heads" (the layer's kv heads share k * H pages, see
    `shared_pages`) or "layers" (the sparse layers also share the step's pages, see `LayerAllocator`,
    which `attach_sparsity` sets as `allocator`). unread_means: the pages a step skips still take part,
    one token each (kvcompress.sparse.unread)."""

    radius_scale: float = RADIUS_SCALE
    budget_sharing: str = "none"
    unread_means: bool = False
    allocator: LayerAllocator | None = field(default=None, repr=False, compare=False)
    keeps_page_summaries = True

    def __post_init__(self):
        super().__post_init__()
        if not 0.0 <= self.radius_scale <= 1.0:
            raise ConfigError(f"Quest radius_scale must be in [0, 1], got {self.radius_scale}")

    @property
    def pads_selection(self) -> bool:
        """Whether a head's selection may be padded with -1 (it reads fewer tokens than another head)."""
        return self.budget_sharing != "none"

    @classmethod
    def from_spec(cls, spec: SparsitySpec) -> "QuestPolicy":
        return cls(budget=spec.budget, ratio=spec.ratio, page_size=spec.page_size,
                   budget_sharing=spec.budget_sharing, unread_means=spec.unread_means)

    def reset(self) -> None:
        if self.allocator is not None:
            self.allocator.reset()

    def select(self, state, query, mask):
        """query: [B, Hq, 1, D]; mask: [B, H, 1, held] -> held indices [B, H, n] or None (read all);
        under budget sharing a head that reads fewer pages than another is padded with -1 (read nothing)."""
        held, p = mask.shape[-1], self.page_size
        budget = self.token_budget(held)
        if query.shape[2] != 1 or held <= budget or state.page_min is None:
            return None
        n_sink, n_tail = state.step.exact
        newest = read_last(held, p, n_tail)  # always read: the newest page, a quantized layer's exact tail
        n_cand = (held - newest) // p
        k = min(max((budget - newest) // p, 0), n_cand)
        b, h = mask.shape[:2]
        group = query.reshape(b, h, -1, query.shape[-1])  # [B, H, G, D]
        real = mask[:, :, -1, : n_cand * p].reshape(b, h, n_cand, p).any(-1)  # [B, H, n_cand]
        score = page_scores(group, state.page_min[:, :, :n_cand], state.page_max[:, :, :n_cand], real,
                            state.step.scaling, self.radius_scale)
        forced = first_true(real)  # the first real page (attention sinks)
        forced[..., : -(-n_sink // p)] = True  # and the pages of a quantized layer's exact sinks, always read
        score = score.masked_fill(forced, float("inf"))
        if self.budget_sharing == "none":
            pages = top_indices(score, k)  # [B, H, k]
        elif self.allocator is None:
            pages, _ = shared_pages(score, k)
        else:
            total = self.allocator.pages(state.layer_idx, k * h, b)
            pages, ranked = shared_pages(score, k, total=total)
            self.allocator.record(state.layer_idx, ranked)
        arange = torch.arange(p, device=mask.device)
        tokens = torch.where(pages[..., None] < 0, -1, pages[..., None] * p + arange).flatten(2)
        last = torch.arange(held - newest, held, device=mask.device).expand(b, h, newest)
        return torch.cat([tokens, last], dim=-1)


def read_last(held: int, page: int, n_tail: int = 0) -> int:
    """How many of the newest held tokens every Quest step reads: the newest page (the one holding the
    current token) and, in a quantized layer, its whole exact tail of n_tail tokens, rounded up so that the
    candidate pages before them are whole."""
    newest = held % page or page
    return held - (held - max(newest, n_tail)) // page * page


def shared_pages(
    score: torch.Tensor, k: int, max_share: float = MAX_HEAD_SHARE, total: int | torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The `total` (default k * H) pages of highest score over all H kv heads of score [B, H, P] (estimated
    attention mass per page, comparable across heads), at most `max_share` * k for one head.

    Returns the sorted page indices [B, H, min(P, max_share * k)], -1 first where a head takes fewer
    (pages of score -inf are never taken), and the candidates' scores ranked over the heads [B, H * c]
    (descending: what reading one more page would add; LayerAllocator's curve). total: an int or one
    count per row [B].

    A head whose attention the estimate finds concentrated on a few pages leaves the rest of its
    share to a head whose attention is spread out.
    """
    b, h, n = score.shape
    c = min(n, int(max_share * k))
    if c == 0:
        return score.new_zeros(b, h, 0, dtype=torch.long), score.new_zeros(b, 0)
    total = k * h if total is None else total
    top = score.topk(c, dim=-1)  # [B, H, c], each head's best c pages, in decreasing score
    flat = top.values.reshape(b, h * c)
    ranked, order = flat.sort(dim=-1, descending=True, stable=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(h * c, device=score.device).expand(b, -1))
    total = torch.as_tensor(total, device=score.device).reshape(-1, 1)  # [B | 1, 1]
    taken = (rank < total).view(b, h, c) & (top.values > float("-inf"))
    return torch.where(taken, top.indices, -1).sort(dim=-1).values, ranked


class LayerAllocator:
    """Splits each decode step's pages among the Quest layers that share their budget ("layers").

    Every layer has k * H pages by the ratio; the step's total, (number of layers) * k * H, stays
    exact. A layer's queries are only known when the layer runs, so the split uses the previous
    step: each layer recorded its pages' estimated masses ranked over its heads (`shared_pages`),
    and the first layer of the next step gives every layer `low` * k * H pages, then the rest of the
    total to the highest estimated masses of any layer, at most `high` * k * H pages per layer. A layer
    whose attention the estimates find spread out (SmolLM2-135M's first layer) gets more pages than
    one whose attention sits on a few. Before any step was recorded, the split is even.
    """

    def __init__(self, layers: list[int], low: float = 0.5, high: float = 2.0):
        if not 0.0 <= low <= 1.0 <= high:
            raise ConfigError(f"LayerAllocator needs 0 <= low <= 1 <= high, got {low}, {high}")
        self.layers = sorted(layers)
        self.low, self.high = low, high
        self.reset()

    def reset(self) -> None:
        self.curves: dict[int, torch.Tensor] = {}
        self.split: torch.Tensor | None = None  # [B, layers] pages this step

    def record(self, layer_idx: int, ranked: torch.Tensor) -> None:
        """ranked: [B, n] a layer's candidate pages' estimated masses, descending."""
        self.curves[layer_idx] = ranked

    def pages(self, layer_idx: int, even: int, batch: int) -> torch.Tensor | int:
        """Pages layer `layer_idx` reads this step: one count per row [B], or the even share `even` = k * H."""
        if layer_idx == self.layers[0]:
            self.split = self._split(even, batch)
            self.curves = {}
        if self.split is None:
            return even
        return self.split[:, self.layers.index(layer_idx)]

    def _split(self, even: int, b: int) -> torch.Tensor | None:
        if len(self.curves) != len(self.layers) or even == 0:
            return None
        curves = [self.curves[i] for i in self.layers]
        if any(c.shape[0] != b for c in curves):
            return None
        lo, hi = int(self.low * even), int(self.high * even)
        n = len(curves)
        # each layer's pages beyond `lo` (up to `hi`), padded with -inf where it had fewer candidates
        pool = torch.full((b, n, hi - lo), float("-inf"), device=curves[0].device)
        for j, c in enumerate(curves):
            part = c[:, lo:hi]
            pool[:, j, : part.shape[1]] = part
        extra = n * (even - lo)
        chosen = pool.reshape(b, -1).topk(extra, dim=-1).indices // (hi - lo)  # [B, extra] layer of each page
        return torch.full((b, n), lo, device=pool.device, dtype=torch.long).scatter_add_(
            1, chosen, torch.ones_like(chosen))


def first_true(x: torch.Tensor) -> torch.Tensor:
    """[..., N] bool -> [..., N] True only at the first True of each row (none where the row has none)."""
    return x & (x.long().cumsum(-1) == 1)
