"""Triton side of the fused MLA decode (see kvcompress.kernels.mla_decode for the math and the twin).

Grid: (head block, batch, split). Each program takes BLOCK_H query heads of one sequence and a
contiguous range of tiles of BLOCK_N tokens, scores each tile against the heads' absorbed queries and
keeps an online softmax in base 2. The head blocks of one (sequence, split) are neighbours in launch
order, so they run together and read the same latent tiles from L2 rather than each from HBM. An
optional mask [B, T] (nonzero: attend) drops tokens such as padding.

This file's kernel reads a dense latent (bf16 / fp16 / fp32); a packed 4-bit latent goes to
`kvcompress.kernels.mla_decode_packed_triton`, which `mla_decode_triton` dispatches to. Importing this
module imports Triton; `kvcompress.kernels.mla_decode` does so only when asked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.kernels.mla_decode import LOG2E, SCORES_WITH_PAGES, MlaLatent


@triton.jit
def _k_rot_tile(KR, KRS, b, offs_n, n_mask, offs_dr, stride_krb, stride_krt, stride_krsb, DT: tl.constexpr,
                KR_FP8: tl.constexpr):
    """The RoPE keys of a tile [BLOCK_N, DR] as DT: dense, or E4M3 codes times their per-token scale."""
    kr = tl.load(KR + b * stride_krb + offs_n[:, None] * stride_krt + offs_dr[None, :], mask=n_mask[:, None], other=0)
    if KR_FP8:
        kr_scale = tl.load(KRS + b * stride_krsb + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        kr = kr.to(tl.float8e4nv, bitcast=True).to(tl.float32) * kr_scale[:, None]
    return kr.to(DT)


@triton.jit
def _softmax_step(s, m_i, l_i, MASK, b, stride_mb, offs_n, n_mask, HAS_MASK: tl.constexpr, SC, stride_scb,
                  stride_sch, offs_h, h_mask, WRITE_SCORES: tl.constexpr):
    """One tile of the online softmax in base 2: scores s [BLOCK_H, BLOCK_N] (already scaled), tokens past
    T or masked dropped -> (p, alpha, m_new, l_new). A row whose tokens so far are all masked keeps
    m = -inf and gets p = 0 (not NaN). WRITE_SCORES: the tile's scores (-inf where masked) are stored to
    SC [B, H, T] at the tokens' positions, for the attention mass H2O reads."""
    keep = n_mask
    if HAS_MASK:
        keep = keep & (tl.load(MASK + b * stride_mb + offs_n, mask=n_mask, other=0) != 0)
    s = tl.where(keep[None, :], s, float("-inf"))
    if WRITE_SCORES:
        tl.store(SC + b * stride_scb + offs_h[:, None] * stride_sch + offs_n[None, :], s,
                 mask=h_mask[:, None] & n_mask[None, :])
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_sub)
    p = tl.exp2(s - m_sub[:, None])
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit(do_not_specialize=("T", "blocks_per_split"))
def _mla_decode_kernel(
    QL, QR, Out, Lse, KV, KR, KRS, MASK, SC, stride_scb, stride_sch,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_mb,
    stride_kvb, stride_kvt, stride_krb, stride_krt, stride_krsb,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    H, T, blocks_per_split, qk_scale,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KR_FP8: tl.constexpr, HAS_MASK: tl.constexpr, WRITE_SCORES: tl.constexpr,
):
    b = tl.program_id(1)
    offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = offs_h < H
    offs_r = tl.arange(0, R)
    offs_dr = tl.arange(0, DR)
    offs_bn = tl.arange(0, BLOCK_N)

    ql = tl.load(QL + b * stride_qlb + offs_h[:, None] * stride_qlh + offs_r[None, :], mask=h_mask[:, None], other=0.0)
    qr = tl.load(QR + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_dr[None, :], mask=h_mask[:, None], other=0.0)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    n_blocks = tl.cdiv(T, BLOCK_N)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_blocks)
    for blk in range(first, last):
        offs_n = blk * BLOCK_N + offs_bn
        n_mask = offs_n < T
        kv = tl.load(KV + b * stride_kvb + offs_n[:, None] * stride_kvt + offs_r[None, :], mask=n_mask[:, None], other=0.0)
        kr = _k_rot_tile(KR, KRS, b, offs_n, n_mask, offs_dr, stride_krb, stride_krt, stride_krsb, qr.dtype, KR_FP8)
        # -- scores [BLOCK_H, BLOCK_N]
        s = (tl.dot(ql, tl.trans(kv)) + tl.dot(qr, tl.trans(kr))) * qk_scale
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, MASK, b, stride_mb, offs_n, n_mask, HAS_MASK,
                                           SC, stride_scb, stride_sch, offs_h, h_mask, WRITE_SCORES)
        acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)

    out = acc / tl.maximum(l_i, 1e-30)[:, None]
    lse = tl.where(l_i > 0, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, float("-inf"))  # ln(2)
    tl.store(Out + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os + offs_r[None, :], out,
             mask=h_mask[:, None])
    tl.store(Lse + b * stride_lb + offs_h * stride_lh + split, lse, mask=h_mask)


