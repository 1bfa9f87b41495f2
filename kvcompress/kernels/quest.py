"""Quest page scoring and selection on the device (Tang et al. 2024, arXiv:2406.10774), as the Quest
policy (kvcompress.sparse.quest) scores pages.

Each page of P keys is summarised by its elementwise min and max [B, Hkv, n_pages, D]. A page's logit for
one query head is  q.centre + radius_scale * |q|.half_width  of the page's [min, max] box; with
radius_scale 1 that is Quest's upper bound on q.k over the page, sum_i max(q_i * min_i, q_i * max_i).
A page's score for a kv head is the softmax of its logits over the pages (scaled like the attention
logits) per query head, summed over the head's GQA group: an estimate of the attention mass it gets.

`quest_page_logits_torch` / `quest_page_logits_triton` share one signature (the logits, one program per
(batch, kv head, block of pages) reading each page summary once for the whole group), and so do
`quest_page_mass_torch` / `quest_page_mass_triton` (the softmax per query head and the group sum: one
program per (batch, kv head) instead of about six torch launches); `quest_page_scores` chains the two,
`quest_select_pages` adds the top-k (torch ops on either backend).
"""

from __future__ import annotations

import torch


def quest_page_logits_torch(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, radius_scale: float = 1.0
) -> torch.Tensor:
    """q [B, Hq, D], page_min / page_max [B, Hkv, n_pages, D] -> logits [B, Hq, n_pages] float32."""
    b, hq, d = q.shape
    hkv, n_pages = page_min.shape[1], page_min.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    qg = q.float().reshape(b, hkv, hq // hkv, d)  # [B, Hkv, G, D]
    lo, hi = page_min.float(), page_max.float()  # [B, Hkv, n, D]
    # products, not a [B, Hkv, G, n, D] broadcast: an MLA layer has G = 128 heads over 576-wide summaries
    logits = torch.einsum("bhgd,bhnd->bhgn", qg, (lo + hi) / 2)
    logits += radius_scale * torch.einsum("bhgd,bhnd->bhgn", qg.abs(), (hi - lo) / 2)
    return logits.reshape(b, hq, n_pages)


def quest_page_logits_triton(
    q: torch.Tensor, page_min: torch.Tensor, page_max: torch.Tensor, radius_scale: float = 1.0
) -> torch.Tensor:
    """Same as `quest_page_logits_torch`."""
    from kvcompress.kernels.quest_triton import quest_logits

    return quest_logits(q, page_min, page_max, radius_scale)


def quest_page_mass_torch(
    logits: torch.Tensor, hkv: int, valid: torch.Tensor | None = None, scaling: float = 1.0
) -> torch.Tensor:
    """logits [B, Hq, n_pages] -> the group's summed softmax over the valid pages [B, Hkv, n_pages] float32,
    -inf on pages that are not `valid` ([B, Hkv|1, n_pages] bool; None: all); a row with no valid page
    sums to nothing (zeros before the -inf)."""
    b, hq, n_pages = logits.shape
    logits = logits.float().view(b, hkv, hq // hkv, n_pages) * scaling
    if valid is not None:
        logits = logits.masked_fill(~valid[:, :, None], float("-inf"))
    mass = torch.softmax(logits, dim=-1).nan_to_num(0.0).sum(2)
    return mass if valid is None else mass.masked_fill(~valid, float("-inf"))


def quest_page_mass_triton(
    logits: torch.Tensor, hkv: int, valid: torch.Tensor | None = None, scaling: float = 1.0
) -> torch.Tensor:
    """Same as `quest_page_mass_torch`, in one launch (the torch ops are about six)."""
    from kvcompress.kernels.quest_triton import quest_mass

    return quest_mass(logits, hkv, valid, scaling)


def quest_page_scores(
    q: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    valid: torch.Tensor | None = None,
    *,
    scaling: float = 1.0,
    radius_scale: float = 1.0,
    backend: str | None = None,
) -> torch.Tensor:
    """Estimated attention mass per page, summed over the group: [B, Hkv, n_pages] float32, -inf on pages
    that are not `valid` ([B, Hkv, n_pages] or [B, 1, n_pages] bool; None: all)."""
    from kvcompress.kernels.backend import select_backend

    backend = backend or select_backend(q.device)
    if backend == "triton":
        logits_fn, mass_fn = quest_page_logits_triton, quest_page_mass_triton
        d = q.shape[-1]
        if d & (d - 1):  # the logits kernel tiles the head dim whole (an MLA key is 512 + 64 wide)
            logits_fn = quest_page_logits_torch
    else:
        logits_fn, mass_fn = quest_page_logits_torch, quest_page_mass_torch
    logits = logits_fn(q, page_min, page_max, radius_scale)  # [B, Hq, n_pages]
    return mass_fn(logits, page_min.shape[1], valid, scaling)


def quest_select_pages(
    q: torch.Tensor,
    page_min: torch.Tensor,
    page_max: torch.Tensor,
    k: int,
    n_valid: torch.Tensor | None = None,
    *,
    scaling: float = 1.0,
    radius_scale: float = 1.0,
    backend: str | None = None,
) -> torch.Tensor:
    """The k best pages per (batch, kv head) among the first n_valid [B] pages of each row: [B, Hkv, k]
    int32, ascending page order (the decode kernel then reads memory forward); -1 where fewer than k
    pages are valid."""
    n_pages = page_min.shape[2]
    valid = None
    if n_valid is not None:
        valid = (torch.arange(n_pages, device=q.device) < n_valid.to(q.device).view(-1, 1, 1))  # [B, 1, n]
        valid = valid.expand(-1, page_min.shape[1], -1)
    scores = quest_page_scores(q, page_min, page_max, valid, scaling=scaling, radius_scale=radius_scale,
                               backend=backend)
    k = min(k, n_pages)
    top = scores.topk(k, dim=-1, sorted=False)  # the pages are sorted by index below
    pages = torch.where(torch.isfinite(top.values), top.indices, torch.full_like(top.indices, -1))
    ordered = torch.where(pages < 0, torch.full_like(pages, n_pages), pages).sort(-1).values  # -1 entries last
    return ordered.masked_fill(ordered >= n_pages, -1).to(torch.int32)
