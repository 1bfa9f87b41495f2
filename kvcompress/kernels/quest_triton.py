"""Triton twins of `quest_page_logits_torch` and `quest_page_mass_torch` (imports Triton; loaded only when
asked)."""

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


@triton.jit
def _page_ok(valid_row, pages, n_pages, HAS_VALID: tl.constexpr):
    """Which of `pages` exist and are valid (VALID [n_pages] uint8 row, when given)."""
    ok = pages < n_pages
    if HAS_VALID:
        ok = ok & (tl.load(valid_row + pages, mask=ok, other=0) != 0)
    return ok


@triton.jit(do_not_specialize=("n_pages",))
def _quest_mass_kernel(L, l_sb, l_sh, VALID, v_sb, v_sh, OUT, o_sb, o_sh, n_pages, scaling,
                       HKV: tl.constexpr, G: tl.constexpr, BP: tl.constexpr, HAS_VALID: tl.constexpr,
                       ONE_BLOCK: tl.constexpr, TOP_K: tl.constexpr = 0, TOP_KP: tl.constexpr = 1):
    """One (batch, kv head). ONE_BLOCK (n_pages <= BP): each query head's logits are read once and held in
    registers, its softmax added to the group's sum. Otherwise, per query head a pass for the softmax's
    max and sum (online), then one pass writing the group's summed softmax. -inf on pages not valid.
    TOP_K > 0 (ONE_BLOCK only): instead of the masses, the TOP_K pages of highest mass (`_top_pages`)."""
    pid_bh = tl.program_id(0)
    b = pid_bh // HKV
    h = pid_bh % HKV
    rows = L + b.to(tl.int64) * l_sb + (h * G) * l_sh
    valid_row = VALID + b.to(tl.int64) * v_sb + h * v_sh
    out = OUT + b.to(tl.int64) * o_sb + h * o_sh
    offs = tl.arange(0, BP)
    if ONE_BLOCK:
        ok = _page_ok(valid_row, offs, n_pages, HAS_VALID)
        mass = tl.zeros([BP], tl.float32)
        for g in tl.static_range(G):
            x = tl.load(rows + g * l_sh + offs, mask=ok, other=float("-inf")) * scaling
            e = tl.where(ok, tl.exp(x - tl.max(x, 0)), 0.0)
            mass += e / tl.maximum(tl.sum(e, 0), 1e-30)
        if TOP_K > 0:
            _top_pages(mass, ok, offs, out, BP, TOP_K, TOP_KP)
        else:
            tl.store(out + offs, tl.where(ok, mass, float("-inf")), mask=offs < n_pages)
    else:
        ms = ()
        ss = ()
        for g in tl.static_range(G):
            m = tl.full([BP], float("-inf"), tl.float32)
            acc = tl.zeros([BP], tl.float32)
            for p0 in range(0, n_pages, BP):
                pages = p0 + offs
                ok = _page_ok(valid_row, pages, n_pages, HAS_VALID)
                x = tl.load(rows + g * l_sh + pages, mask=ok, other=float("-inf")) * scaling
                m_new = tl.maximum(m, x)
                acc = acc * tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new)) + tl.where(
                    x == float("-inf"), 0.0, tl.exp(x - m_new))
                m = m_new
            m_row = tl.max(m, 0)
            ms = ms + (m_row,)
            ss = ss + (tl.sum(acc * tl.where(m == float("-inf"), 0.0, tl.exp(m - m_row)), 0),)
        for p0 in range(0, n_pages, BP):
            pages = p0 + offs
            ok = _page_ok(valid_row, pages, n_pages, HAS_VALID)
            mass = tl.zeros([BP], tl.float32)
            for g in tl.static_range(G):
                x = tl.load(rows + g * l_sh + pages, mask=ok, other=float("-inf")) * scaling
                mass += tl.where(x == float("-inf"), 0.0, tl.exp(x - ms[g]) / tl.maximum(ss[g], 1e-30))
            tl.store(out + pages, tl.where(ok, mass, float("-inf")), mask=pages < n_pages)


