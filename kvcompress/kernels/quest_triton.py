"""Triton twin of `quest_page_scores_torch` (imports Triton; loaded only when asked)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _quest_scores_kernel(Q, q_sb, q_sh, MN, MX, m_sb, m_sh, m_sp, NV, OUT, n_pages,
                         HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BP: tl.constexpr,
                         HAS_NV: tl.constexpr):
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    h = pid_bh % HKV
    pages = tl.program_id(1) * BP + tl.arange(0, BP)
    ok = pages < n_pages
    d = tl.arange(0, D)
    base = b.to(tl.int64) * m_sb + h * m_sh + pages[:, None] * m_sp + d[None, :]
    lo = tl.load(MN + base, mask=ok[:, None], other=0.0).to(tl.float32)  # [BP, D]
    hi = tl.load(MX + base, mask=ok[:, None], other=0.0).to(tl.float32)
    best = tl.full([BP], float("-inf"), tl.float32)
    for g in range(G):  # the group's query heads
        qv = tl.load(Q + b.to(tl.int64) * q_sb + (h * G + g) * q_sh + d).to(tl.float32)[None, :]
        best = tl.maximum(best, tl.sum(tl.maximum(qv * lo, qv * hi), 1))
    if HAS_NV:
        ok_score = pages < tl.load(NV + b)
        best = tl.where(ok_score, best, float("-inf"))
    tl.store(OUT + pid_bh * n_pages + pages, best, mask=ok)


def quest_scores(q, page_min, page_max, n_valid=None, block_pages: int = 32):
    b, hq, d = q.shape
    hkv, n_pages = page_min.shape[1], page_min.shape[2]
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    if d & (d - 1):
        raise ValueError(f"the Quest kernel needs a power-of-two head dim, got {d}")
    q = q if q.stride(-1) == 1 else q.contiguous()
    if page_min.stride() != page_max.stride() or page_min.stride(-1) != 1:
        page_min, page_max = page_min.contiguous(), page_max.contiguous()
    out = torch.empty(b, hkv, n_pages, device=q.device, dtype=torch.float32)
    nv = n_valid.to(q.device, torch.int32) if n_valid is not None else out
    grid = (b * hkv, triton.cdiv(n_pages, block_pages))
    _quest_scores_kernel[grid](
        q, q.stride(0), q.stride(1), page_min, page_max, page_min.stride(0), page_min.stride(1), page_min.stride(2),
        nv, out, n_pages, HKV=hkv, G=hq // hkv, D=d, BP=block_pages, HAS_NV=n_valid is not None,
    )
    return out
