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
`quest_select_pages` adds the top-k: on Triton in the mass kernel's launch (`quest_top_pages`: the k-th
largest mass found bit by bit over the row held in registers), in torch a stable sort
(`quest_top_pages_torch`, the same pages).
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
    logits_fn, mass_fn = _kernels(backend, q)
    logits = logits_fn(q, page_min, page_max, radius_scale)  # [B, Hq, n_pages]
    return mass_fn(logits, page_min.shape[1], valid, scaling)


def _kernels(backend: str | None, q: torch.Tensor):
    """(logits function, mass function) on `backend` (None: the selected one)."""
    from kvcompress.kernels.backend import select_backend

    if (backend or select_backend(q.device)) != "triton":
        return quest_page_logits_torch, quest_page_mass_torch
    d = q.shape[-1]
    if d & (d - 1):  # the logits kernel tiles the head dim whole (an MLA key is 512 + 64 wide)
        return quest_page_logits_torch, quest_page_mass_triton
    return quest_page_logits_triton, quest_page_mass_triton


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
    n_pages, hkv = page_min.shape[2], page_min.shape[1]
    valid = None
    if n_valid is not None:
        valid = (torch.arange(n_pages, device=q.device) < n_valid.to(q.device).view(-1, 1, 1))  # [B, 1, n]
        valid = valid.expand(-1, hkv, -1)
    k = min(k, n_pages)
    logits_fn, mass_fn = _kernels(backend, q)
    logits = logits_fn(q, page_min, page_max, radius_scale)  # [B, Hq, n_pages]
    if mass_fn is quest_page_mass_triton:  # the softmax, the group sum and the top-k in one launch
        from kvcompress.kernels.quest_triton import quest_top_pages

        pages = quest_top_pages(logits, hkv, k, valid, scaling)
        if pages is not None:
            return pages
    return quest_top_pages_torch(mass_fn(logits, hkv, valid, scaling), k)


def quest_top_pages_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [B, Hkv, n_pages] (-inf: not valid) -> the k valid pages of highest score [B, Hkv, k] int32 in
    ascending page order, -1 last where fewer are valid; ties go to the lower page (as in the Triton
    kernel)."""
    n_pages = scores.shape[-1]
    ranked = scores.sort(dim=-1, descending=True, stable=True)
    top, pages = ranked.values[..., :k], ranked.indices[..., :k]
    pages = torch.where(torch.isfinite(top), pages, torch.full_like(pages, n_pages)).sort(-1).values
    return pages.masked_fill(pages >= n_pages, -1).to(torch.int32)
