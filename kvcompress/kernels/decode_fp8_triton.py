"""The fused decode attention's body path for fp8 caches (both streams fp8; scales per token, per head, or
per channel with a per-channel shift).

Same launch arguments and result as `_paged_split_kernel` (decode_paged_triton.py) with one body row per
query head (PPI = 1), whose torch twin is `decode_attention_torch`. fp8 bytes are cheap to decode, so
the dots keep the query rows as M (one dot [GP, D] x [D, BN] for the scores, one [GP, BN] x [BN, D] for
the output) and the per-token scales fold into the scores and the probabilities. Per-channel key scales
fold into the query once, and a key shift adds q.shift to every score; per-channel value scales and a
value shift apply once to the split's sum, acc * scale + l * shift. Measured on an H200
(BENCHMARKS.md): this orientation reads an fp8 cache at 1.4-1.9x bf16 SDPA, where the transposed one
of the 2-8-bit kernel reaches 0.9x. What made the difference from 1.1-1.4x (2026-12-02): per-token fp16
scales read two to a word, full blocks with unmasked code loads, and the sinks and tail left to the split
merge (exact_reduce_triton), so the body kernel holds 174 instead of 255 registers at one warp.
"""

from __future__ import annotations

import triton
import triton.language as tl

from triton.language.extra.cuda import gdc_launch_dependents

from kvcompress.kernels.decode_fp8_phase_triton import _fp8_f16, fp8_phase_body
from kvcompress.kernels.decode_attention_triton import (
    LENGTH_ARGS,
    NEG_BIG,
    _body_extent,
    _cast,
    _dot,
    _sinks_then_tail,
    _value_of,
)


