"""The fp8 body kernel's program with its dots turned: tokens as M of both dots, the values read by phase.

Same inputs and partial rows as `_fp8_split_kernel`'s body (decode_fp8_triton.py), whose torch twin is
`decode_attention_torch`; it runs there when `F16` (fp16 operands) and `PHASE` are set. Why: with the
query rows as M, the G query heads of a kv head fill G of the dots' 16 rows, and the value tile is the
second operand with tokens along K, which Triton reads from shared memory a byte at a time (compiled
SASS for sm_90: 128 byte loads, 64 merges and 192 conversions per thread and tile, a third of the loop).
Here, as in the 2-4-bit phase kernel (decode_phase_triton.py):
- scores^T [BN, GQ] = codes [BN, DK] . q^T [DK, GQ]: the key bytes are the first operand (channels along
  K are adjacent bytes, read by matrix loads), the query columns the second;
- values by phase: the codes are read as 32-bit words, 4 channels each; phase I is byte I of every word
  (channels 4w + I) and out_I^T [DV / 4, GQ] += bytes_I^T [DV / 4, BN] . p^T [BN, GQ]. On the GPU one
  `prmt` puts bytes I and I + 1 of two tokens' words side by side and two `cvt` turn them into fp16
  pairs as the dot reads them (`fp8_byte_pairs`); in Triton's interpreter the same values by shifts.
- per-token value scales enter the probabilities in fp16 relative to the tile's largest scale, so small
  scales keep fp16's precision: the split's sum is kept in units of the last tile's scale, and the
  online-softmax rescale of each tile carries the change of unit (one multiply, as before).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.decode_attention_triton import NEG_BIG, _body_extent

# $0, $1: phases I and I + 1 of two tokens (two fp16 each); $2, $3: their words; $4, $5: the prmt
# selector (byte I of each word, then byte I + 1 of each)
_ASM_E4M3: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t;\n.reg .b16 l, h;\nprmt.b32 t, $2, $3, $4;\nmov.b32 {l, h}, t;\n"
    "cvt.rn.f16x2.e4m3x2 $0, l;\ncvt.rn.f16x2.e4m3x2 $1, h;\n}")
_ASM_E5M2: tl.constexpr = tl.constexpr(
    "{\n.reg .b32 t;\n.reg .b16 l, h;\nprmt.b32 t, $2, $3, $4;\nmov.b32 {l, h}, t;\n"
    "cvt.rn.f16x2.e5m2x2 $0, l;\ncvt.rn.f16x2.e5m2x2 $1, h;\n}")


@triton.jit
def _fp8_f16(c, KIND: tl.constexpr):
    """fp8 bytes (uint8) as fp16, exactly."""
    if KIND == 1:
        x = c.to(tl.float8e4nv, bitcast=True).to(tl.float16)
    else:
        x = c.to(tl.float8e5, bitcast=True).to(tl.float16)
    return x


@triton.jit
def fp8_byte_pairs(w, I: tl.constexpr, KIND: tl.constexpr, ASM: tl.constexpr):
    """Bytes I and I + 1 of every word of w (int32 tile, any shape) as two fp16 tiles of w's shape, exactly
    (KIND 1: e4m3, 2: e5m2). ASM: inline PTX, four bytes in three instructions (the GPU only)."""
    if ASM:
        sel = tl.full(w.shape, I | ((4 + I) << 4) | ((I + 1) << 8) | ((5 + I) << 12), tl.int32)
        if KIND == 1:
            lo, hi = tl.inline_asm_elementwise(_ASM_E4M3, "=r,=r,r,r,r,r", [w, sel],
                                               dtype=(tl.int16, tl.int16), is_pure=True, pack=2)
        else:
            lo, hi = tl.inline_asm_elementwise(_ASM_E5M2, "=r,=r,r,r,r,r", [w, sel],
                                               dtype=(tl.int16, tl.int16), is_pure=True, pack=2)
        out = (lo.to(tl.float16, bitcast=True), hi.to(tl.float16, bitcast=True))
    else:
        out = (_fp8_f16(((w >> (8 * I)) & 0xFF).to(tl.uint8), KIND),
               _fp8_f16(((w >> (8 * I + 8)) & 0xFF).to(tl.uint8), KIND))
    return out


@triton.jit
def _scales_at(S, tok, ok, l0, n_logical, sn, BN: tl.constexpr, SW: tl.constexpr):
    """[BN] float32 per-token scales, 0 where not ok (SW: fp16 pairs read as int32 words, scale_words.py)."""
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
def _phase_block(m_i, l_i, unit, a0, a1, a2, a3, l0, rows, q_t, qz, kc, kc_sn, ks, ks_sn, vw, vw_sn, vs, vs_sn,
                 dk, wv, pl, n_logical, len_b, n_sink, row_first, sc_cols, gq_ok, qk_scale,
                 HAS_PL: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, K_KIND: tl.constexpr,
                 K_SCALE_AT: tl.constexpr, K_SW: tl.constexpr, V_KIND: tl.constexpr, V_SCALE_AT: tl.constexpr,
                 V_SW: tl.constexpr, WRITE_SCORES: tl.constexpr, MASK_CODES: tl.constexpr, ASM: tl.constexpr):
    """One block of BN body tokens from logical token l0: the online-softmax update of the four phase sums
    a0..a3 [DV / 4, GQ], kept in units of `unit` (the last block's largest value scale; 1 without
    per-token value scales)."""
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
        w = tl.load(vw + tok[None, :] * vw_sn + wv[:, None], mask=ok[None, :], other=0)
    else:
        kb = tl.load(kc + tok[:, None] * kc_sn + dk[None, :])
        w = tl.load(vw + tok[None, :] * vw_sn + wv[:, None])
    sT = tl.dot(_fp8_f16(kb, K_KIND), q_t)  # [BN, GQ]
    if K_SCALE_AT == 1:
        sT = sT * _scales_at(ks, tok, ok, l0, n_logical, ks_sn, BN, K_SW)[:, None]
    elif K_SCALE_AT == 3:
        sT = sT + qz[None, :]
    else:
        sT = sT * tl.load(ks).to(tl.float32)
    sT = tl.where(ok[:, None], sT * qk_scale, float("-inf"))
    if WRITE_SCORES:
        tl.store(sc_cols + n_sink + tok[:, None], sT, mask=ok[:, None] & gq_ok[None, :])
    m_new = tl.maximum(m_i, tl.max(sT, 0))
    alpha = tl.exp2(m_i - m_new)
    pT = tl.exp2(sT - m_new[None, :])
    l_i = l_i * alpha + tl.sum(pT, 0)
    if V_SCALE_AT == 1:  # p times the token's scale over the block's largest: <= 1 in fp16
        v_s = _scales_at(vs, tok, ok, l0, n_logical, vs_sn, BN, V_SW)
        big = tl.max(v_s, 0)
        new_unit = tl.where(big > 0, big, unit)  # a block with no valid token keeps the unit
        pd = (pT * (v_s / new_unit)[:, None]).to(tl.float16)
        alpha = alpha * (unit / new_unit)
    else:
        new_unit = unit
        pd = pT.to(tl.float16)
    v0, v1 = fp8_byte_pairs(w, 0, V_KIND, ASM)
    v2, v3 = fp8_byte_pairs(w, 2, V_KIND, ASM)
    a0 = tl.dot(v0, pd, a0 * alpha[None, :])
    a1 = tl.dot(v1, pd, a1 * alpha[None, :])
    a2 = tl.dot(v2, pd, a2 * alpha[None, :])
    a3 = tl.dot(v3, pd, a3 * alpha[None, :])
    return m_new, l_i, new_unit, a0, a1, a2, a3


@triton.jit
def _phase_store(acc, I: tl.constexpr, unit, l_i, out_cols, wv, gq_ok, vs, vz, vs_sc, ACC_OUT,
                 DV: tl.constexpr, V_SCALE_AT: tl.constexpr, V_HAS_ZERO: tl.constexpr):
    """Phase I's sums [DV / 4, GQ] (channels 4w + I) written as the split's partial rows, with the value
    scales that apply after the dot."""
    ch = wv * 4 + I
    acc = acc * unit
    if V_SCALE_AT == 4:
        acc = acc * tl.load(vs).to(tl.float32)
    if V_SCALE_AT == 3:
        acc = acc * tl.load(vs + ch * vs_sc).to(tl.float32)[:, None]
        if V_HAS_ZERO:
            acc += l_i[None, :] * tl.load(vz + ch * vs_sc).to(tl.float32)[:, None]
    tl.store(ACC_OUT + out_cols[None, :] * DV + ch[:, None], acc, mask=gq_ok[None, :])


@triton.jit
def fp8_phase_body(Q, q_sb, q_sh, KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc,
                   VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc,
                   LENS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_sink, row_first,
                   M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh, qk_scale, b, h, split, n_splits,
                   HKV: tl.constexpr, G: tl.constexpr, GQ: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                   P: tl.constexpr, BN: tl.constexpr, K_KIND: tl.constexpr, K_SCALE_AT: tl.constexpr,
                   K_HAS_ZERO: tl.constexpr, K_SW: tl.constexpr, V_KIND: tl.constexpr, V_SCALE_AT: tl.constexpr,
                   V_HAS_ZERO: tl.constexpr, V_SW: tl.constexpr, HAS_LENS: tl.constexpr, HAS_PL: tl.constexpr,
                   WRITE_SCORES: tl.constexpr, ASM: tl.constexpr):
    """One body split of kv head h of row b: partial rows (m, l, acc) of its G query heads. Codes: KC
    [.., N, DK] bytes, VC the same with rows of DV bytes at 4-byte boundaries (read as int32 words)."""
    b64 = b.to(tl.int64)
    gq = tl.arange(0, GQ)
    gq_ok = gq < G
    dk = tl.arange(0, DK)
    WV: tl.constexpr = DV // 4
    wv = tl.arange(0, WV)
    q_t = tl.load(Q + b64 * q_sb + (h * G + gq)[None, :] * q_sh + dk[:, None], mask=gq_ok[None, :],
                  other=0.0).to(tl.float32)  # [DK, GQ]
    ks = KS + b64 * ks_sb + h * ks_sh
    vs = VS + b64 * vs_sb + h * vs_sh
    qz = tl.zeros([GQ], tl.float32)
    if K_SCALE_AT == 3:  # per channel: the scales folded into the query, the shift into one number per head
        q_s = q_t * tl.load(ks + dk * ks_sc).to(tl.float32)[:, None]
        if K_HAS_ZERO:
            qz = tl.sum(q_t * tl.load(KZ + b64 * ks_sb + h * ks_sh + dk * ks_sc).to(tl.float32)[:, None], 0)
        q_t = q_s
    q_t = tl.minimum(tl.maximum(q_t, -65504.0), 65504.0).to(tl.float16)
    kc = KC + b64 * kc_sb + h * kc_sh
    vw = (VC + b64 * vc_sb + h * vc_sh).to(tl.pointer_type(tl.int32))
    pl = PL + b64 * pl_sb + h * pl_sh
    sc_cols = SCORES + b64 * sc_sb + (h * G + gq)[None, :] * sc_sh
    len_b, n_logical = _body_extent(LENS, b, n_body, n_sel, HAS_LENS, HAS_PL, P)
    m_i = tl.full([GQ], NEG_BIG, tl.float32)
    l_i = tl.zeros([GQ], tl.float32)
    unit = 1.0
    a0 = tl.zeros([WV, GQ], tl.float32)
    a1 = tl.zeros([WV, GQ], tl.float32)
    a2 = tl.zeros([WV, GQ], tl.float32)
    a3 = tl.zeros([WV, GQ], tl.float32)
    rows = tl.arange(0, BN)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, n_logical)
    full = end if HAS_PL else start + tl.maximum(end - start, 0) // BN * BN
    for l0 in range(start, full, BN):
        m_i, l_i, unit, a0, a1, a2, a3 = _phase_block(
            m_i, l_i, unit, a0, a1, a2, a3, l0, rows, q_t, qz, kc, kc_sn, ks, ks_sn, vw, vc_sn // 4, vs, vs_sn,
            dk, wv, pl, n_logical, len_b, n_sink, row_first, sc_cols, gq_ok, qk_scale, HAS_PL, P, BN, K_KIND,
            K_SCALE_AT, K_SW, V_KIND, V_SCALE_AT, V_SW, WRITE_SCORES, HAS_PL, ASM)
    if full < end:  # the split's last, partly filled block
        m_i, l_i, unit, a0, a1, a2, a3 = _phase_block(
            m_i, l_i, unit, a0, a1, a2, a3, full, rows, q_t, qz, kc, kc_sn, ks, ks_sn, vw, vc_sn // 4, vs, vs_sn,
            dk, wv, pl, n_logical, len_b, n_sink, row_first, sc_cols, gq_ok, qk_scale, HAS_PL, P, BN, K_KIND,
            K_SCALE_AT, K_SW, V_KIND, V_SCALE_AT, V_SW, WRITE_SCORES, True, ASM)
    out_cols = (b * HKV * G + h * G + gq) * n_splits + split
    vz = VZ + b64 * vs_sb + h * vs_sh
    _phase_store(a0, 0, unit, l_i, out_cols, wv, gq_ok, vs, vz, vs_sc, ACC_OUT, DV, V_SCALE_AT, V_HAS_ZERO)
    _phase_store(a1, 1, unit, l_i, out_cols, wv, gq_ok, vs, vz, vs_sc, ACC_OUT, DV, V_SCALE_AT, V_HAS_ZERO)
    _phase_store(a2, 2, unit, l_i, out_cols, wv, gq_ok, vs, vz, vs_sc, ACC_OUT, DV, V_SCALE_AT, V_HAS_ZERO)
    _phase_store(a3, 3, unit, l_i, out_cols, wv, gq_ok, vs, vz, vs_sc, ACC_OUT, DV, V_SCALE_AT, V_HAS_ZERO)
    tl.store(M_OUT + out_cols, m_i, mask=gq_ok)
    tl.store(L_OUT + out_cols, l_i, mask=gq_ok)
