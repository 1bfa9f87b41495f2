"""The fast body path of the fused decode attention: scales folded out of the inner loop, codes never
re-interleaved. Same launch arguments and result as `_decode_split_kernel` (decode_attention_triton.py),
whose torch twin is `decode_attention_torch`; the launcher picks this kernel when `paged_supported` says so.

Why a second kernel: dequantizing every element (unpack, scale, zero) before the dot makes decode
bound by the ALUs and the load units, not by HBM. Here:
- codes of b bits (b = 2, 4) are read as bytes [BN, D*b/8] and split into 8/b *phases* (phase j holds
  channels j, j + 8/b, ...): each phase is one dot against the matching query (or output) columns, so
  nothing is interleaved back into head-dim order;
- per-channel scales / zeros (keys per page or per row) are folded into the query once per page:
  q.k = sum_d (q_d s_d) c_d + q.z;
- per-token scales (fp8, nuq values, per-token ints) are folded into the scores or the probabilities:
  q.k_t = s_t (q.c_t), sum_t p_t v_t = sum_t (p_t s_t) c_t;
- only what cannot fold is done per element: the codebook lookup (nuq), and scales of channel groups
  smaller than the head (KIVI values).
A tile is one page (BN = P) when a stream has per-page scales or outliers, else BN tokens.
Outliers are exact corrections as in the general kernel (sparse one-hot dots per page).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.decode_attention_triton import (
    NEG_BIG,
    _cast,
    _dense_range,
    _dot,
    _outlier_deltas,
    _value_of,
)
from kvcompress.kernels.streams import KIND_FP8E4, KIND_FP8E5, KIND_INT, KIND_NUQ, SCALE_HEAD, SCALE_PAGE, \
    SCALE_ROW, SCALE_TOKEN, StreamArgs


def paged_supported(a: StreamArgs, head_dim: int, page_size: int, is_key: bool) -> bool:
    """Whether this kernel reads stream `a` (else the general kernel does)."""
    if a.scale_at == SCALE_TOKEN and is_key and a.group != head_dim:
        return False  # key scales per channel group and token do not fold
    if a.kind in (KIND_FP8E4, KIND_FP8E5):
        return a.scale_at in (SCALE_TOKEN, SCALE_HEAD) and a.group == head_dim
    if a.kind not in (KIND_INT, KIND_NUQ) or a.bits not in (2, 4, 8):
        return False
    if a.n_outliers and page_size < 16:
        return False
    if a.scale_at == SCALE_PAGE:
        return page_size >= 16
    if a.scale_at == SCALE_TOKEN:
        return head_dim % a.group == 0
    return a.scale_at == SCALE_ROW


def phases(a: StreamArgs) -> int:
    """Code phases of a stream: 8 / bits for packed 2- and 4-bit codes, else 1."""
    return 8 // a.bits if a.kind in (KIND_INT, KIND_NUQ) else 1


def paged_block(key: StreamArgs, value: StreamArgs, page_size: int, block_n: int) -> tuple[int, int]:
    """(tokens per tile, pages whose key scales are stacked as query rows). A tile is whole pages when a
    stream has per-page scales or outliers (block_n rounded to pages), else block_n tokens."""
    per_page = any(a.scale_at == SCALE_PAGE or a.n_outliers for a in (key, value))
    if not per_page:
        return block_n, 1
    ppt = max(1, block_n // page_size)
    return ppt * page_size, ppt if key.scale_at == SCALE_PAGE else 1


@triton.jit
def _phase(bytes_tile, J: tl.constexpr, BITS: tl.constexpr):
    """Codes of phase J from the byte tile (int32): channels J, J + 8/BITS, ... of each token."""
    if BITS == 8:
        c = bytes_tile
    else:
        c = (bytes_tile >> (J * BITS)) & ((1 << BITS) - 1)
    return c


@triton.jit
def _lut(c, cb, KIND: tl.constexpr, BITS: tl.constexpr, SELECT: tl.constexpr):
    """value(code): for nuq with SELECT, a tree of selects over the 2^BITS levels held in registers (no
    per-element load); otherwise `_value_of` (a gather from the codebook for nuq)."""
    if KIND == 4 and SELECT and BITS <= 4:
        b0 = (c & 1) != 0
        v0 = tl.where(b0, tl.load(cb + 1), tl.load(cb + 0))
        v1 = tl.where(b0, tl.load(cb + 3), tl.load(cb + 2))
        x = tl.where((c & 2) != 0, v1, v0)
        if BITS == 4:
            v2 = tl.where(b0, tl.load(cb + 5), tl.load(cb + 4))
            v3 = tl.where(b0, tl.load(cb + 7), tl.load(cb + 6))
            v4 = tl.where(b0, tl.load(cb + 9), tl.load(cb + 8))
            v5 = tl.where(b0, tl.load(cb + 11), tl.load(cb + 10))
            v6 = tl.where(b0, tl.load(cb + 13), tl.load(cb + 12))
            v7 = tl.where(b0, tl.load(cb + 15), tl.load(cb + 14))
            b1 = (c & 2) != 0
            lo = tl.where((c & 4) != 0, tl.where(b1, v3, v2), x)
            hi = tl.where((c & 4) != 0, tl.where(b1, v7, v6), tl.where(b1, v5, v4))
            x = tl.where((c & 8) != 0, hi, lo)
    else:
        x = _value_of(c, cb, KIND)
    return x


@triton.jit
def _q_phase(q_rows, r_ok, J: tl.constexpr, PH: tl.constexpr, W: tl.constexpr):
    ch = tl.arange(0, W) * PH + J
    return tl.load(q_rows + ch[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)  # [QR, W]


@triton.jit
def _key_phase_scores(s, qz, qj, kb, kcb, ks, kz, ks_sn, ks_sc, row_page, row_page_ok,
                      J: tl.constexpr, PH: tl.constexpr, W: tl.constexpr,
                      KIND: tl.constexpr, BITS: tl.constexpr, SCALE_AT: tl.constexpr, HAS_ZERO: tl.constexpr,
                      DOT_FP32: tl.constexpr, DT: tl.constexpr, SELECT: tl.constexpr):
    """s += (q_J * scale_J) . value(codes_J); qz += q_J . zero_J (per-channel scales only).
    qj [QR, W]: query rows (stacked per page slot when scales are per page: row_page [QR] is the page
    whose scales fold into that row)."""
    # integer codes are centred (c - 2^(b-1)) so that the bf16 dot does not subtract two large sums;
    # the shift goes into the zero term: c*s + z = (c - C)*s + (z + C*s)
    CENTER: tl.constexpr = (1 << (BITS - 1)) if KIND == 3 else 0
    x = _lut(_phase(kb, J, BITS), kcb, KIND, BITS, SELECT) - CENTER  # [BN, W] before scale
    q_use = qj
    ch = tl.arange(0, W) * PH + J
    if SCALE_AT == 2:  # per page and channel: each query row folds its own page's scales
        off = row_page[:, None] * ks_sn + ch[None, :] * ks_sc
        sc = tl.load(ks + off, mask=row_page_ok[:, None], other=0.0).to(tl.float32)
        q_use = qj * sc
        if HAS_ZERO:
            zc = tl.load(kz + off, mask=row_page_ok[:, None], other=0.0).to(tl.float32) + CENTER * sc
            qz += tl.sum(qj * zc, 1)
    elif SCALE_AT == 3:  # per row and channel
        sc = tl.load(ks + ch * ks_sc).to(tl.float32)[None, :]
        q_use = qj * sc
        if HAS_ZERO:
            qz += tl.sum(qj * (tl.load(kz + ch * ks_sc).to(tl.float32)[None, :] + CENTER * sc), 1)
    s += _dot(_cast(q_use, DOT_FP32, DT), tl.trans(_cast(x, DOT_FP32, DT)), DOT_FP32)
    return s, qz


@triton.jit
def _value_phase(acc, pv, vb, vcb, vs, vz, vs_sn, vs_sc, tok2, ok2,
                 J: tl.constexpr, PH: tl.constexpr, W: tl.constexpr, P: tl.constexpr,
                 KIND: tl.constexpr, BITS: tl.constexpr, SCALE_AT: tl.constexpr, GROUP: tl.constexpr,
                 HAS_ZERO: tl.constexpr, DV: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr,
                 SELECT: tl.constexpr, GROUP_DOTS: tl.constexpr):
    """acc_J += pv . value(codes_J) (with per-channel or per-group scales applied to the tile)."""
    x = _lut(_phase(vb, J, BITS), vcb, KIND, BITS, SELECT)  # [BN, W]
    if SCALE_AT == 1 and GROUP == DV and KIND == 3:  # folded per-token scales: centred codes (see caller)
        x = x - (1 << (BITS - 1))
    ch = tl.arange(0, W) * PH + J
    if SCALE_AT == 2:  # per page and channel: each row's own page
        off = (tok2 // P) * vs_sn + ch[None, :] * vs_sc
        x = x * tl.load(vs + off, mask=ok2, other=0.0).to(tl.float32)
        if HAS_ZERO:
            x = x + tl.load(vz + off, mask=ok2, other=0.0).to(tl.float32)
    elif SCALE_AT == 3:  # per row and channel
        x = x * tl.load(vs + ch * vs_sc).to(tl.float32)[None, :]
        if HAS_ZERO:
            x = x + tl.load(vz + ch * vs_sc).to(tl.float32)[None, :]
    elif SCALE_AT == 1 and GROUP < DV:  # per token and group of channels (KIVI values)
        if GROUP_DOTS:  # one dot per channel group, the group's scales folded into the probabilities
            grp = (ch // GROUP)[None, :]
            for gi in tl.static_range(DV // GROUP):
                sg = tl.load(vs + tok2 * vs_sn + gi * vs_sc, mask=ok2, other=0.0).to(tl.float32)  # [BN, 1]
                xm = tl.where(grp == gi, x, 0.0)
                acc += _dot(_cast(pv * tl.trans(sg), DOT_FP32, DT), _cast(xm, DOT_FP32, DT), DOT_FP32)
                if HAS_ZERO:
                    zg = tl.load(vz + tok2 * vs_sn + gi * vs_sc, mask=ok2, other=0.0).to(tl.float32)
                    pz = tl.sum(pv * tl.trans(zg), 1)  # [GP]
                    acc += tl.where(grp == gi, pz[:, None], 0.0)
            return acc
        off = tok2 * vs_sn + (ch // GROUP)[None, :] * vs_sc
        x = x * tl.load(vs + off, mask=ok2, other=0.0).to(tl.float32)
        if HAS_ZERO:
            x = x + tl.load(vz + off, mask=ok2, other=0.0).to(tl.float32)
    return acc + _dot(_cast(pv, DOT_FP32, DT), _cast(x, DOT_FP32, DT), DOT_FP32)


@triton.jit
def _value_outlier_phase(acc, p_at, d_o, delta, J: tl.constexpr, PH: tl.constexpr, W: tl.constexpr,
                         DOT_FP32: tl.constexpr, DT: tl.constexpr):
    ch = tl.arange(0, W)
    vd = tl.where(((d_o % PH) == J)[:, None] & ((d_o // PH)[:, None] == ch[None, :]), delta[:, None], 0.0)
    return acc + _dot(_cast(p_at, DOT_FP32, DT), _cast(vd, DOT_FP32, DT), DOT_FP32)


@triton.jit
def _store_phase(ACC_OUT, out_row, acc, g_ok, J: tl.constexpr, PH: tl.constexpr, W: tl.constexpr,
                 DV: tl.constexpr):
    ch = tl.arange(0, W) * PH + J
    tl.store(ACC_OUT + out_row[:, None] * DV + ch[None, :], acc, mask=g_ok[:, None])


@triton.jit
def _paged_split_kernel(
    Q, q_sb, q_sh,
    KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc, KCB, kcb_sh, KOI, KOV, ko_sb, ko_sh, ko_sp,
    VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc, VCB, vcb_sh, VOI, VOV, vo_sb, vo_sh, vo_sp,
    SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
    TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail,
    LENS, STARTS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_body_splits,
    M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh,
    qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    P: tl.constexpr, BN: tl.constexpr, OPB: tl.constexpr, DBN: tl.constexpr,
    K_KIND: tl.constexpr, K_BITS: tl.constexpr, K_SCALE_AT: tl.constexpr, K_GROUP: tl.constexpr,
    K_HAS_ZERO: tl.constexpr, K_NOUT: tl.constexpr, K_KCP: tl.constexpr,
    V_KIND: tl.constexpr, V_BITS: tl.constexpr, V_SCALE_AT: tl.constexpr, V_GROUP: tl.constexpr,
    V_HAS_ZERO: tl.constexpr, V_NOUT: tl.constexpr, V_KCP: tl.constexpr,
    HAS_BODY: tl.constexpr, HAS_LENS: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_PL: tl.constexpr, WRITE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr, DT: tl.constexpr,
    PHK: tl.constexpr, PHV: tl.constexpr, WK: tl.constexpr, WV: tl.constexpr, PPI: tl.constexpr,
    QR: tl.constexpr, LUT_SELECT: tl.constexpr, GROUP_DOTS: tl.constexpr,
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

    g = tl.arange(0, GP)
    g_ok = g < G
    q_rows = Q + b64 * q_sb + (h * G + g)[:, None] * q_sh
    sc_row = SCORES + b64 * sc_sb + (h * G + g)[:, None] * sc_sh  # [GP, 1]
    out_row = (b * HKV * G + h * G + g) * n_splits + split  # [GP]
    m_i = tl.full([GP], NEG_BIG, tl.float32)
    l_i = tl.zeros([GP], tl.float32)

    if split == n_body_splits:  # the exact parts: sinks, then tail
        dk = tl.arange(0, DK)
        dv = tl.arange(0, DV)
        q = tl.load(q_rows + dk[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32)
        q_dot = _cast(q, DOT_FP32, DT)
        acc = tl.zeros([GP, DV], tl.float32)
        m_i, l_i, acc = _dense_range(
            m_i, l_i, acc, q_dot, SK + b64 * sk_sb + h * sk_sh, SV + b64 * sv_sb + h * sv_sh, sk_sn, sv_sn,
            n_sink, 0, row_first, sc_row, g_ok, qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32, DT)
        m_i, l_i, acc = _dense_range(
            m_i, l_i, acc, q_dot, TK + b64 * tk_sb + h * tk_sh, TV + b64 * tv_sb + h * tv_sh, tk_sn, tv_sn,
            n_tail, n_sink + n_body, row_first - n_sink - n_body, sc_row, g_ok, qk_scale, WRITE_SCORES, DBN, DK,
            DV, DOT_FP32, DT)
        tl.store(ACC_OUT + out_row[:, None] * DV + dv[None, :], acc, mask=g_ok[:, None])
    else:
        kc = KC + b64 * kc_sb + h * kc_sh
        ks = KS + b64 * ks_sb + h * ks_sh
        kz = KZ + b64 * ks_sb + h * ks_sh
        kcb = KCB + h * kcb_sh
        vc = VC + b64 * vc_sb + h * vc_sh
        vs = VS + b64 * vs_sb + h * vs_sh
        vz = VZ + b64 * vs_sb + h * vs_sh
        vcb = VCB + h * vcb_sh
        pl = PL + b64 * pl_sb + h * pl_sh
        if HAS_LENS:
            len_b = tl.load(LENS + b).to(tl.int32)
        else:
            len_b = n_body
        if HAS_PL:
            n_logical = n_sel * P
        else:
            n_logical = len_b
        # query rows for the key dots: PPI page slots x G heads (row i: slot i // G, head i % G), so a
        # tile of PPI pages folds each page's key scales into its own rows; PPI = 1: the G heads
        K_CENTER: tl.constexpr = (1 << (K_BITS - 1)) if K_KIND == 3 else 0
        V_CENTER: tl.constexpr = (1 << (V_BITS - 1)) if V_KIND == 3 else 0
        rq = tl.arange(0, QR)
        r_ok = rq < PPI * G
        slot = rq // G
        qk_rows = Q + b64 * q_sb + (h * G + rq % G)[:, None] * q_sh
        # the query split into phases (channels j, j + PH, ...): loaded once
        q0 = _q_phase(qk_rows, r_ok, 0, PHK, WK)
        q1 = _q_phase(qk_rows, r_ok, 1 % PHK, PHK, WK)
        q2 = _q_phase(qk_rows, r_ok, 2 % PHK, PHK, WK)
        q3 = _q_phase(qk_rows, r_ok, 3 % PHK, PHK, WK)
        if PPI > 1:  # stacked rows -> head rows: one-hot [GP, QR]
            pick = ((rq % G)[None, :] == g[:, None]) & r_ok[None, :] & g_ok[:, None]
        if K_SCALE_AT == 1 and K_HAS_ZERO:
            q_sum = tl.sum(tl.load(q_rows + tl.arange(0, DK)[None, :], mask=g_ok[:, None], other=0.0).to(tl.float32), 1)
        acc0 = tl.zeros([GP, WV], tl.float32)
        acc1 = tl.zeros([GP, WV], tl.float32)
        acc2 = tl.zeros([GP, WV], tl.float32)
        acc3 = tl.zeros([GP, WV], tl.float32)
        rows = tl.arange(0, BN)
        wk = tl.arange(0, WK)
        wv = tl.arange(0, WV)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_logical)
        for l0 in range(start, end, BN):
            l = l0 + rows
            if HAS_PL:
                page = tl.load(pl + l // P, mask=l < n_logical, other=-1)
                tok = page * P + l % P
                ok = (l < n_logical) & (page >= 0) & (tok < len_b) & (tok + n_sink >= row_first)
                row_page = tl.load(pl + l0 // P + slot, mask=r_ok & (l0 + slot * P < n_logical), other=-1)
            else:
                tok = l
                ok = (l < n_logical) & (tok + n_sink >= row_first)
                row_page = l0 // P + slot
            row_page_ok = r_ok & (row_page >= 0) & (l0 + slot * P < n_logical)
            tok2 = tok[:, None]
            ok2 = ok[:, None]
            # -- scores
            kb = tl.load(kc + tok2 * kc_sn + wk[None, :], mask=ok2, other=0)
            if K_KIND == 3 or K_KIND == 4:
                kb = kb.to(tl.int32)
            s = tl.zeros([QR, BN], tl.float32)
            qz = tl.zeros([QR], tl.float32)
            s, qz = _key_phase_scores(s, qz, q0, kb, kcb, ks, kz, ks_sn, ks_sc, row_page, row_page_ok, 0, PHK, WK,
                                      K_KIND, K_BITS, K_SCALE_AT, K_HAS_ZERO, DOT_FP32, DT, LUT_SELECT)
            if PHK > 1:
                s, qz = _key_phase_scores(s, qz, q1, kb, kcb, ks, kz, ks_sn, ks_sc, row_page, row_page_ok, 1, PHK, WK,
                                          K_KIND, K_BITS, K_SCALE_AT, K_HAS_ZERO, DOT_FP32, DT, LUT_SELECT)
            if PHK > 2:
                s, qz = _key_phase_scores(s, qz, q2, kb, kcb, ks, kz, ks_sn, ks_sc, row_page, row_page_ok, 2, PHK, WK,
                                          K_KIND, K_BITS, K_SCALE_AT, K_HAS_ZERO, DOT_FP32, DT, LUT_SELECT)
                s, qz = _key_phase_scores(s, qz, q3, kb, kcb, ks, kz, ks_sn, ks_sc, row_page, row_page_ok, 3, PHK, WK,
                                          K_KIND, K_BITS, K_SCALE_AT, K_HAS_ZERO, DOT_FP32, DT, LUT_SELECT)
            s += qz[:, None]
            if PPI > 1:  # each token's score from the rows of its own page slot
                s = tl.where(slot[:, None] == (rows // P)[None, :], s, 0.0)
                s = tl.dot(pick.to(tl.float32), s, input_precision="ieee")  # [GP, BN]
            if K_SCALE_AT == 1:  # per token (whole head): scale the score columns
                st = tl.load(ks + tok * ks_sn, mask=ok, other=0.0).to(tl.float32)
                s = s * st[None, :]
                if K_HAS_ZERO:  # codes were centred (see _key_phase_scores)
                    zt = tl.load(kz + tok * ks_sn, mask=ok, other=0.0).to(tl.float32) + K_CENTER * st
                    s += q_sum[:, None] * zt[None, :]
            elif K_SCALE_AT == 4:  # per head (static fp8)
                s = s * tl.load(ks).to(tl.float32)
            if K_NOUT > 0:
                r, d_o, delta, o_ok = _outlier_deltas(
                    KOI + b64 * ko_sb + h * ko_sh, KOV + b64 * ko_sb + h * ko_sh, ko_sp, kc, kc_sn, ks, kz, ks_sn,
                    ks_sc, kcb, pl, l0, n_logical, len_b, HAS_PL, P, BN, OPB, K_KCP, K_NOUT, K_KIND, K_BITS,
                    K_SCALE_AT, K_GROUP, K_HAS_ZERO, DK)
                q_at = tl.load(q_rows + d_o[None, :], mask=g_ok[:, None] & o_ok[None, :], other=0.0)
                qd = q_at.to(tl.float32) * delta[None, :]  # [GP, KCP]
                hit = (r[:, None] == rows[None, :]) & o_ok[:, None]  # [KCP, BN]
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
            acc0 = acc0 * alpha[:, None]
            acc1 = acc1 * alpha[:, None]
            acc2 = acc2 * alpha[:, None]
            acc3 = acc3 * alpha[:, None]
            # -- values
            vb = tl.load(vc + tok2 * vc_sn + wv[None, :], mask=ok2, other=0)
            if V_KIND == 3 or V_KIND == 4:
                vb = vb.to(tl.int32)
            pv = p
            if V_SCALE_AT == 1 and V_GROUP == DV:  # per token (whole head): fold into the probabilities
                st = tl.load(vs + tok * vs_sn, mask=ok, other=0.0).to(tl.float32)
                pv = p * st[None, :]
                if V_HAS_ZERO:  # integer codes centred in _value_phase: z + C*s
                    zt = tl.load(vz + tok * vs_sn, mask=ok, other=0.0).to(tl.float32) + V_CENTER * st
                    pz = tl.sum(p * zt[None, :], 1)
                    acc0 += pz[:, None]
                    acc1 += pz[:, None]
                    acc2 += pz[:, None]
                    acc3 += pz[:, None]
            elif V_SCALE_AT == 4:
                pv = p * tl.load(vs).to(tl.float32)
            acc0 = _value_phase(acc0, pv, vb, vcb, vs, vz, vs_sn, vs_sc, tok2, ok2, 0, PHV, WV, P,
                                V_KIND, V_BITS, V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV, DOT_FP32, DT, LUT_SELECT,
                                    GROUP_DOTS)
            if PHV > 1:
                acc1 = _value_phase(acc1, pv, vb, vcb, vs, vz, vs_sn, vs_sc, tok2, ok2, 1, PHV, WV, P,
                                    V_KIND, V_BITS, V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV, DOT_FP32, DT, LUT_SELECT,
                                    GROUP_DOTS)
            if PHV > 2:
                acc2 = _value_phase(acc2, pv, vb, vcb, vs, vz, vs_sn, vs_sc, tok2, ok2, 2, PHV, WV, P,
                                    V_KIND, V_BITS, V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV, DOT_FP32, DT, LUT_SELECT,
                                    GROUP_DOTS)
                acc3 = _value_phase(acc3, pv, vb, vcb, vs, vz, vs_sn, vs_sc, tok2, ok2, 3, PHV, WV, P,
                                    V_KIND, V_BITS, V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV, DOT_FP32, DT, LUT_SELECT,
                                    GROUP_DOTS)
            if V_NOUT > 0:
                r, d_o, delta, o_ok = _outlier_deltas(
                    VOI + b64 * vo_sb + h * vo_sh, VOV + b64 * vo_sb + h * vo_sh, vo_sp, vc, vc_sn, vs, vz, vs_sn,
                    vs_sc, vcb, pl, l0, n_logical, len_b, HAS_PL, P, BN, OPB, V_KCP, V_NOUT, V_KIND, V_BITS,
                    V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV)
                hit_t = (rows[:, None] == r[None, :]) & o_ok[None, :]  # [BN, KCP]
                p_at = _dot(_cast(p, DOT_FP32, DT), _cast(hit_t.to(tl.float32), DOT_FP32, DT), DOT_FP32)
                acc0 = _value_outlier_phase(acc0, p_at, d_o, delta, 0, PHV, WV, DOT_FP32, DT)
                if PHV > 1:
                    acc1 = _value_outlier_phase(acc1, p_at, d_o, delta, 1, PHV, WV, DOT_FP32, DT)
                if PHV > 2:
                    acc2 = _value_outlier_phase(acc2, p_at, d_o, delta, 2, PHV, WV, DOT_FP32, DT)
                    acc3 = _value_outlier_phase(acc3, p_at, d_o, delta, 3, PHV, WV, DOT_FP32, DT)
            m_i = m_new
        _store_phase(ACC_OUT, out_row, acc0, g_ok, 0, PHV, WV, DV)
        if PHV > 1:
            _store_phase(ACC_OUT, out_row, acc1, g_ok, 1, PHV, WV, DV)
        if PHV > 2:
            _store_phase(ACC_OUT, out_row, acc2, g_ok, 2, PHV, WV, DV)
            _store_phase(ACC_OUT, out_row, acc3, g_ok, 3, PHV, WV, DV)
    tl.store(M_OUT + out_row, m_i, mask=g_ok)
    tl.store(L_OUT + out_row, l_i, mask=g_ok)
