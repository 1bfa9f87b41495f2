"""Triton twin of `quest_page_logits_torch` (imports Triton; loaded only when asked)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit(do_not_specialize=("n_pages",))
def _quest_logits_kernel(Q, q_sb, q_sh, MN, MX, m_sb, m_sh, m_sp, OUT, o_sb, o_sh, n_pages, radius,
                         HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BP: tl.constexpr):
    """One (batch, kv head, block of pages): each page's box read once for the G query heads."""
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    h = pid_bh % HKV
    pages = tl.program_id(1) * BP + tl.arange(0, BP)
    ok = pages < n_pages
    d = tl.arange(0, D)
    base = b.to(tl.int64) * m_sb + h * m_sh + pages[:, None] * m_sp + d[None, :]
    lo = tl.load(MN + base, mask=ok[:, None], other=0.0).to(tl.float32)  # [BP, D]
    hi = tl.load(MX + base, mask=ok[:, None], other=0.0).to(tl.float32)
    centre = (lo + hi) * 0.5
    half = (hi - lo) * 0.5
    for g in range(G):
        qv = tl.load(Q + b.to(tl.int64) * q_sb + (h * G + g) * q_sh + d).to(tl.float32)[None, :]
        logit = tl.sum(qv * centre, 1) + radius * tl.sum(tl.abs(qv) * half, 1)
        tl.store(OUT + b.to(tl.int64) * o_sb + (h * G + g) * o_sh + pages, logit, mask=ok)


def quest_logits(q, page_min, page_max, radius_scale: float = 1.0, block_pages: int = 32):
    b, hq, d = q.shape
    hkv, n_pages = page_min.shape[1], page_min.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if d & (d - 1):
        raise ValueError(f"the Quest kernel needs a power-of-two head dim, got {d}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if page_min.stride() != page_max.stride() or page_min.stride(-1) != 1:
        page_min, page_max = page_min.contiguous(), page_max.contiguous()
    out = torch.empty(b, hq, n_pages, device=q.device, dtype=torch.float32)
    grid = (b * hkv, triton.cdiv(n_pages, block_pages))
    _quest_logits_kernel[grid](
        q, q.stride(0), q.stride(1), page_min, page_max, page_min.stride(0), page_min.stride(1), page_min.stride(2),
        out, out.stride(0), out.stride(1), n_pages, float(radius_scale),
        HKV=hkv, G=hq // hkv, D=d, BP=block_pages,
    )
    return out