@triton.jit
def _top_pages(mass, ok, offs, out, BP: tl.constexpr, K: tl.constexpr, KP: tl.constexpr):
    """Store the K valid pages of highest mass [BP] (ties: the lower page first) to out[0:K], in ascending
    page order, -1 in the slots past the valid pages. No sort: a non-negative float orders as its bits do,
    so the K-th largest mass is found bit by bit from the top (31 counts over the row held in registers;
    a bitonic sort of the 4096-page row took 94 us on an H200, this and the mass 7 us before it), then each
    selected page's slot is its rank among the selected."""
    bits = tl.where(ok, mass.to(tl.int32, bitcast=True), -1)
    thr = tl.zeros([], tl.int32)
    for bit in tl.static_range(30, -1, -1):  # the largest thr with at least K masses >= thr
        cand = thr | (1 << bit)
        thr = tl.where(tl.sum((bits >= cand).to(tl.int32), 0) >= K, cand, thr)
    above = bits > thr
    tie = bits == thr
    room = K - tl.sum(above.to(tl.int32), 0)  # ties taken, lowest pages first
    sel = above | (tie & (tl.cumsum(tie.to(tl.int32), 0) <= room))
    tl.store(out + tl.cumsum(sel.to(tl.int32), 0) - 1, offs, mask=sel)
    count = tl.sum(sel.to(tl.int32), 0)
    ks = tl.arange(0, KP)
    tl.store(out + ks, tl.full([KP], -1, tl.int32), mask=(ks >= count) & (ks < K))


def quest_top_pages(logits, hkv: int, k: int, valid=None, scaling: float = 1.0, one_block: int = 4096):
    """The k valid pages of highest summed softmax mass per (batch, kv head): [B, Hkv, k] int32 in ascending
    page order, -1 last where fewer than k are valid (ties: the lower page). One launch, the row held in
    registers (n_pages <= one_block, else None: the caller takes `quest_mass` and a top-k), in a block of
    the next power of two (one compile per doubling of the context: on an H200 a block of 4096 took 19.7
    us over 2048 pages and 19.4 over 512, one of 2048 or 512 16.3 and 12.5)."""
    b, hq, n_pages = logits.shape
    if n_pages > one_block or k < 1:
        return None
    block = min(one_block, max(128, triton.next_power_of_2(n_pages)))
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(b, hkv, k, device=logits.device, dtype=torch.int32)
    v_args = _valid_args(valid, b, hkv, n_pages, logits)
    _quest_mass_kernel[(b * hkv,)](
        logits, logits.stride(0), logits.stride(1), *v_args, out, out.stride(0), out.stride(1), n_pages,
        float(scaling), HKV=hkv, G=hq // hkv, BP=block, HAS_VALID=valid is not None, ONE_BLOCK=True,
        TOP_K=k, TOP_KP=triton.next_power_of_2(k), num_warps=8,
    )
    return out


def _valid_args(valid, b: int, hkv: int, n_pages: int, logits):
    """(VALID, v_sb, v_sh) kernel arguments of a [B, Hkv|1, n_pages] bool mask (None: every page)."""
    if valid is None:
        return logits, 0, 0
    valid = valid.expand(b, hkv, n_pages)  # a mask shared by the kv heads keeps stride 0: no copy
    if valid.stride(-1) != 1:
        valid = valid.contiguous()
    valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
    return valid, valid.stride(0), valid.stride(1)


def quest_mass(logits, hkv: int, valid=None, scaling: float = 1.0, one_block: int = 4096,
               block_pages: int = 1024):
    """Up to `one_block` pages a row is held in registers (one block size, so the kernel compiles once as
    the context grows); longer rows loop over blocks of `block_pages`. Measured on an H200 (BENCHMARKS.md):
    the looping form alone took 32 us at 4096 pages x 64 rows, about twice the torch ops it replaces; the
    form in registers is not timed yet."""
    b, hq, n_pages = logits.shape
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    out = torch.empty(b, hkv, n_pages, device=logits.device, dtype=torch.float32)
    v_args = _valid_args(valid, b, hkv, n_pages, logits)
    one = n_pages <= one_block
    _quest_mass_kernel[(b * hkv,)](
        logits, logits.stride(0), logits.stride(1), *v_args, out, out.stride(0), out.stride(1), n_pages,
        float(scaling), HKV=hkv, G=hq // hkv, BP=one_block if one else block_pages, HAS_VALID=valid is not None,
        ONE_BLOCK=one, num_warps=8,
    )
    return out