def mla_decode_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: MlaLatent,
    scaling: float,
    num_splits: int = 1,
    allowed: torch.Tensor | None = None,
    block_h: int = 16,
    num_warps: int = 4,
    num_stages: int = 1,
    tile_f16: bool | None = None,
    pages: torch.Tensor | None = None,
    lengths: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `mla_decode_torch` (scores included); block_h heads per program, tiles of
    latent.page_size tokens.
    A packed latent's outliers must be chosen per token (`latent.outliers_per_token`). tile_f16: the packed
    kernel's dot operands in fp16 for fp32 queries (None: on a GPU, where fp32 tiles do not fit). pages
    [B, n]: the page list (packed latents), the splits dividing it. lengths [B] int32: each row's filled
    tokens (packed latents in a decode graph's reserved buffers; the splits divide the whole reservation)."""
    b, h, r = q_latent.shape
    assert r == latent.latent_dim and r & (r - 1) == 0, f"latent width {r} must be a power of two"
    assert q_rope.shape[:2] == (b, h) and q_rope.shape[-1] == latent.k_rot.shape[-1]
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1, "q_latent / q_rope need a contiguous last dim"
    assert latent.kv.stride(-1) == 1 and latent.k_rot.stride(-1) == 1, "latent tensors need a contiguous last dim"
    t = latent.num_tokens
    out = torch.empty(b, h, num_splits, r, device=q_latent.device, dtype=torch.float32)
    lse = torch.empty(b, h, num_splits, device=q_latent.device, dtype=torch.float32)
    if pages is not None:
        if not latent.is_packed:
            raise ValueError("a page list is read over a packed latent only; attend over a dense one whole")
        assert pages.shape[0] == b and pages.stride(-1) == 1, f"pages {tuple(pages.shape)} must be [B, n], contiguous"
        pages = pages.to(torch.int32)
    n_list = pages.shape[1] if pages is not None else triton.cdiv(t, latent.page_size)
    per_split = triton.cdiv(n_list, num_splits)
    kv, k_rot = latent.kv, latent.k_rot
    dummy = q_latent.new_zeros(1)
    krs = latent.k_rot_scale if latent.k_rot_scale is not None else dummy
    if allowed is not None:
        assert allowed.shape == (b, t), f"allowed {tuple(allowed.shape)} must be [B, T] = {(b, t)}"
        mask = allowed.to(torch.uint8) if allowed.dtype == torch.bool else allowed
        assert mask.stride(-1) == 1, "allowed needs a contiguous last dim"
    else:
        mask = dummy
    if scores is not None:
        _check_scores(scores, b, h, t, pages)
    sc = scores if scores is not None else dummy
    sc_strides = (sc.stride(0), sc.stride(1)) if scores is not None else (0, 0)
    grid = (triton.cdiv(h, block_h), b, num_splits)
    common = (
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1),
        mask.stride(0) if allowed is not None else 0,
        kv.stride(0), kv.stride(1), k_rot.stride(0), k_rot.stride(1), krs.stride(0) if krs.dim() > 1 else 0,
    )
    tail = (out.stride(0), out.stride(1), out.stride(2), lse.stride(0), lse.stride(1), h, t, per_split, scaling * LOG2E)
    meta = dict(R=r, DR=q_rope.shape[-1], BLOCK_H=block_h, BLOCK_N=latent.page_size,
                KR_FP8=latent.k_rot_scale is not None, HAS_MASK=allowed is not None,
                WRITE_SCORES=scores is not None, num_warps=num_warps, num_stages=num_stages)
    if not latent.is_packed:
        if lengths is not None:
            raise ValueError("lengths are read over a packed latent only; mask a dense one with `allowed`")
        _mla_decode_kernel[grid](q_latent, q_rope, out, lse, kv, k_rot, krs, mask, sc, *sc_strides, *common,
                                 *tail, **meta)
        return out, lse

    from kvcompress.kernels.mla_decode_packed_triton import _mla_decode_packed_kernel, pair_table

    if latent.num_outliers and not latent.outliers_per_token:
        raise ValueError(
            "the MLA kernel reads outliers chosen per token (QuantSpec(outlier_scope='token')); this latent's "
            "are chosen per page: attend over it with mla_decode_torch, or quantize with outlier_scope='token'"
        )
    if tile_f16 is None:  # see the packed kernel's operand type
        tile_f16 = q_latent.is_cuda
    tile_f16 = tile_f16 and q_latent.dtype == torch.float32
    tile_dtype = torch.float16 if tile_f16 else q_latent.dtype
    pair16 = tile_dtype in (torch.float16, torch.bfloat16)
    pair = pair_table(latent.codebook, tile_dtype, q_latent.device) if pair16 else dummy
    cb = latent.codebook.to(q_latent.device, torch.float32)
    cmean, cscale = latent.channel_mean.float().contiguous(), latent.channel_scale.float().contiguous()
    oidx = latent.outlier_idx if latent.num_outliers else dummy
    oval = latent.outlier_val if latent.num_outliers else dummy
    page_list = pages if pages is not None else dummy
    if lengths is not None:
        assert lengths.shape == (b,) and lengths.dtype == torch.int32, "lengths must be [B] int32"
    _mla_decode_packed_kernel[grid](
        q_latent, q_rope, out, lse, kv, k_rot, krs, cb, pair, cmean, cscale, oidx, oval, mask, page_list,
        lengths if lengths is not None else dummy, sc, *sc_strides, *common,
        cmean.stride(0), oidx.stride(0) if oidx.dim() > 1 else 0, oidx.stride(1) if oidx.dim() > 1 else 0,
        page_list.stride(0) if pages is not None else 0, n_list, *tail,
        K_TOK=latent.outliers_per_token, PAIR16=pair16, TILE_F16=tile_f16, HAS_PAGES=pages is not None,
        HAS_LEN=lengths is not None, **meta,
    )
    return out, lse


def _check_scores(scores: torch.Tensor, b: int, h: int, t: int, pages) -> None:
    if pages is not None:
        raise ValueError(SCORES_WITH_PAGES)
    if scores.shape != (b, h, t) or scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError(f"scores must be a float32 [B, H, T] = {(b, h, t)} buffer with a contiguous last "
                         f"dim, got {scores.dtype} {tuple(scores.shape)}")
