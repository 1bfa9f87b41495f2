"""The small base every sparsity policy shares: budgets, per-kv-head top-k selection, eviction.

A policy is a @dataclass of its hyperparameters (from SparsitySpec) that implements one or two hooks:

- `select(state, query, mask)`: which held tokens this step reads (Quest); default: all of them.
- `after_attention(layer, state, mass, valid)`: update scores and evict (H2O, StreamingLLM, SnapKV).

Selection is always per (batch row, kv head): a policy gives a priority per held token [B, H, held] and
the tokens it must keep; padding is never kept over a real token (priority -inf) and stays masked. In a
padded batch each row's budget and its moment to evict are the row's own (`evict_rows`: what the row
would do alone); the slots are shared, so a row that keeps fewer tokens than another marks the rest dead
(masked). `compact` frees what is not kept:

- full-precision storage (a lossless layer, all tokens in its tail): a token-level gather;
- quantized storage (sinks | packed body pages | tail): the exact sinks and the full-precision tail
  are kept and the body is evicted a whole page at a time. Per-page fields (KIVI key scales, NUQ
  outlier lists, and the per-token scales NUQ computes with outliers left out) cannot be regrouped
  into new pages without re-quantizing values that are already lossy; a heavy hitter survives many
  compactions, so that error would compound. Whole pages are gathered exactly, field by field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.config import ConfigError, SparsitySpec


@dataclass
class SparsePolicy:
    """Shared hyperparameters. budget: tokens per kv head (0: use `ratio` of the tokens seen)."""

    budget: int = 0
    ratio: float = 0.0
    page_size: int = 16

    keeps_page_summaries = False  # Quest: min/max key summaries per page
    unread_means = False  # Quest: skipped pages attended as one token each (kvcompress.sparse.unread)

    def __post_init__(self):
        if self.budget < 0 or not 0.0 <= self.ratio <= 1.0 or (self.budget == 0 and self.ratio == 0.0):
            raise ConfigError(
                f"{type(self).__name__} needs budget > 0 or ratio in (0, 1]; got {self.budget}, {self.ratio}"
            )
        if self.page_size < 1:
            raise ConfigError(f"page_size must be >= 1, got {self.page_size}")

    @classmethod
    def from_spec(cls, spec: SparsitySpec) -> "SparsePolicy":
        raise NotImplementedError

    def token_budget(self, seen: int) -> int:
        """Tokens per kv head for a context of `seen` tokens."""
        return self.budget if self.budget else max(1, math.ceil(self.ratio * seen))

    def row_budgets(self, seen: torch.Tensor) -> torch.Tensor:
        """token_budget per batch row: seen [B] real tokens each row has seen -> [B] long. In a padded batch
        each row's budget is what the row alone would get."""
        if self.budget:
            return torch.full_like(seen, self.budget)
        return torch.ceil(self.ratio * seen.double()).long().clamp_min(1)

    # -- hooks -----------------------------------------------------------------------------------
    def reset(self) -> None:
        """Forget what the policy learnt from a sequence (the cache was reset)."""

    def mass_queries(self, q_len: int) -> int:
        """How many of the newest queries' attention the policy needs summed per token (0: none)."""
        return 0

    def select(self, state, query: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """Held-token indices [B, H, n] to read this step, sorted; None reads everything."""
        return None

    def after_attention(self, layer, state, mass: torch.Tensor | None, valid: torch.Tensor) -> None:
        """mass: [B, H, held] attention summed over the group's query heads (or None);
        valid: [B, H, held] False on padding."""


# -- selection -------------------------------------------------------------------------------------
def keep_key(priority: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Selection key [B, H, N]: +inf for forced real tokens, -inf for padding, else the priority."""
    key = priority.float().masked_fill(forced, float("inf"))
    return key.masked_fill(~valid, float("-inf"))


def top_indices(key: torch.Tensor, n_keep: int) -> torch.Tensor:
    """The n_keep largest entries of key [B, H, N] per (batch, head), as sorted indices [B, H, n_keep]."""
    n_keep = min(n_keep, key.shape[-1])
    return key.topk(n_keep, dim=-1).indices.sort(dim=-1).values


def newest_real(valid: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[B, H, held] True on the newest n real tokens of each row (n: [B], or [B, H] per kv head); in a row
    without padding or dead slots, the newest n held tokens (recent_mask)."""
    from_end = valid.flip(-1).long().cumsum(-1).flip(-1)  # real tokens at or after each slot
    return valid & (from_end <= (n[:, None, None] if n.dim() == 1 else n[..., None]))


def recent_mask(held: int, n_recent: int, like: torch.Tensor) -> torch.Tensor:
    """[B, H, held] True on the newest n_recent held tokens (held tokens stay in position order)."""
    m = torch.zeros(like.shape[:2] + (held,), dtype=torch.bool, device=like.device)
    if n_recent > 0:
        m[..., max(held - n_recent, 0):] = True
    return m


def sink_mask(valid: torch.Tensor, n_sinks: int | torch.Tensor) -> torch.Tensor:
    """[B, H, held] True on the first n_sinks real (non-padding) tokens of each row (n_sinks: an int or [B])."""
    n = n_sinks[:, None, None] if isinstance(n_sinks, torch.Tensor) else n_sinks
    return valid & (valid.long().cumsum(-1) <= n)


def gather_tokens(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """x: [B, H, N, ...], idx: [B, H, n] -> [B, H, n, ...] (a new tensor: the old storage is freed)."""
    shape = idx.shape + x.shape[3:]
    return x.gather(2, idx.reshape(idx.shape + (1,) * (x.dim() - 3)).expand(shape))


# -- eviction ----------------------------------------------------------------------------------
def compact(
    layer, state, priority: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor, n_keep: int
) -> None:
    """Keep about n_keep held tokens per kv head of `layer` (all forced ones), free the rest.

    priority, forced, valid: [B, H, held] in held order (sinks | body | tail).
    """
    if not layer.compressed:
        idx = kept_tokens(layer, priority, forced, valid, n_keep)
        if idx is not None:
            held = layer.held_tokens
            hold_tokens(layer, gather_tokens(layer.tail_k, idx), gather_tokens(layer.tail_v, idx))
            state.gather(idx, held)
        return
    key = keep_key(priority, forced, valid)
    _compact_pages(layer, state, key, max(n_keep, int((forced & valid).sum(-1).max())))


def hold_tokens(layer, keys: torch.Tensor, values: torch.Tensor) -> None:
    """A full-precision layer now holds keys / values [B, H, n, D] (what an eviction kept); the buffers its former
    tail was a view of (kvcompress.layout.grow) are let go with it."""
    layer.tail_k, layer.tail_v = keys, values
    layer.room_k = layer.room_v = None


def evict_rows(layer, state, priority: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor,
               budgets: torch.Tensor, slack: int, merge=None) -> None:
    """Evict, per batch row, down to that row's budget where its real tokens exceed budget + slack, as the
    row alone would; the other rows keep every real token.

    budgets: [B]. A full-precision layer frees the slots no row needs and marks the real tokens that a row
    evicts while another row still needs the slot as dead (SparseState.kill: masked from then on). A
    quantized layer drops whole pages with one count for every row (its page fields are batched), and a
    merging H2O layer (`merge`: merge_compact) merges down to the largest row's count.
    """
    real = valid.sum(-1)  # [B, H]
    over = real > (budgets + slack)[:, None]
    if not bool(over.any()):
        return
    must = (forced & valid).sum(-1)
    keep = torch.where(over, torch.maximum(budgets[:, None], must), real)  # [B, H]
    if merge is not None:
        merge(layer, state, priority, forced, valid, int(keep.max()))
    elif layer.compressed:
        compact(layer, state, priority, forced, valid, int(keep.max()))
    else:
        held = layer.held_tokens
        n = min(int(keep.max()), held)
        order = keep_key(priority, forced, valid).topk(n, dim=-1).indices  # [B, H, n] best first
        dead_ranked = torch.arange(n, device=order.device) >= keep[..., None]
        idx, perm = order.sort(dim=-1)
        dead = dead_ranked.gather(2, perm)
        if n == held and not bool(dead.any()):
            return
        hold_tokens(layer, gather_tokens(layer.tail_k, idx), gather_tokens(layer.tail_v, idx))
        state.gather(idx, held)
        state.kill(dead)


def kept_tokens(
    layer, priority: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor, n_keep: int
) -> torch.Tensor | None:
    """Full-precision layer: the held tokens to keep [B, H, n] (sorted; every forced real one, at least
    n_keep), or None when that is all of them."""
    n_keep = max(n_keep, int((forced & valid).sum(-1).max()))
    if n_keep >= layer.held_tokens:
        return None
    return top_indices(keep_key(priority, forced, valid), n_keep)


def _compact_pages(layer, state, key: torch.Tensor, n_keep: int) -> None:
    """Quantized layer: drop whole body pages (lowest summed priority first); sinks and tail stay."""
    n_sink, n_body, n_tail = layer.sink_k.shape[2], layer.key_store.n_tokens, layer.tail_k.shape[2]
    page = layer.key_store.page_size
    n_pages = n_body // page
    if n_pages == 0:
        return
    body = key[..., n_sink:n_sink + n_body].reshape(key.shape[:2] + (n_pages, page))  # [B, H, pages, P]
    finite = body.masked_fill(~torch.isfinite(body), 0.0).sum(-1)
    page_key = torch.where((body == float("inf")).any(-1), float("inf"), finite)
    page_key = page_key.masked_fill((body == float("-inf")).all(-1), float("-inf"))
    forced_pages = int((page_key == float("inf")).sum(-1).max())
    keep_pages = min(n_pages, max(forced_pages, (n_keep - n_sink - n_tail) // page, 0))
    if keep_pages == n_pages:
        return
    pages = top_indices(page_key, keep_pages)  # [B, H, keep_pages]
    layer.key_store.keep_pages(pages)
    layer.value_store.keep_pages(pages)
    body_idx = (pages[..., None] * page + torch.arange(page, device=pages.device)).flatten(2) + n_sink
    b, h = key.shape[:2]
    arange = lambda lo, hi: torch.arange(lo, hi, device=key.device).expand(b, h, hi - lo)  # noqa: E731
    kept = torch.cat([arange(0, n_sink), body_idx, arange(n_sink + n_body, n_sink + n_body + n_tail)], -1)
    state.gather(kept, n_sink + n_body + n_tail)