@triton.jit
def _token_scales(S, tok, ok, l0, n_logical, sn, BN: tl.constexpr, SW: tl.constexpr):
    """[BN] float32 per-token scales, 0 where not ok. SW 0: one load per token at S + tok * sn; SW 1
    (scale_words.py): fp16 pairs read as int32 words, S in words and tok = l0 + arange(BN) with l0 even (no
    page list)."""
    if SW == 0:
        s = tl.load(S + tok * sn, mask=ok, other=0.0).to(tl.float32)
    else:
        i = tl.arange(0, BN // 2)
        w = tl.load(S + l0 // 2 + i, mask=l0 + 2 * i < n_logical, other=0)
        lo = w.to(tl.int16).to(tl.float16, bitcast=True)
        hi = (w >> 16).to(tl.int16).to(tl.float16, bitcast=True)
        s = tl.where(ok, tl.reshape(tl.join(lo, hi), [BN]).to(tl.float32), 0.0)
    return s


@triton.jit
def _fp8_block(m_i, l_i, acc, l0, rows, q_b, qz, kc, kc_sn, ks, ks_sn, KS, vc, vc_sn, vs, vs_sn, VS, dk, dv,
               pl, n_logical, len_b, n_sink, row_first, sc_row, g_ok, qk_scale,
               HAS_PL: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, F16: tl.constexpr,
               K_KIND: tl.constexpr, K_SCALE_AT: tl.constexpr, K_SW: tl.constexpr,
               V_KIND: tl.constexpr, V_SCALE_AT: tl.constexpr, V_SW: tl.constexpr, V_LATE: tl.constexpr,
               V_F16: tl.constexpr, WRITE_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr,
               MASK_CODES: tl.constexpr):
    """One block of BN body tokens from logical token l0: the online-softmax update. MASK_CODES False: every
    token of the block is stored (a full block without a page list), so the code loads go unmasked, which
    the compiler keeps in fewer registers (255 -> 174 at one warp; BENCHMARKS.md, 2026-12-02); tokens
    outside `ok` (left padding) still get no weight."""
    l = l0 + rows
    if HAS_PL:
        page = tl.load(pl + l // P, mask=l < n_logical, other=-1)
        tok = page * P + l % P
        ok = (l < n_logical) & (page >= 0) & (tok < len_b) & (tok + n_sink >= row_first)
    else:
        tok = l
        ok = (l < n_logical) & (tok + n_sink >= row_first)
    if MASK_CODES:
        kb = tl.load(kc + tok[:, None] * kc_sn + dk[None, :], mask=ok[:, None], other=0)
    else:
        kb = tl.load(kc + tok[:, None] * kc_sn + dk[None, :])
    if F16:
        s = tl.dot(q_b, tl.trans(_fp8_f16(kb, K_KIND)))  # [GP, BN]
    else:
        s = _dot(q_b, tl.trans(_cast(_value_of(kb, KS, K_KIND), DOT_FP32, DT)), DOT_FP32)
    if K_SCALE_AT == 1:
        s = s * _token_scales(ks, tok, ok, l0, n_logical, ks_sn, BN, K_SW)[None, :]
    elif K_SCALE_AT == 3:
        s = s + qz[:, None]
    else:
        s = s * tl.load(ks).to(tl.float32)
    s = tl.where(ok[None, :], s * qk_scale, float("-inf"))
    if WRITE_SCORES:
        tl.store(sc_row + n_sink + tok[None, :], s, mask=g_ok[:, None] & ok[None, :])
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if V_SCALE_AT == 1:
        pv = p * _token_scales(vs, tok, ok, l0, n_logical, vs_sn, BN, V_SW)[None, :]
    elif V_LATE:  # applied to the split's sum below
        pv = p
    else:
        pv = p * tl.load(vs).to(tl.float32)
    if MASK_CODES:
        vb = tl.load(vc + tok[:, None] * vc_sn + dv[None, :], mask=ok[:, None], other=0)
    else:
        vb = tl.load(vc + tok[:, None] * vc_sn + dv[None, :])
    if V_F16:
        acc = acc * alpha[:, None] + tl.dot(pv.to(tl.float16), _fp8_f16(vb, V_KIND))
    else:
        acc = acc * alpha[:, None] + _dot(_cast(pv, DOT_FP32, DT),
                                          _cast(_value_of(vb, VS, V_KIND), DOT_FP32, DT), DOT_FP32)
    m_i = m_new
    return m_i, l_i, acc


@triton.jit(do_not_specialize=LENGTH_ARGS)
def _fp8_split_kernel(
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
    HAS_BODY: tl.constexpr, HAS_LENS: tl.constexpr, HAS_TLEN: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_PL: tl.constexpr,
    WRITE_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr, F16: tl.constexpr = False,
    K_SW: tl.constexpr = 0, V_SW: tl.constexpr = 0, BODY_ONLY: tl.constexpr = False,
    PHASE: tl.constexpr = False, GQ: tl.constexpr = 1, ASM: tl.constexpr = False,
    PDL: tl.constexpr = False,
):
    """Grid (B * Hkv, body splits + 1); partial row of split s at s, the exact parts at n_body_splits.
    Scales: SCALE_AT 1 (per token, folded into the scores / probabilities), 4 (per head) or 3 (per row and
    channel, with a shift when HAS_ZERO). F16: the body's dots take fp16 operands, so fp8 codes convert
    to them in one hardware step (bf16 would go through float32); the queries enter clamped to fp16's
    range, the value scales apply after the dot unless they are per token. K_SW / V_SW: per-token scales
    read as words (_token_scales). BODY_ONLY: grid (B * Hkv, body splits), the exact parts left to
    exact_reduce_triton (so this kernel does not hold their registers and shared memory). PHASE (with F16
    and BODY_ONLY): the body by decode_fp8_phase_triton, tokens as M of both dots and the values read by
    phase (GQ: G rounded up to a power of two; ASM: its fp8 bytes converted by inline PTX, the GPU only).
    PDL: let the merge launch (a programmatic dependent, exact_reduce_triton) start now."""
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
    if PDL:
        gdc_launch_dependents()
    if PHASE:
        tl.static_assert(BODY_ONLY and F16)
        fp8_phase_body(Q, q_sb, q_sh, KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc,
                       VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc,
                       LENS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_sink, row_first,
                       M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh, qk_scale, b, h, split, n_splits,
                       HKV, G, GQ, DK, DV, P, BN, K_KIND, K_SCALE_AT, K_HAS_ZERO, K_SW, V_KIND, V_SCALE_AT,
                       V_HAS_ZERO, V_SW, HAS_LENS, HAS_PL, WRITE_SCORES, ASM)
    else:
        _fp8_program(Q, q_sb, q_sh, KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc,
                     VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc,
                     SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
                     TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail,
                     LENS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_body_splits,
                     M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh, qk_scale, b, h, b64, split, n_splits, row_first,
                     HKV, G, GP, DK, DV, P, BN, DBN, K_KIND, K_SCALE_AT, K_HAS_ZERO, V_KIND, V_SCALE_AT,
                     V_HAS_ZERO, HAS_LENS, HAS_PL, WRITE_SCORES, DOT_FP32, DT, F16, K_SW, V_SW, BODY_ONLY)


@triton.jit
def _fp8_program(Q, q_sb, q_sh, KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc,
                 VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc,
                 SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
                 TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail,
                 LENS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_body_splits,
                 M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh, qk_scale, b, h, b64, split, n_splits, row_first,
                 HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                 P: tl.constexpr, BN: tl.constexpr, DBN: tl.constexpr, K_KIND: tl.constexpr,
                 K_SCALE_AT: tl.constexpr, K_HAS_ZERO: tl.constexpr, V_KIND: tl.constexpr,
                 V_SCALE_AT: tl.constexpr, V_HAS_ZERO: tl.constexpr, HAS_LENS: tl.constexpr,
                 HAS_PL: tl.constexpr, WRITE_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr,
                 F16: tl.constexpr, K_SW: tl.constexpr, V_SW: tl.constexpr, BODY_ONLY: tl.constexpr):
    """The program with the query rows as M of both dots: the exact parts' split, or one body split."""
    g = tl.arange(0, GP)
    g_ok = g < G
    q_rows = Q + b64 * q_sb + (h * G + g)[:, None] * q_sh
    sc_row = SCORES + b64 * sc_sb + (h * G + g)[:, None] * sc_sh
    out_row = (b * HKV * G + h * G + g) * n_splits + split
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    q = tl.load(q_rows + dk[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
    q_dot = _cast(q, DOT_FP32, DT)
    m_i = tl.full([GP], NEG_BIG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, DV], tl.float32)
    if not BODY_ONLY and split == n_body_splits:  # the exact parts: sinks, then tail
        m_i, l_i, acc = _sinks_then_tail(
            m_i, l_i, acc, q_dot, SK + b64 * sk_sb + h * sk_sh, SV + b64 * sv_sb + h * sv_sh, sk_sn, sv_sn, n_sink,
            TK + b64 * tk_sb + h * tk_sh, TV + b64 * tv_sb + h * tv_sh, tk_sn, tv_sn, n_tail, n_body, row_first,
            sc_row, g_ok, qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32, DT)
    else:
        kc = KC + b64 * kc_sb + h * kc_sh
        ks = KS + b64 * ks_sb + h * ks_sh
        vc = VC + b64 * vc_sb + h * vc_sh
        vs = VS + b64 * vs_sb + h * vs_sh
        pl = PL + b64 * pl_sb + h * pl_sh
        len_b, n_logical = _body_extent(LENS, b, n_body, n_sel, HAS_LENS, HAS_PL, P)
        qz = tl.zeros([GP], tl.float32)
        q_s = q
        if K_SCALE_AT == 3:  # per channel: fold the scales into the query, the shift into one number per row
            q_s = q * tl.load(ks + dk * ks_sc).to(tl.float32)[None, :]
            if K_HAS_ZERO:
                qz = tl.sum(q * tl.load(KZ + b64 * ks_sb + h * ks_sh + dk * ks_sc).to(tl.float32)[None, :], 1)
        if F16:
            q_b = tl.minimum(tl.maximum(q_s, -65504.0), 65504.0).to(tl.float16)
        else:
            q_b = _cast(q_s, DOT_FP32, DT)
        V_LATE: tl.constexpr = V_SCALE_AT == 3 or (F16 and V_SCALE_AT == 4)  # value scales after the dot
        V_F16: tl.constexpr = F16 and V_SCALE_AT != 1
        rows = tl.arange(0, BN)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_logical)
        # full blocks first, with unmasked code loads (not through a page list, whose holes read nothing)
        full = end if HAS_PL else start + tl.maximum(end - start, 0) // BN * BN
        for l0 in range(start, full, BN):
            m_i, l_i, acc = _fp8_block(
                m_i, l_i, acc, l0, rows, q_b, qz, kc, kc_sn, ks, ks_sn, KS, vc, vc_sn, vs, vs_sn, VS, dk, dv,
                pl, n_logical, len_b, n_sink, row_first, sc_row, g_ok, qk_scale, HAS_PL, P, BN, F16, K_KIND,
                K_SCALE_AT, K_SW, V_KIND, V_SCALE_AT, V_SW, V_LATE, V_F16, WRITE_SCORES, DOT_FP32, DT, HAS_PL)
        if full < end:  # the split's last, partly filled block
            m_i, l_i, acc = _fp8_block(
                m_i, l_i, acc, full, rows, q_b, qz, kc, kc_sn, ks, ks_sn, KS, vc, vc_sn, vs, vs_sn, VS, dk,
                dv, pl, n_logical, len_b, n_sink, row_first, sc_row, g_ok, qk_scale, HAS_PL, P, BN, F16,
                K_KIND, K_SCALE_AT, K_SW, V_KIND, V_SCALE_AT, V_SW, V_LATE, V_F16, WRITE_SCORES, DOT_FP32, DT,
                True)
        if V_SCALE_AT == 4 and V_LATE:
            acc = acc * tl.load(vs).to(tl.float32)
        if V_SCALE_AT == 3:
            acc = acc * tl.load(vs + dv * vs_sc).to(tl.float32)[None, :]
            if V_HAS_ZERO:
                acc += l_i[:, None] * tl.load(VZ + b64 * vs_sb + h * vs_sh + dv * vs_sc).to(tl.float32)[None, :]
    tl.store(ACC_OUT + out_row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None])
    tl.store(M_OUT + out_row, m_i, mask=g_ok)
    tl.store(L_OUT + out_row, l_i, mask=g_ok)
