"""Quest page selection on the device (Tang et al. 2024, arXiv:2406.10774).

Each page of P keys is summarised by its elementwise min and max [B, Hkv, n_pages, D]; for a query q
the page's upper bound on q.k is sum_i max(q_i * min_i, q_i * max_i). With GQA the page score of a kv
head is the max of that bound over the group's query heads. The top-k pages by score are read.
`quest_page_scores_torch` / `quest_page_scores_triton` share one signature; `quest_select_pages`
dispatches and takes the top-k (torch.topk on either backend: it is one small launch).
"""

from __future__ import annotations

import torch


def quest_page_scores_torch(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, n_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """q [B, Hq, D], page_min / page_max [B, Hkv, n_pages, D], n_valid [B] pages per row (None: all)
    -> scores [B, Hkv, n_pages] float32 (-inf for pages past n_valid)."""
    b, hq, d = q.shape
    hkv, n_pages = page_min.shape[1], page_min.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    qg = q.float().reshape(b, hkv, hq // hkv, 1, d)  # [B, Hkv, G, 1, D]
    lo, hi = page_min.float()[:, :, None], page_max.float()[:, :, None]  # [B, Hkv, 1, n, D]
    bound = torch.maximum(qg * lo, qg * hi).sum(-1)  # [B, Hkv, G, n]
    scores = bound.amax(2)
    if n_valid is not None:
        past = torch.arange(n_pages, device=q.device) >= n_valid.to(q.device).view(b, 1, 1)
        scores = scores.masked_fill(past, float("-inf"))
    return scores


def quest_page_scores_triton(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, n_valid: torch.Tensor | None = None
) -> torch.Tensor:
    """Same as `quest_page_scores_torch`, one Triton program per (batch, kv head, block of pages)."""
    from kvcompress.kernels.quest_triton import quest_scores

    return quest_scores(q, page_min, page_max, n_valid)


def quest_select_pages(
    q: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    k: int,
    n_valid: torch.Tensor | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """The k best pages per (batch, kv head): [B, Hkv, k] int32, ascending page order (the decode kernel
    then reads memory forward); -1 where fewer than k pages are valid."""
    from kvcompress.kernels.backend import select_backend

    backend = backend or select_backend(q.device)
    fn = quest_page_scores_triton if backend == "triton" else quest_page_scores_torch
    scores = fn(q, page_min, page_max, n_valid)  # [B, Hkv, n_pages]
    k = min(k, scores.shape[-1])
    top = scores.topk(k, dim=-1)
    pages = torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1))
    # ascending, with the -1 entries last
    n_pages = scores.shape[-1]
    ordered = torch.where(pages < 0, torch.full_like(pages, n_pages), pages).sort(-1).values
    return ordered.masked_fill(ordered >= n_pages, -1).to(torch.int32)
