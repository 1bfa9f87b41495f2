"""Fused decode attention (flash-decoding) reading the packed cache as stored; twin of decode_attention_torch.

Grid: (batch * kv head, split). Each program of a (b, h) reads that kv head's bytes once for all G query
heads of its group (the G rows of one tl.dot, padded to 16), over a contiguous range of body tokens
(or of page-list entries, Quest); the last split of each (b, h) reads the exact sinks and tail. Codes are
dequantized in registers (unpack, codebook or scale/zero, fp8 bits); nuq outliers are applied as a sparse
correction of the scores (keys) and of the output (values), exact up to the dot's input rounding. Online
softmax in fp32 (base 2), partial (m, l, acc) per split, then a small reduce kernel.
Optional: the log2-domain scores of every read position are written so the H2O probabilities come from
the final log-sum-exp without a second pass over the keys.

Importing this module imports Triton; `kvcompress.kernels.decode_attention` does so only when asked.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kvcompress.kernels.backend import interpreting
from kvcompress.kernels.parts import AttentionParts
from kvcompress.kernels.split_count import MIN_SPLIT_TOKENS, default_splits, merge_block
from kvcompress.kernels.streams import (
    KIND_DENSE,
    KIND_INT,
    KIND_NUQ,
    StreamArgs,
    level_tables,
    stream_args,
)

LOG2E = 1.4426950408889634  # 1/ln(2): softmax in base 2
# Lengths change every decode step; Triton would otherwise compile a new variant of a kernel each time one
# of them becomes 1 or a multiple of 16 (a stall of seconds in the middle of a generation).
LENGTH_ARGS = ("n_sink", "n_tail", "n_body", "n_sel", "tokens_per_split", "n_body_splits")
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for running maxima, so exp2(m_old - m_new) never sees inf - inf


# ---------------------------------------------------------------------------------------------------
# dequantization helpers (elementwise on any broadcastable index shapes)
# ---------------------------------------------------------------------------------------------------
@triton.jit
def _codes_bitstream(codes, c_sn, tok, d, ok, BITS: tl.constexpr):
    """Code of element (tok, d) of a little-endian bitstream of BITS-bit codes (any BITS <= 8)."""
    bit = d * BITS
    row = codes + tok * c_sn
    lo = tl.load(row + (bit >> 3), mask=ok, other=0).to(tl.int32)
    if (BITS & (BITS - 1)) == 0:
        word = lo
    else:  # 3, 5, 6, 7 bits: a code may straddle two bytes
        sh0 = bit & 7
        hi = tl.load(row + (bit >> 3) + 1, mask=ok & (sh0 + BITS > 8), other=0).to(tl.int32)
        word = lo | (hi << 8)
    return (word >> (bit & 7)) & ((1 << BITS) - 1)


@triton.jit
def _width_units(codes, c_sn, tok, tab, d, ok):
    """Element (tok, d) of a stream whose channels have their own widths (KIND_NUQ_WIDTHS), as u in [-1, 1]:
    tab [H's row] holds each channel's bit offset << 4 | width; the code's 2**w - 1 levels span [-1, 1] (ends
    on the page range), width 0 reads 0 (the page's middle). A code of <= 8 bits spans at most two bytes."""
    t = tl.load(tab + d)
    off = t >> 4
    w = t & 15
    row = codes + tok * c_sn
    lo = tl.load(row + (off >> 3), mask=ok, other=0).to(tl.int32)
    hi = tl.load(row + (off >> 3) + 1, mask=ok & ((off & 7) + w > 8), other=0).to(tl.int32)
    top = (1 << w) - 1
    c = ((lo | (hi << 8)) >> (off & 7)) & top
    return tl.where(w > 0, c.to(tl.float32) * (2.0 / tl.maximum(top, 1).to(tl.float32)) - 1.0, 0.0)


@triton.jit
def _split2(w, S: tl.constexpr, M: tl.constexpr):
    return tl.interleave(w & M, (w >> S) & M)


@triton.jit
def _split4(w, S: tl.constexpr, M: tl.constexpr):
    return tl.interleave(_split2(w, 2 * S, M), _split2(w >> S, 2 * S, M))


@triton.jit
def _split8(w, S: tl.constexpr, M: tl.constexpr):
    return tl.interleave(_split4(w, 2 * S, M), _split4(w >> S, 2 * S, M))


@triton.jit
def _split16(w, S: tl.constexpr, M: tl.constexpr):
    return tl.interleave(_split8(w, 2 * S, M), _split8(w >> S, 2 * S, M))


@triton.jit
def _codes_tile(codes, c_sn, tok, ok, BITS: tl.constexpr, D: tl.constexpr):
    """Codes [BN, D] (int32) of the tokens tok [BN, 1]: whole 32-bit words for 2 and 4 bits, bytes for 8."""
    if BITS == 8:
        c = tl.load(codes + tok * c_sn + tl.arange(0, D)[None, :], mask=ok, other=0).to(tl.int32)
    elif BITS == 4:
        words = codes.to(tl.pointer_type(tl.int32))  # 8 codes per 32-bit word
        w = tl.load(words + tok * (c_sn // 4) + tl.arange(0, D // 8)[None, :], mask=ok, other=0)
        c = _split8(w, 4, 15)
    elif BITS == 2:
        words = codes.to(tl.pointer_type(tl.int32))  # 16 codes per 32-bit word
        w = tl.load(words + tok * (c_sn // 4) + tl.arange(0, D // 16)[None, :], mask=ok, other=0)
        c = _split16(w, 2, 3)
    else:
        c = _codes_bitstream(codes, c_sn, tok, tl.arange(0, D)[None, :], ok, BITS)
    return c


@triton.jit
def _scale_at(ptr, s_sn, s_sc, tok, page, d, ok, SCALE_AT: tl.constexpr, GROUP: tl.constexpr, D: tl.constexpr):
    """The scale (or zero) of element (tok, d): per token (group of channels), page & channel, channel, head."""
    if SCALE_AT == 1:  # SCALE_TOKEN
        if GROUP == D:
            v = tl.load(ptr + tok * s_sn, mask=ok, other=0.0)
        else:
            v = tl.load(ptr + tok * s_sn + (d // GROUP) * s_sc, mask=ok, other=0.0)
    elif SCALE_AT == 2:  # SCALE_PAGE
        v = tl.load(ptr + page * s_sn + d * s_sc, mask=ok, other=0.0)
    elif SCALE_AT == 3:  # SCALE_ROW
        v = tl.load(ptr + d * s_sc)
    else:  # SCALE_HEAD
        v = tl.load(ptr)
    return v.to(tl.float32)


@triton.jit
def _value_of(c, cb, KIND: tl.constexpr):
    """value(code) before scale / zero, float32."""
    if KIND == 4:  # KIND_NUQ
        x = tl.load(cb + c)
    elif KIND == 3:  # KIND_INT
        x = c.to(tl.float32)
    elif KIND == 1:  # KIND_FP8E4
        x = c.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:  # KIND_FP8E5
        x = c.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    return x


@triton.jit
def _apply_scale(x, scale, zero, s_sn, s_sc, tok, page, d, ok,
                 SCALE_AT: tl.constexpr, GROUP: tl.constexpr, HAS_ZERO: tl.constexpr, D: tl.constexpr):
    if SCALE_AT != 0:
        x = x * _scale_at(scale, s_sn, s_sc, tok, page, d, ok, SCALE_AT, GROUP, D)
    if HAS_ZERO:
        x = x + _scale_at(zero, s_sn, s_sc, tok, page, d, ok, SCALE_AT, GROUP, D)
    return x


@triton.jit
def _dequant_tile(codes, c_sn, scale, zero, s_sn, s_sc, cb, tok, page, ok,
                  KIND: tl.constexpr, BITS: tl.constexpr, SCALE_AT: tl.constexpr, GROUP: tl.constexpr,
                  HAS_ZERO: tl.constexpr, D: tl.constexpr):
    """Dequantized rows [BN, D] float32 of tokens tok [BN, 1] (pages page [BN, 1], validity ok [BN, 1])."""
    d = tl.arange(0, D)[None, :]
    if KIND == 0:  # KIND_DENSE
        x = tl.load(codes + tok * c_sn + d, mask=ok, other=0.0).to(tl.float32)
    elif KIND == 5:  # KIND_NUQ_WIDTHS
        x = _width_units(codes, c_sn, tok, cb, d, ok)
        x = _apply_scale(x, scale, zero, s_sn, s_sc, tok, page, d, ok, SCALE_AT, GROUP, HAS_ZERO, D)
    else:
        if KIND == 3 or KIND == 4:
            c = _codes_tile(codes, c_sn, tok, ok, BITS, D)
        else:
            c = tl.load(codes + tok * c_sn + d, mask=ok, other=0)
        x = _value_of(c, cb, KIND)
        x = _apply_scale(x, scale, zero, s_sn, s_sc, tok, page, d, ok, SCALE_AT, GROUP, HAS_ZERO, D)
    return x


@triton.jit
def _dequant_points(codes, c_sn, scale, zero, s_sn, s_sc, cb, tok, page, d, ok,
                    KIND: tl.constexpr, BITS: tl.constexpr, SCALE_AT: tl.constexpr, GROUP: tl.constexpr,
                    HAS_ZERO: tl.constexpr, D: tl.constexpr):
    """Dequantized elements (tok, d) float32, for a list of points (the outlier positions)."""
    if KIND == 5:  # KIND_NUQ_WIDTHS
        x = _width_units(codes, c_sn, tok, cb, d, ok)
    else:
        if KIND == 3 or KIND == 4:
            c = _codes_bitstream(codes, c_sn, tok, d, ok, BITS)
        else:
            c = tl.load(codes + tok * c_sn + d, mask=ok, other=0)
        x = _value_of(c, cb, KIND)
    return _apply_scale(x, scale, zero, s_sn, s_sc, tok, page, d, ok, SCALE_AT, GROUP, HAS_ZERO, D)


@triton.jit
def _cast(x, DOT_FP32: tl.constexpr, DT: tl.constexpr):
    if not DOT_FP32:
        x = x.to(DT)
    return x


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _outlier_deltas(oidx, oval, o_sp, codes, c_sn, scale, zero, s_sn, s_sc, cb,
                    pl, l0, n_sel_tokens, len_b,
                    HAS_PL: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, OPB: tl.constexpr,
                    KCP: tl.constexpr, NOUT: tl.constexpr,
                    KIND: tl.constexpr, BITS: tl.constexpr, SCALE_AT: tl.constexpr, GROUP: tl.constexpr,
                    HAS_ZERO: tl.constexpr, D: tl.constexpr):
    """The outliers of the pages of block l0: row in the block r, channel d, exact - coded value, validity."""
    o = tl.arange(0, OPB * KCP)
    j = o % KCP
    page_sel = l0 // P + o // KCP
    ok = (j < NOUT) & (page_sel * P < n_sel_tokens)
    if HAS_PL:
        page = tl.load(pl + page_sel, mask=ok, other=-1)
        ok = ok & (page >= 0)
    else:
        page = page_sel
    idx = tl.load(oidx + page * o_sp + j, mask=ok, other=0).to(tl.int32)
    val = tl.load(oval + page * o_sp + j, mask=ok, other=0.0).to(tl.float32)
    t_in = idx // D
    d_o = idx % D
    tok = page * P + t_in
    r = page_sel * P + t_in - l0
    ok = ok & (tok < len_b) & (r >= 0) & (r < BN)
    coded = _dequant_points(codes, c_sn, scale, zero, s_sn, s_sc, cb, tok, page, d_o, ok,
                            KIND, BITS, SCALE_AT, GROUP, HAS_ZERO, D)
    return r, d_o, tl.where(ok, val - coded, 0.0), ok


@triton.jit
def _dense_range(m_i, l_i, acc, q_dot, kp, vp, k_sn, v_sn, n, pos0, first, sc_row, g_ok, qk_scale,
                 WRITE_SCORES: tl.constexpr, DBN: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 DOT_FP32: tl.constexpr, DT: tl.constexpr):
    """Online-softmax update over n exact tokens [n, D] (sinks or tail); tokens before `first` are
    padding (not attended)."""
    dk = tl.arange(0, DK)[None, :]
    dv = tl.arange(0, DV)[None, :]
    for t0 in range(0, n, DBN):
        t = t0 + tl.arange(0, DBN)
        ok = (t < n) & (t >= first)
        k = tl.load(kp + t[:, None] * k_sn + dk, mask=ok[:, None], other=0.0)
        s = _dot(q_dot, tl.trans(_cast(k, DOT_FP32, DT)), DOT_FP32) * qk_scale
        s = tl.where(ok[None, :], s, float("-inf"))
        if WRITE_SCORES:
            tl.store(sc_row + pos0 + t[None, :], s, mask=g_ok[:, None] & ok[None, :])
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(vp + t[:, None] * v_sn + dv, mask=ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(_cast(p, DOT_FP32, DT), _cast(v, DOT_FP32, DT), DOT_FP32)
        m_i = m_new
    return m_i, l_i, acc


@triton.jit
def _sinks_then_tail(m_i, l_i, acc, q_dot, sk, sv, sk_sn, sv_sn, n_sink, tk, tv, tk_sn, tv_sn, n_tail, n_body,
                     first, sc_row, g_ok, qk_scale, WRITE_SCORES: tl.constexpr, DBN: tl.constexpr,
                     DK: tl.constexpr, DV: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr):
    """The exact parts of one kv head: the sinks (positions 0..) then the tail (after the n_body body
    tokens); positions before `first` are padding."""
    m_i, l_i, acc = _dense_range(m_i, l_i, acc, q_dot, sk, sv, sk_sn, sv_sn, n_sink, 0, first, sc_row, g_ok,
                                 qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32, DT)
    return _dense_range(m_i, l_i, acc, q_dot, tk, tv, tk_sn, tv_sn, n_tail, n_sink + n_body,
                        first - n_sink - n_body, sc_row, g_ok, qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32, DT)


@triton.jit
def _body_extent(LENS, b, n_body, n_sel, HAS_LENS: tl.constexpr, HAS_PL: tl.constexpr, P: tl.constexpr):
    """(body tokens of row b, logical tokens the splits walk: the body, or the page list's pages)."""
    if HAS_LENS:
        len_b = tl.load(LENS + b).to(tl.int32)
    else:
        len_b = n_body
    if HAS_PL:
        n_logical = n_sel * P
    else:
        n_logical = len_b
    return len_b, n_logical


@triton.jit
def _exact_split(Q, q_sb, q_sh, SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
                 TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, n_body, SCORES, sc_sb, sc_sh,
                 M_OUT, L_OUT, ACC_OUT, b, h, row_first, NS, out_slot, qk_scale,
                 HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 DBN: tl.constexpr, WRITE_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr):
    """The split of the exact parts, as the fast kernels run it: the G query rows of kv head h of row b over
    the sinks then the tail; writes partial row out_slot of the NS per query head."""
    b64 = b.to(tl.int64)
    g = tl.arange(0, GP)
    g_ok = g < G
    q_rows = Q + b64 * q_sb + (h * G + g)[:, None] * q_sh
    sc_row = SCORES + b64 * sc_sb + (h * G + g)[:, None] * sc_sh
    out_row = (b * HKV * G + h * G + g) * NS + out_slot
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(q_rows + dk[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    q_dot = _cast(q, DOT_FP32, DT)
    m_e = tl.full([GP], NEG_BIG, tl.float32)
    l_e = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)
    m_e, l_e, acc = _sinks_then_tail(
        m_e, l_e, acc, q_dot, SK + b64 * sk_sb + h * sk_sh, SV + b64 * sv_sb + h * sv_sh, sk_sn, sv_sn, n_sink,
        TK + b64 * tk_sb + h * tk_sh, TV + b64 * tv_sb + h * tv_sh, tk_sn, tv_sn, n_tail, n_body, row_first,
        sc_row, g_ok, qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32, DT)
    tl.store(ACC_OUT + out_row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None])
    tl.store(M_OUT + out_row, m_e, mask=g_ok)
    tl.store(L_OUT + out_row, l_e, mask=g_ok)


# ---------------------------------------------------------------------------------------------------
# the split kernel
# ---------------------------------------------------------------------------------------------------
@triton.jit(do_not_specialize=LENGTH_ARGS)
def _decode_split_kernel(
    Q, q_sb, q_sh,
    KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc, KCB, kcb_sh, KOI, KOV, ko_sb, ko_sh, ko_sp,
    VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc, VCB, vcb_sh, VOI, VOV, vo_sb, vo_sh, vo_sp,
    SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
    TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, TLEN,
    LENS, STARTS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_body_splits,
    M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh,
    qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    P: tl.constexpr, BN: tl.constexpr, OPB: tl.constexpr, DBN: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_SCALE_AT: tl.constexpr, K_GROUP: tl.constexpr,
    K_HAS_ZERO: tl.constexpr, K_NOUT: tl.constexpr, K_KCP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_SCALE_AT: tl.constexpr, V_GROUP: tl.constexpr,
    V_HAS_ZERO: tl.constexpr, V_NOUT: tl.constexpr, V_KCP: tl.constexpr,
    HAS_BODY: tl.constexpr, HAS_LENS: tl.constexpr, HAS_TLEN: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_PL: tl.constexpr, WRITE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr, DT: tl.constexpr, HEAD_LENS: tl.constexpr = False,
):
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    n_splits = n_body_splits + 1
    b = pid_bh // HKV
    h = pid_bh % HKV
    b64 = b.to(tl.int64)
    if HAS_STARTS:  # left padding: held positions before row_first are not attended
        row_first = tl.load(STARTS + b).to(tl.int32)
    else:
        row_first = 0
    if HAS_TLEN:  # tail length on the device: the tail buffer of a captured decode step is longer
        n_tail = tl.load(TLEN).to(tl.int32)

    g = tl.arange(0, GP)
    g_ok = g < G
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q_rows = Q + b64 * q_sb + (h * G + g)[:, None] * q_sh
    q = tl.load(q_rows + dk[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)  # [GP, DK]
    q_dot = _cast(q, DOT_FP32, DT)
    sc_row = SCORES + b64 * sc_sb + (h * G + g)[:, None] * sc_sh  # [GP, 1]

    m_i = tl.full([GP], NEG_BIG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)

    if split == n_body_splits:
        # the exact parts: sinks, then tail
        m_i, l_i, acc = _sinks_then_tail(
            m_i, l_i, acc, q_dot, SK + b64 * sk_sb + h * sk_sh, SV + b64 * sv_sb + h * sv_sh, sk_sn, sv_sn, n_sink,
            TK + b64 * tk_sb + h * tk_sh, TV + b64 * tv_sb + h * tv_sh, tk_sn, tv_sn, n_tail, n_body, row_first,
            sc_row, g_ok, qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32, DT)
    elif HAS_BODY:
        # HEAD_LENS: a packed body of per-(row, kv head) counts (kvcompress.sparse.ragged), LENS [B * HKV, 2] holding
        # each head's first token in it and its count; the body's row and head strides are 0
        lens_at, lens_b = LENS, b
        if HEAD_LENS:
            lens_at, lens_b = LENS + 2 * pid_bh + 1, 0
            first = tl.load(LENS + 2 * pid_bh).to(tl.int64)
            KC += first * kc_sn
            VC += first * vc_sn
        kc = KC + b64 * kc_sb + h * kc_sh
        ks = KS + b64 * ks_sb + h * ks_sh
        kz = KZ + b64 * ks_sb + h * ks_sh
        kcb = KCB + h * kcb_sh
        vc = VC + b64 * vc_sb + h * vc_sh
        vs = VS + b64 * vs_sb + h * vs_sh
        vz = VZ + b64 * vs_sb + h * vs_sh
        vcb = VCB + h * vcb_sh
        koi = KOI + b64 * ko_sb + h * ko_sh
        kov = KOV + b64 * ko_sb + h * ko_sh
        voi = VOI + b64 * vo_sb + h * vo_sh
        vov = VOV + b64 * vo_sb + h * vo_sh
        pl = PL + b64 * pl_sb + h * pl_sh
        len_b, n_logical = _body_extent(lens_at, lens_b, n_body, n_sel, HAS_LENS, HAS_PL, P)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_logical)
        rows = tl.arange(0, BN)
        for l0 in range(start, end, BN):
            l = l0 + rows
            if HAS_PL:
                page_sel = l // P
                page = tl.load(pl + page_sel, mask=l < n_logical, other=-1)
                tok = page * P + l % P
                ok = (l < n_logical) & (page >= 0) & (tok < len_b) & (tok + n_sink >= row_first)
            else:
                tok = l
                page = l // P
                ok = (l < n_logical) & (tok + n_sink >= row_first)
            tok2 = tok[:, None]
            page2 = page[:, None]
            ok2 = ok[:, None]
            # -- scores
            k = _dequant_tile(kc, kc_sn, ks, kz, ks_sn, ks_sc, kcb, tok2, page2, ok2,
                              K_KIND, K_BITS, K_SCALE_AT, K_GROUP, K_HAS_ZERO, DK)
            s = _dot(q_dot, tl.trans(_cast(k, DOT_FP32, DT)), DOT_FP32)  # [GP, BN]
            if K_NOUT > 0:
                r, d_o, delta, o_ok = _outlier_deltas(
                    koi, kov, ko_sp, kc, kc_sn, ks, kz, ks_sn, ks_sc, kcb, pl, l0, n_logical, len_b,
                    HAS_PL, P, BN, OPB, K_KCP, K_NOUT, K_KIND, K_BITS, K_SCALE_AT, K_GROUP, K_HAS_ZERO, DK)
                q_at = tl.load(q_rows + d_o[None, :], mask=g_ok[:, None] & o_ok[None, :], other=0.0)
                qd = q_at.to(tl.float32) * delta[None, :]  # [GP, OK]
                hit = (r[:, None] == rows[None, :]) & o_ok[:, None]  # [OK, BN]
                s += _dot(_cast(qd, DOT_FP32, DT), _cast(hit.to(tl.float32), DOT_FP32, DT), DOT_FP32)
            s = s * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            if WRITE_SCORES:
                tl.store(sc_row + n_sink + tok[None, :], s, mask=g_ok[:, None] & ok[None, :])
            # -- online softmax
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v = _dequant_tile(vc, vc_sn, vs, vz, vs_sn, vs_sc, vcb, tok2, page2, ok2,
                              V_KIND, V_BITS, V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV)
            p_dot = _cast(p, DOT_FP32, DT)
            acc = acc * alpha[:, None] + _dot(p_dot, _cast(v, DOT_FP32, DT), DOT_FP32)
            if V_NOUT > 0:
                r, d_o, delta, o_ok = _outlier_deltas(
                    voi, vov, vo_sp, vc, vc_sn, vs, vz, vs_sn, vs_sc, vcb, pl, l0, n_logical, len_b,
                    HAS_PL, P, BN, OPB, V_KCP, V_NOUT, V_KIND, V_BITS, V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV)
                hit_t = (rows[:, None] == r[None, :]) & o_ok[None, :]  # [BN, OK]
                p_at = _dot(p_dot, _cast(hit_t.to(tl.float32), DOT_FP32, DT), DOT_FP32)  # [GP, OK]
                vd = tl.where(d_o[:, None] == dv[None, :], delta[:, None], 0.0)  # [OK, DV]
                acc += _dot(_cast(p_at, DOT_FP32, DT), _cast(vd, DOT_FP32, DT), DOT_FP32)
            m_i = m_new

    out_row = (b * HKV * G + h * G + g) * n_splits + split  # [GP]
    tl.store(M_OUT + out_row, m_i, mask=g_ok)
    tl.store(L_OUT + out_row, l_i, mask=g_ok)
    tl.store(ACC_OUT + out_row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _merge_splits(M_IN, L_IN, ACC_IN, OUT, LSE, row, n_read, n_splits, m0, l0, a0, DV: tl.constexpr,
                  SB: tl.constexpr):
    """Merge partial rows 0 .. n_read - 1 of query head `row` (at row * n_splits + s) with one more partial
    (m0, l0, a0 [DV]) held in registers; writes out [DV] and lse (base 2)."""
    dv = tl.arange(0, DV)
    s = tl.arange(0, SB)
    m_max = tl.full([SB], NEG_BIG, tl.float32)
    for s0 in range(0, n_read, SB):
        m_max = tl.maximum(m_max, tl.load(M_IN + row * n_splits + s0 + s, mask=s0 + s < n_read,
                                          other=NEG_BIG))
    big_m = tl.maximum(tl.max(m_max, 0), m0)
    w0 = tl.exp2(m0 - big_m)
    num = a0 * w0
    den = tl.zeros([SB], tl.float32)
    for s0 in range(0, n_read, SB):
        ok = s0 + s < n_read
        m = tl.load(M_IN + row * n_splits + s0 + s, mask=ok, other=NEG_BIG)
        w = tl.where(ok, tl.exp2(m - big_m), 0.0)
        den += w * tl.load(L_IN + row * n_splits + s0 + s, mask=ok, other=0.0)
        a = tl.load(ACC_IN + (row * n_splits + s0 + s)[:, None] * DV + dv[None, :], mask=ok[:, None], other=0.0)
        num += tl.sum(w[:, None] * a, 0)
    total = tl.sum(den, 0) + l0 * w0
    tl.store(OUT + row * DV + dv, (num / total).to(OUT.dtype.element_ty))
    tl.store(LSE + row, big_m + tl.log2(total))


@triton.jit(do_not_specialize=("n_splits",))
def _reduce_kernel(M_IN, L_IN, ACC_IN, OUT, LSE, n_splits, DV: tl.constexpr, SB: tl.constexpr):
    """Merge the splits of one (batch, query head): out = sum_s 2^(m_s - M) acc_s / sum_s 2^(m_s - M) l_s."""
    row = tl.program_id(0)
    none = tl.zeros([DV], tl.float32)  # no extra partial: weight 0 against any split, mass 0
    _merge_splits(M_IN, L_IN, ACC_IN, OUT, LSE, row, n_splits, n_splits, tl.sum(none, 0) + NEG_BIG,
                  tl.sum(none, 0), none, DV, SB)


# ---------------------------------------------------------------------------------------------------
# launcher
# ---------------------------------------------------------------------------------------------------
_DOT_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _rows_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return _cuda_sms(device.index if device.index is not None else torch.cuda.current_device())
    return 4  # the interpreter: few splits keep the tests fast


@functools.cache
def _cuda_sms(index: int) -> int:
    """Multiprocessors of CUDA device `index` (asked once: the query costs host time on every decode step)."""
    return torch.cuda.get_device_properties(index).multi_processor_count


# The newest Triton release whose compiler was seen to build the phase kernel's value levels read by inline
# PTX (V_LUT_ASM): 3.6 runs it on the lent GPUs (tests/test_gpu.py). Triton 3.9's LLVM aborts the process
# on it (an sm_90 compile without a GPU, 2026-12-07: "number of input constraints does not match number of
# parameters"), which no try/except can catch; the keys' lookup compiled. Newer releases read the value
# levels by warp shuffle instead until one is checked on a GPU.
VALUE_LEVELS_ASM_UP_TO = (3, 6)


def value_levels_by_asm(version: str | None = None) -> bool:
    """Whether this Triton (or `version`) gets the phase kernel's inline-PTX value level lookup."""
    parts = (version or triton.__version__).split("+")[0].split(".")
    try:
        major_minor = (int(parts[0]), int(parts[1]))
    except (IndexError, ValueError):
        return False
    return major_minor <= VALUE_LEVELS_ASM_UP_TO


def _lut_args(stream, wanted: bool, placeholder: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(level tables [H or 1, 16], head stride: 0 for one codebook shared by every head) of a stream whose
    4-bit levels the phase kernel reads by byte permutes; (placeholder, 0) when it does not."""
    if not wanted:
        return placeholder, 0
    tables = level_tables(stream.codec, placeholder.device)
    return tables, tables.stride(0) if tables.shape[0] > 1 else 0


def _stream_launch_args(a: StreamArgs) -> list:
    c = _rows_contiguous(a.codes)
    if a.kind in (KIND_INT, KIND_NUQ) and a.bits in (2, 4):
        if c.stride(2) % 4 or c.stride(1) % 4 or c.stride(0) % 4 or c.data_ptr() % 4:
            raise ValueError("packed codes must start on 4-byte boundaries per token for the word loads")
    sb, sh, sn, sc = a.scale_strides
    return [
        c, c.stride(0), c.stride(1), c.stride(2),
        a.scale, a.zero, sb, sh, sn, sc,
        a.codebook, a.codebook_head_stride,
        a.outlier_idx, a.outlier_val, a.outlier_idx.stride(0), a.outlier_idx.stride(1),
        a.outlier_idx.stride(2) if a.n_outliers else 0,
    ]


def _stream_constants(a: StreamArgs | None, prefix: str) -> dict:
    if a is None:
        return {f"{prefix}_KIND": KIND_DENSE, f"{prefix}_BITS": 8, f"{prefix}_SCALE_AT": 0, f"{prefix}_GROUP": 1,
                f"{prefix}_HAS_ZERO": False, f"{prefix}_NOUT": 0, f"{prefix}_KCP": 16}
    return {
        f"{prefix}_KIND": a.kind, f"{prefix}_BITS": a.bits, f"{prefix}_SCALE_AT": a.scale_at,
        f"{prefix}_GROUP": a.group, f"{prefix}_HAS_ZERO": a.has_zero, f"{prefix}_NOUT": a.n_outliers,
        f"{prefix}_KCP": max(16, _next_pow2(a.n_outliers)),
    }


def _rotate(x: torch.Tensor, signs: torch.Tensor | None) -> torch.Tensor:
    if signs is None:
        return x
    from kvcompress.quant.rotation import rotate_in

    return rotate_in(x, signs)


def decode_attention_triton(
    q: torch.Tensor,
    parts: AttentionParts,
    scaling: float,
    page_list: torch.Tensor | None = None,
    return_probs: bool = False,
    *,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    splits: int | None = None,
    lut: str | None = None,
    phase_kernel: bool = True,
    fp8_f16: bool = True,
    unpack: str | None = None,
    exact_apart: bool = True,
    fp8_phase: bool | None = None,
    merge: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Fused decode attention; same signature and result as `decode_attention_torch`.

    q [B, Hq, Dk]; parts: see AttentionParts; page_list [B, Hkv, n_sel] (Quest); returns
    (out [B, Hq, Dv] in q.dtype, probs [B, Hkv, S+N+T] fp32 or None). Tuning: block_n body tokens per
    step (None: 64 with outliers, else 128; the phase kernel: one page of 32; the fp8 kernel: 32),
    num_warps (None: 1 for the phase and fp8 kernels, else 4) / num_stages (None: 2 for the phase kernel,
    else 3) of the split kernel, splits
    per (batch, kv head) (None: split_count.default_splits: the fp8 and phase kernels without a page list one
    wave of 8 programs per multiprocessor at most, the others 16 per multiprocessor), lut: how the fast
    kernels read nuq codebooks ("select": a select tree, "gather": a load per element, "shuffle": a warp
    shuffle from levels held in registers, the phase kernel only; the paged kernel reads "shuffle" as
    "gather"; None: measured best on an H200, "shuffle" in the phase kernel, "select" in the paged one),
    phase_kernel: False keeps the caches that decode_phase_triton reads (KIVI int2 / int3 / int4, nuq4 /
    nuq3 / nuq2 keys per page) on decode_paged_triton (3-bit codes: the general kernel; to compare),
    fp8_f16: False keeps fp8 caches' dots in the model dtype (to compare; True: fp16 operands, see
    decode_fp8_triton), unpack: how the phase kernel turns int codes into bf16 / fp16 operands ("asm":
    inline PTX, several codes per instruction, the GPU only; "ops": Triton operations, one code at a time,
    the same values; None: "asm" where it runs),
    exact_apart: the fp8 kernel leaves the sinks and tail to the split merge (exact_reduce_triton), so the
    body's launch does not carry their registers and shared memory (False: all in the body's launch, to
    compare), fp8_phase: the fp8 body with tokens as M of both dots and the values read by phase
    (decode_fp8_phase_triton; None: where the value rows are 4-byte words, with fp16 operands and the exact
    parts apart; False: the query rows as M, to compare), merge: how the fp8 kernel's splits are merged
    with the exact parts ("kernel": a launch of its own; "pdl": the same launch as a programmatic dependent of
    the body, on Hopper and later; None: "pdl" where it runs, measured faster on an H200, BENCHMARKS.md;
    exact_reduce_triton).
    """
    if lut not in (None, "select", "gather", "shuffle"):
        raise ValueError(f"lut must be 'select', 'gather' or 'shuffle', got {lut!r}")
    if merge not in (None, "kernel", "pdl"):
        raise ValueError(f"merge must be 'kernel' or 'pdl', got {merge!r}")
    if unpack not in (None, "asm", "ops"):
        raise ValueError(f"unpack must be 'asm' or 'ops', got {unpack!r}")
    if unpack == "asm" and (not q.is_cuda or interpreting()):
        raise ValueError("unpack='asm' runs inline PTX, which needs a CUDA GPU (Triton's interpreter "
                         "cannot run it): pass unpack=None or 'ops'")
    b, hq, dk = q.shape
    hkv = parts.kv_heads
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of kv heads ({hkv})")
    group = hq // hkv
    dtype = parts.tail_k.dtype
    if dtype not in _DOT_DTYPES:
        raise ValueError(f"model dtype {dtype} is not supported by the fused kernel (bf16, fp16, fp32)")
    dv = parts.tail_v.shape[-1]
    for name, dim in (("key", dk), ("value", dv)):
        if dim < 16 or dim & (dim - 1):
            raise ValueError(f"the fused kernel needs a power-of-two {name} head dim >= 16, got {dim}")
    dev = q.device
    q = _rows_contiguous(q)
    sink_k, sink_v, tail_k, tail_v = parts.sink_k, parts.sink_v, parts.tail_k, parts.tail_v

    key_args = value_args = None
    n_body, page_size = parts.n_body, 16
    if parts.key is not None:
        key_args = stream_args(parts.key.codec, parts.key.data, parts.key.row)
        value_args = stream_args(parts.value.codec, parts.value.data, parts.value.row)
        page_size = parts.key.page_size
        # rotated streams (TurboQuant): attend in the rotated basis, the exact parts rotated to match
        if key_args.rotation_signs is not None:
            q = _rotate(q, key_args.rotation_signs).contiguous()
            sink_k, tail_k = _rotate(sink_k, key_args.rotation_signs), _rotate(tail_k, key_args.rotation_signs)
        if value_args.rotation_signs is not None:
            sink_v, tail_v = _rotate(sink_v, value_args.rotation_signs), _rotate(tail_v, value_args.rotation_signs)
    sink_k, sink_v, tail_k, tail_v = map(_rows_contiguous, (sink_k, sink_v, tail_k, tail_v))

    # the fast kernels when both streams fold (decode_fp8_triton for fp8, decode_phase_triton for 2-, 3- and
    # 4-bit keys per page with values per token, decode_paged_triton for other 2-8-bit codes), else the
    # general one
    from kvcompress.kernels import decode_paged_triton as fast
    from kvcompress.kernels import decode_phase_triton as phase

    kernel, extra, ppi, apart = _decode_split_kernel, {}, 1, False
    dot = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
    paged = key_args is not None and fast.paged_supported(key_args, dk, page_size, True) and fast.paged_supported(
        value_args, dv, page_size, False)
    by_phase = key_args is not None and phase_kernel and phase.phase_supported(key_args, value_args, dk, dv,
                                                                               page_size)
    by_fp8 = paged and not by_phase and fast.is_fp8(key_args) and fast.is_fp8(value_args)
    whole_pages = page_size & (page_size - 1) == 0  # tiles of whole pages (tl.arange needs powers of two)
    if paged and not (by_phase or by_fp8) and not whole_pages:
        paged = False  # the paged kernel's tiles are whole pages
    if fp8_phase and not by_fp8:
        raise ValueError("fp8_phase=True is for caches whose keys and values are both fp8 (the fp8 kernel): "
                         "pass fp8_phase=None")
    if by_phase:
        block_n = phase.phase_block(page_size, block_n)
    elif block_n is None:  # measured on an H200 (BENCHMARKS.md): fp8 32, else 64 with outliers, else 128
        has_out = paged and bool(key_args.n_outliers or value_args.n_outliers)
        block_n = 32 if by_fp8 else 128 if paged and not has_out else 64
        if not (paged or whole_pages):  # outliers need tiles inside pages or of whole pages
            block_n = min(block_n, page_size & -page_size)
    if by_phase:
        gq = _next_pow2(group)
        magic, shift = phase.phase_magic(key_args.kind, key_args.bits, dot)
        k_affine = key_args.affine_levels  # evenly spaced nuq key levels: decoded as integers, no lookup
        k_magic, k_shift = phase.phase_magic(KIND_INT, key_args.bits, dot) if k_affine else (magic, shift)
        k_lo, k_step = k_affine or (0.0, 1.0)
        asm = unpack != "ops" and dot != "fp32" and q.is_cuda and not interpreting() and key_args.bits != 3
        # 4-bit codebooks read by byte permutes (inline PTX) need their byte tables; else a placeholder
        lut_asm = asm and lut in (None, "shuffle")
        k_lut = lut_asm and key_args.kind == KIND_NUQ and key_args.bits == 4 and not k_affine
        v_lut = lut_asm and value_args.kind == KIND_NUQ and value_args.bits == 4 and value_levels_by_asm()
        k_lt, klt_sh = _lut_args(parts.key, k_lut, q)
        v_lt, vlt_sh = _lut_args(parts.value, v_lut, q)
        kernel, extra = phase._phase_split_kernel, dict(
            KIND=key_args.kind, BITS=key_args.bits, V_GROUP=value_args.group, V_HAS_ZERO=value_args.has_zero,
            K_NOUT=key_args.n_outliers, K_KCP=max(16, _next_pow2(key_args.n_outliers)),
            K_TOK=getattr(parts.key.codec, "outliers_per_token", 0) if key_args.n_outliers else 0,
            OPB=max(block_n // page_size, 1), LUT=phase.LUTS[lut or "shuffle"],
            PHK=phase.phases(key_args, dk), PHV=phase.phases(value_args, dv), WK=phase.words(key_args, dk),
            WV=phase.words(value_args, dv), K_WB=phase.word_bits(key_args, dk),
            V_WB=phase.word_bits(value_args, dv), MAGIC=magic, SHIFT=shift, GQ=gq,
            NGP=_next_pow2(max(dv // value_args.group, -(-8 // gq))),
            K_AFFINE=k_affine is not None, K_MAGIC=k_magic, K_SHIFT=k_shift, k_lo=k_lo, k_step=k_step,
            ASM=asm, K_LUT_ASM=k_lut, V_LUT_ASM=v_lut, LT_OFF=8 if dot == "fp16" else 0, KLT=k_lt,
            klt_sh=klt_sh, VLT=v_lt, vlt_sh=vlt_sh, V_BITS=value_args.bits,
            SUB=page_size // block_n if block_n < page_size else 1)
        num_warps = num_warps or 1  # measured on an H200 (BENCHMARKS.md): one warp per program
        # two stages: 8 programs per multiprocessor (255 registers each) where three stages' shared memory
        # left room for 6; int4 0.30 -> 0.21 ms at 32K x 8 (BENCHMARKS.md, 2026-12-02)
        # one stage where 4-bit levels are read by byte permutes: in a pipelined loop Triton sent every
        # lookup's result through shared memory (compiled PTX, unpack_asm_triton.table_tiles)
        num_stages = num_stages or (1 if k_lut or v_lut else 2)
    elif by_fp8:
        from kvcompress.kernels.decode_fp8_triton import _fp8_split_kernel
        from kvcompress.kernels.scale_words import WORDS_NONE, scale_words

        k_sw = v_sw = WORDS_NONE
        if page_list is None:  # per-token 16-bit scales read two to a word (scale_words.py)
            key_args, k_sw = scale_words(key_args)
            value_args, v_sw = scale_words(value_args)
        f16 = fp8_f16 and dtype != torch.float32
        apart = exact_apart
        # the body with tokens as M and values by phase (decode_fp8_phase_triton) where the value rows are
        # 4-byte words
        vc = value_args.codes
        by_words = all(x % 4 == 0 for x in (*vc.stride()[:3], vc.data_ptr(), dv))
        if fp8_phase and not (f16 and apart and by_words):
            raise ValueError("fp8_phase=True needs a 16-bit model dtype, fp8_f16=True, exact_apart=True and "
                             "value code rows of whole 4-byte words: pass fp8_phase=None to fall back")
        fp8_phase = f16 and apart and by_words and fp8_phase is not False
        kernel, extra = _fp8_split_kernel, dict(
            F16=f16, K_SW=k_sw, V_SW=v_sw, PHASE=fp8_phase, GQ=_next_pow2(group),
            ASM=fp8_phase and unpack != "ops" and q.is_cuda and not interpreting())
        # measured on an H200 (BENCHMARKS.md, 2026-12-02): blocks of 32 tokens (above), one warp, three stages
        num_warps, num_stages = num_warps or 1, num_stages or 3
    elif paged:
        block_n, ppi = fast.paged_block(key_args, value_args, page_size, block_n)
        k_magic, k_shift = fast.magic(key_args, dk, dot, True)
        v_magic, v_shift = fast.magic(value_args, dv, dot, False)
        kernel, extra = fast._paged_split_kernel, dict(
            PHK=fast.phases(key_args, dk), PHV=fast.phases(value_args, dv), WK=fast.words(key_args, dk),
            WV=fast.words(value_args, dv), K_WB=fast.word_bits(key_args, dk), V_WB=fast.word_bits(value_args, dv),
            K_MAGIC=k_magic, K_SHIFT=k_shift, V_MAGIC=v_magic, V_SHIFT=v_shift, PPI=ppi,
            QR=max(16, _next_pow2(ppi * group)), LUT_SELECT=lut in (None, "select"))

    # body geometry and splits
    has_outliers = key_args is not None and (key_args.n_outliers or value_args.n_outliers)
    if has_outliers and block_n % page_size and page_size % block_n:
        raise ValueError(f"block_n {block_n} and page size {page_size} must divide one another for outliers")
    opb = max(block_n // page_size, 1)
    if page_list is not None and key_args is not None:
        page_list = page_list.to(dev, torch.int32)
        n_sel = page_list.shape[2]
        n_logical = n_sel * page_size
        pl_args = [page_list, page_list.stride(0), page_list.stride(1), n_sel]
    else:
        n_logical = n_body
        pl_args = [q, 0, 0, 0]
    if splits is None:
        # one wave for the one-warp kernels (fp8, phase); Quest page lists keep the former rule, which they
        # were tuned and timed with. The interpreter (tests) keeps one block per split, so that small shapes
        # still split.
        one_wave = (by_fp8 or by_phase) and page_list is None
        splits = default_splits(b * hkv, _num_sms(dev), n_logical, one_wave,
                                MIN_SPLIT_TOKENS if q.is_cuda else block_n)
    # the phase kernel reads a page that is not a power of two (48) in tiles inside it, a page per step:
    # splits hold whole pages
    unit = block_n * extra.get("SUB", 1)
    n_blocks = -(-n_logical // unit)
    splits = max(1, min(splits, n_blocks))
    tokens_per_split = -(-n_blocks // splits) * unit
    body_splits = -(-n_logical // tokens_per_split) if n_logical else 0
    n_splits = body_splits * ppi + 1  # partial rows per query head (the fast kernel: one per page slot)

    lens = parts.body_lengths
    if parts.body_offsets is not None:  # a packed body of per-head counts: (first token, count) per (row, kv head)
        if kernel is not _decode_split_kernel or page_list is not None:
            raise ValueError("a body of per-kv-head counts (body_offsets) is read by the general kernel without a "
                             "page list only: give it full-precision (identity codec) streams")
        lens = torch.stack([parts.body_offsets, lens], -1).reshape(-1)
    lens = lens.to(dev, torch.int32) if lens is not None else q
    starts = parts.row_starts.to(dev, torch.int32) if parts.row_starts is not None else q
    tlen = parts.tail_lengths if parts.tail_lengths is not None else q

    m_part = torch.empty(b * hq * n_splits, device=dev, dtype=torch.float32)
    l_part = torch.empty_like(m_part)
    acc_part = torch.empty(b * hq * n_splits, dv, device=dev, dtype=torch.float32)
    n_pos = parts.n_positions
    if return_probs:
        scores = torch.full((b, hq, n_pos), float("-inf"), device=dev, dtype=torch.float32)
    else:
        scores = m_part
    dummy_stream = [q, 0, 0, 0, q, q, 0, 0, 0, 0, q, 0, q, q, 0, 0, 0]
    args = (
        q, q.stride(0), q.stride(1),
        *(_stream_launch_args(key_args) if key_args else dummy_stream),
        *(_stream_launch_args(value_args) if value_args else dummy_stream),
        sink_k, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
        sink_v, sink_v.stride(0), sink_v.stride(1), sink_v.stride(2), parts.n_sinks,
        tail_k, tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
        tail_v, tail_v.stride(0), tail_v.stride(1), tail_v.stride(2), parts.n_tail, tlen,
        lens, starts, n_body, *pl_args, tokens_per_split, body_splits,
        m_part, l_part, acc_part, scores, scores.stride(0) if return_probs else 0,
        scores.stride(1) if return_probs else 0,
        scaling * LOG2E,
    )
    consts = dict(
        HKV=hkv, G=group, GP=max(16, _next_pow2(group)), DK=dk, DV=dv, P=page_size, BN=block_n, DBN=32,
        HAS_LENS=parts.body_lengths is not None, HAS_TLEN=parts.tail_lengths is not None, HAS_STARTS=parts.row_starts is not None,
        HAS_PL=page_list is not None and key_args is not None, WRITE_SCORES=return_probs,
        DOT_FP32=dtype == torch.float32, DT=_DOT_DTYPES[dtype],
        num_warps=num_warps or 4, num_stages=num_stages or 3, **extra,
        **({} if by_phase else dict(OPB=opb, HAS_BODY=key_args is not None, **_stream_constants(key_args, "K"),
                                **_stream_constants(value_args, "V"))),
    )
    if parts.body_offsets is not None:
        consts["HEAD_LENS"] = True
    out = torch.empty(b, hq, dv, device=dev, dtype=q.dtype)
    lse = torch.empty(b, hq, device=dev, dtype=torch.float32)
    # programmatic dependent launch needs Hopper or later (Triton's interpreter has none)
    pdl_runs = q.is_cuda and not interpreting() and torch.cuda.get_device_capability(dev)[0] >= 9
    if merge is None or (merge == "pdl" and not pdl_runs):
        merge = "pdl" if pdl_runs else "kernel"
    if apart:  # the body alone, then the exact parts in the merge (exact_reduce_triton)
        from kvcompress.kernels.exact_reduce_triton import _exact_reduce_kernel

        # PDL: the body signals as it starts and the merge alone is launched as its dependent; the body is
        # launched as usual, so it never runs ahead of the kernels before it (which write q and the cache)
        pdl = merge == "pdl"
        if body_splits:
            kernel[(b * hkv, body_splits)](*args, **consts, BODY_ONLY=True, PDL=pdl)
        _exact_reduce_kernel[(b * hq,)](
            q, q.stride(0), q.stride(1),
            sink_k, sink_k.stride(0), sink_k.stride(1), sink_k.stride(2),
            sink_v, sink_v.stride(0), sink_v.stride(1), sink_v.stride(2), parts.n_sinks,
            tail_k, tail_k.stride(0), tail_k.stride(1), tail_k.stride(2),
            tail_v, tail_v.stride(0), tail_v.stride(1), tail_v.stride(2), parts.n_tail, tlen, starts, n_body,
            scores, scores.stride(0) if return_probs else 0, scores.stride(1) if return_probs else 0,
            m_part, l_part, acc_part, body_splits, n_splits, out, lse, scaling * LOG2E,
            HKV=hkv, G=group, DK=dk, DV=dv, DBN=32, SB=merge_block(n_splits),
            HAS_TLEN=parts.tail_lengths is not None, HAS_STARTS=parts.row_starts is not None,
            WRITE_SCORES=return_probs,
            DOT_FP32=dtype == torch.float32, DT=_DOT_DTYPES[dtype], PDL=pdl, launch_pdl=pdl,
        )
    else:
        kernel[(b * hkv, body_splits + 1)](*args, **consts)
        _reduce_kernel[(b * hq,)](m_part, l_part, acc_part, out, lse, n_splits, DV=dv,
                                  SB=merge_block(n_splits))
    if value_args is not None and value_args.rotation_signs is not None:
        from kvcompress.quant.rotation import unrotate_in

        out = unrotate_in(out, value_args.rotation_signs)
    if not return_probs:
        return out, None
    probs = torch.exp2(scores - lse[..., None]).view(b, hkv, group, n_pos).sum(2)
    return out, probs

