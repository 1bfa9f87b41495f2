"""Triton fused MLA decode over the packed 4-bit NUQ latent (twin: kvcompress.kernels.mla_decode.mla_decode_torch).

Same grid and online softmax as the dense kernel (kvcompress.kernels.mla_decode_triton), with the
latent tile kept small in registers:

- Even / odd channels. A packed byte holds channels 2j (low nibble) and 2j+1 (high nibble), so the tile
  is read as two half-width tiles [BLOCK_N, R/2] and the dots run on each half: the scores add the two
  halves' products, and the output keeps one accumulator per half. No [BLOCK_N, R] tile is ever built.
- One lookup per byte. For 16-bit queries a 256-entry table holds, per byte value, the two codebook
  levels as 16-bit floats packed in one int32 (low half = low nibble); fp32 queries look up each nibble.
- Scales folded out of the tile. x = level * scale[c] + mean[c], so q . x = (q * scale) . level +
  q . mean: the query is scaled once per program, the means give one score bias per head, and the output
  is rescaled once at the end. The tile the tensor cores read is the raw levels.

- A page list (Quest): the splits divide the list, and each entry names the page a tile reads.
- Outliers folded into the tile. The kernel reads outliers chosen per token (`outlier_scope="token"`: K per
  token, listed token by token): each one replaces its element of the level tile by its exact value in
  level units, (x - mean[c]) / scale[c], so the dots need no correction afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.kernels.mla_decode_triton import _k_rot_tile, _softmax_step
from kvcompress.tensor_version import tensor_version

_PAIR_TABLES: dict = {}


def pair_table(codebook: torch.Tensor, dtype: torch.dtype, device) -> torch.Tensor:
    """[256] int32: byte v -> level[v & 15] | level[v >> 4] << 16, each level as `dtype` (16-bit) bits.
    Cached per codebook tensor, version, dtype and device (a captured decode step allocates nothing and
    reads nothing back). The cache holds the codebook too, so its address is never reused by another."""
    key = (codebook.data_ptr(), tensor_version(codebook), dtype, str(device))
    entry = _PAIR_TABLES.get(key)
    if entry is None:
        bits = codebook.to(device, dtype).view(torch.int16).to(torch.int64) & 0xFFFF  # [16]
        v = torch.arange(256, device=device)
        pair = bits[v & 15] | (bits[v >> 4] << 16)
        entry = _PAIR_TABLES[key] = (codebook, torch.where(pair >= 2**31, pair - 2**32, pair).to(torch.int32))
    return entry[1]


@triton.jit
def _levels(KV, CB, PAIR, b, offs_n, n_mask, offs_j, stride_kvb, stride_kvt, DT: tl.constexpr, PAIR16: tl.constexpr):
    """The tile's codebook levels, even channels [BLOCK_N, R/2] and odd channels [BLOCK_N, R/2], as DT."""
    byte = tl.load(KV + b * stride_kvb + offs_n[:, None] * stride_kvt + offs_j[None, :], mask=n_mask[:, None], other=0)
    if PAIR16:
        w = tl.load(PAIR + byte.to(tl.int32))
        lo = (w & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
        hi = ((w >> 16) & 0xFFFF).to(tl.uint16).to(DT, bitcast=True)
    else:
        lo = tl.load(CB + (byte & 0xF).to(tl.int32)).to(DT)
        hi = tl.load(CB + (byte >> 4).to(tl.int32)).to(DT)
    return lo, hi


@triton.jit(do_not_specialize=("T", "blocks_per_split", "n_list"))
def _mla_decode_packed_kernel(
    QL, QR, Out, Lse, KV, KR, KRS, CB, PAIR, CMEAN, CSCALE, OIDX, OVAL, MASK, PAGES, LEN,
    SC, stride_scb, stride_sch,
    stride_qlb, stride_qlh, stride_qrb, stride_qrh, stride_mb,
    stride_kvb, stride_kvt, stride_krb, stride_krt, stride_krsb,
    stride_cmb, stride_oib, stride_oip, stride_pb, n_list,
    stride_ob, stride_oh, stride_os, stride_lb, stride_lh,
    H, T, blocks_per_split, qk_scale,
    R: tl.constexpr, DR: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    KR_FP8: tl.constexpr, K_TOK: tl.constexpr, HAS_MASK: tl.constexpr, PAIR16: tl.constexpr,
    TILE_F16: tl.constexpr, HAS_PAGES: tl.constexpr, HAS_LEN: tl.constexpr, WRITE_SCORES: tl.constexpr,
):
    RH: tl.constexpr = R // 2
    b = tl.program_id(1)
    offs_h = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = offs_h < H
    offs_j = tl.arange(0, RH)
    ev, od = 2 * offs_j, 2 * offs_j + 1
    offs_dr = tl.arange(0, DR)
    offs_bn = tl.arange(0, BLOCK_N)
    # the dots' operand type: the query's, or fp16 for fp32 queries on a GPU (two fp32 half tiles, each used
    # twice, would not fit in shared memory; fp16 keeps the 10-bit mantissa of the tf32 dots fp32 would get)
    DT: tl.constexpr = tl.float16 if TILE_F16 else QL.dtype.element_ty

    # queries folded with the channel scales; the channel means become one score bias per head
    q_row = QL + b * stride_qlb + offs_h[:, None] * stride_qlh
    q_ev = tl.load(q_row + ev[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    q_od = tl.load(q_row + od[None, :], mask=h_mask[:, None], other=0.0).to(tl.float32)
    sc_ev, sc_od = tl.load(CSCALE + b * stride_cmb + ev), tl.load(CSCALE + b * stride_cmb + od)
    mu_ev, mu_od = tl.load(CMEAN + b * stride_cmb + ev), tl.load(CMEAN + b * stride_cmb + od)
    q_bias = tl.sum(q_ev * mu_ev[None, :], 1) + tl.sum(q_od * mu_od[None, :], 1)  # [BLOCK_H]
    qs_ev = (q_ev * sc_ev[None, :]).to(DT)
    qs_od = (q_od * sc_od[None, :]).to(DT)
    qr = tl.load(QR + b * stride_qrb + offs_h[:, None] * stride_qrh + offs_dr[None, :], mask=h_mask[:, None], other=0.0)
    qr = qr.to(DT)

    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc_ev = tl.zeros([BLOCK_H, RH], tl.float32)
    acc_od = tl.zeros([BLOCK_H, RH], tl.float32)
    if HAS_LEN:  # a decode graph: the row's filled length is on the device, the buffers are the reservation
        T = tl.load(LEN + b)
        if not HAS_PAGES:
            n_list = tl.cdiv(T, BLOCK_N)
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, n_list)  # tiles of the latent, or entries of the page list
    for i in range(first, last):
        if HAS_PAGES:  # Quest's page i of this row (-1: nothing; its loads stay on page 0, all masked)
            page = tl.load(PAGES + b * stride_pb + i)
            blk = tl.maximum(page, 0)
            offs_n = blk * BLOCK_N + offs_bn
            n_mask = offs_n < tl.where(page >= 0, T, 0)
        else:
            blk = i
            offs_n = blk * BLOCK_N + offs_bn
            n_mask = offs_n < T
        u_ev, u_od = _levels(KV, CB, PAIR, b, offs_n, n_mask, offs_j, stride_kvb, stride_kvt, DT, PAIR16)
        for k in tl.static_range(K_TOK):  # each token's k-th outlier replaces its element of the tile
            o_ptr = b * stride_oib + blk * stride_oip + offs_bn * K_TOK + k
            c = tl.load(OIDX + o_ptr).to(tl.int32) % R
            z = (tl.load(OVAL + o_ptr).to(tl.float32) - tl.load(CMEAN + b * stride_cmb + c)) / tl.load(
                CSCALE + b * stride_cmb + c)
            z = z.to(DT)[:, None]
            u_ev = tl.where(c[:, None] == ev[None, :], z, u_ev)
            u_od = tl.where(c[:, None] == od[None, :], z, u_od)
        kr = _k_rot_tile(KR, KRS, b, offs_n, n_mask, offs_dr, stride_krb, stride_krt, stride_krsb, DT, KR_FP8)
        # -- scores [BLOCK_H, BLOCK_N]
        s = tl.dot(qs_ev, tl.trans(u_ev)) + tl.dot(qs_od, tl.trans(u_od)) + tl.dot(qr, tl.trans(kr))
        s = (s + q_bias[:, None]) * qk_scale
        p, alpha, m_i, l_i = _softmax_step(s, m_i, l_i, MASK, b, stride_mb, offs_n, n_mask, HAS_MASK,
                                           SC, stride_scb, stride_sch, offs_h, h_mask, WRITE_SCORES)
        pd = p.to(DT)
        acc_ev = acc_ev * alpha[:, None] + tl.dot(pd, u_ev)
        acc_od = acc_od * alpha[:, None] + tl.dot(pd, u_od)

    has = l_i > 0
    inv_l = 1.0 / tl.maximum(l_i, 1e-30)
    out_ev = tl.where(has[:, None], acc_ev * inv_l[:, None] * sc_ev[None, :] + mu_ev[None, :], 0.0)
    out_od = tl.where(has[:, None], acc_od * inv_l[:, None] * sc_od[None, :] + mu_od[None, :], 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.maximum(l_i, 1e-30))) * 0.6931471805599453, float("-inf"))  # ln(2)
    o_row = Out + b * stride_ob + offs_h[:, None] * stride_oh + split * stride_os
    tl.store(o_row + ev[None, :], out_ev, mask=h_mask[:, None])
    tl.store(o_row + od[None, :], out_od, mask=h_mask[:, None])
    tl.store(Lse + b * stride_lb + offs_h * stride_lh + split, lse, mask=h_mask)

