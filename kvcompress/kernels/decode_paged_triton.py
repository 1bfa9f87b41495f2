"""The fast body path of the fused decode attention for 2-, 4- and 8-bit codes (int / nuq; fp8 when only
one stream is fp8): scales folded out of the inner loop, codes read as whole words. Same result as
`_decode_split_kernel` (decode_attention_triton.py), whose torch twin is `decode_attention_torch`; the
launcher picks this kernel when `paged_supported` says so (fp8 / fp8 goes to decode_fp8_triton, and 2- /
4-bit keys per page with values per token, the int2 / int4 / nuq4 / nuq2 presets, to decode_phase_triton,
measured twice as fast).

Why a second kernel: dequantizing every element (unpack, scale, zero) before the dot makes decode bound
by the ALUs, the load units and the registers, not by HBM. Measured with Nsight Compute on an H200
(BENCHMARKS.md), the earlier form of this kernel used 255 registers per thread and spilled, because a
decode dot has only a few query rows (M = 16) and Triton gave each of the 4 warps the same 16-row tile.
Here:
- the dots are transposed: scores^T [BN, rows] = K_tile [BN, D] . q^T and out^T [D, rows] =
  V_tile^T . p^T, so tokens and channels are the M dimension (Hopper wgmma), the query rows N;
- b-bit codes are loaded as words of WB bits ([BN, NW] tiles, NW = D*b/WB >= 16) and spread in
  registers into *phase-major* order (column j*NW + i holds code j of word i, head-dim channel
  i*PH + j); the query, the key scales and the output use the same order, so nothing is interleaved;
- integer codes become bf16 / fp16 operands with one OR: (c | magic) read as a half float is exactly
  offset + c (offset 128 in bf16, 1024 in fp16), with no int-to-float conversion; `_shift_back` takes
  the offset out so that the operand's rounding multiplies the centred codes;
- per-channel scales / zeros (keys per page or per row) are folded into the query once per page:
  q.k = sum_d (q_d s_d) c_d + q.z;
- per-token scales (nuq values, per-token ints) are folded into the scores or the probabilities:
  q.k_t = s_t (q.c_t), sum_t p_t v_t = sum_t (p_t s_t) c_t;
- a tile of several pages whose key scales differ stacks one block of query rows per page slot; each
  row is its own partial softmax over its slot's tokens (the reduce kernel merges them like splits);
- only what cannot fold is done per element: the codebook lookup (nuq, a select tree) and scales of
  channel groups smaller than the head (KIVI values: one load per word, repeated in registers).
A tile is whole pages (BN a multiple of P) when a stream has per-page scales or outliers, else BN tokens.
Outliers are exact corrections as in the general kernel (sparse one-hot dots per tile).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.decode_attention_triton import (
    LENGTH_ARGS,
    NEG_BIG,
    _body_extent,
    _cast,
    _dot,
    _exact_split,
    _outlier_deltas,
    _value_of,
)
from kvcompress.kernels.streams import KIND_FP8E4, KIND_FP8E5, KIND_INT, KIND_NUQ, SCALE_HEAD, SCALE_PAGE, \
    SCALE_ROW, SCALE_TOKEN, StreamArgs

MAX_PHASES = 8


def word_bits(a: StreamArgs, head_dim: int) -> int:
    """Bits per loaded word: the widest of 32 / 16 / 8 that leaves >= 16 words per token (8 for fp8); -1: none
    does."""
    if is_fp8(a):
        return 8  # bytes, one code per word (measured faster than words for fp8)
    for wb in (32, 16, 8):
        if head_dim * a.bits // wb >= 16 and wb // a.bits <= MAX_PHASES:
            return wb
    return -1


def paged_supported(a: StreamArgs, head_dim: int, page_size: int, is_key: bool) -> bool:
    """Whether this kernel reads stream `a` (else the general kernel does)."""
    if a.scale_at == SCALE_TOKEN and is_key and a.group != head_dim:
        return False  # key scales per channel group and token do not fold
    wb = word_bits(a, head_dim)
    if wb < 0 or a.codes.stride(2) % (wb // 8) or a.codes.data_ptr() % 4:
        return False  # word loads need >= 16 words per token and aligned rows
    if is_fp8(a):
        return a.scale_at in (SCALE_TOKEN, SCALE_HEAD) and a.group == head_dim or a.scale_at == SCALE_ROW
    if a.kind not in (KIND_INT, KIND_NUQ) or a.bits not in (2, 4, 8):
        return False
    if a.n_outliers and page_size < 16:
        return False
    if a.scale_at == SCALE_PAGE:
        return page_size >= 16
    if a.scale_at == SCALE_TOKEN:
        return head_dim % a.group == 0
    return a.scale_at == SCALE_ROW


def is_fp8(a: StreamArgs) -> bool:
    return a.kind in (KIND_FP8E4, KIND_FP8E5)


def phases(a: StreamArgs, head_dim: int) -> int:
    """Codes per word."""
    return word_bits(a, head_dim) // (8 if is_fp8(a) else a.bits)


def words(a: StreamArgs, head_dim: int) -> int:
    """Words per token."""
    return head_dim // phases(a, head_dim)


def magic(a: StreamArgs, head_dim: int, dot_dtype: str, is_key: bool) -> tuple[int, int]:
    """(OR pattern, SHIFT): integer codes enter the dots as code + SHIFT. With a pattern, (c | pattern)
    read as a half float is offset + c exactly (SHIFT = offset); without (fp32 dots, 8-bit codes in bf16)
    the codes are converted and centred (SHIFT = -2^(b-1)), so the dot does not subtract two large sums.
    (0, 0) for nuq / fp8, and for values scaled per element (they are scaled in float32 first)."""
    per_element = not is_key and (a.scale_at in (SCALE_PAGE, SCALE_ROW) or (
        a.scale_at == SCALE_TOKEN and a.group < head_dim))
    if a.kind != KIND_INT or per_element:
        return 0, 0
    if dot_dtype == "bf16" and a.bits <= 7:
        return 0x4300, 128  # bf16 128.0: 7 mantissa bits, so 128 + c is exact for c < 128
    if dot_dtype == "fp16" and a.bits <= 10:
        return 0x6400, 1024  # fp16 1024.0: 10 mantissa bits
    return 0, -(1 << (a.bits - 1))


def paged_block(key: StreamArgs, value: StreamArgs, page_size: int, block_n: int) -> tuple[int, int]:
    """(tokens per tile, page slots stacked as query rows). A tile is whole pages when a stream has
    per-page scales or outliers (block_n rounded to pages), else block_n tokens; key scales per page
    stack one block of rows per page of the tile."""
    per_page = any(a.scale_at == SCALE_PAGE or a.n_outliers for a in (key, value))
    if not per_page:
        return block_n, 1
    ppt = max(1, block_n // page_size)
    return ppt * page_size, ppt if key.scale_at == SCALE_PAGE else 1


@triton.jit
def _load_words(ptr, sn, tok2, ok2, WB: tl.constexpr, NW: tl.constexpr):
    """Rows tok2 [BN, 1] of a code tensor (row stride sn bytes) as NW words of WB bits (int32; bytes stay
    uint8)."""
    cols = tl.arange(0, NW)[None, :]
    if WB == 32:
        w = tl.load(ptr.to(tl.pointer_type(tl.int32)) + tok2 * (sn // 4) + cols, mask=ok2, other=0)
    elif WB == 16:
        w = tl.load(ptr.to(tl.pointer_type(tl.int16)) + tok2 * (sn // 2) + cols, mask=ok2, other=0).to(tl.int32)
    else:
        w = tl.load(ptr + tok2 * sn + cols, mask=ok2, other=0)
    return w


@triton.jit
def _levels(cb, L: tl.constexpr, DT: tl.constexpr):
    """The L codebook levels as a tuple of scalars in the operand dtype (loaded once, kept in registers)."""
    lev = ()
    for i in tl.static_range(L):
        lev = lev + (tl.load(cb + i).to(DT),)
    return lev


@triton.jit
def _select(c, lev, BITS: tl.constexpr):
    """lev[c] for codes c of BITS = 2, 3 or 4 bits: a tree of selects, one code bit at a time (few live
    temporaries)."""
    b0 = (c & 1) != 0
    b1 = (c & 2) != 0
    x = tl.where(b1, tl.where(b0, lev[3], lev[2]), tl.where(b0, lev[1], lev[0]))
    if BITS >= 3:
        b2 = (c & 4) != 0
        y = tl.where(b1, tl.where(b0, lev[7], lev[6]), tl.where(b0, lev[5], lev[4]))
        x = tl.where(b2, y, x)
        if BITS == 4:
            y = tl.where(b1, tl.where(b0, lev[11], lev[10]), tl.where(b0, lev[9], lev[8]))
            z = tl.where(b1, tl.where(b0, lev[15], lev[14]), tl.where(b0, lev[13], lev[12]))
            x = tl.where((c & 8) != 0, tl.where(b2, z, y), x)
    return x


@triton.jit
def _lut(c, cb, KIND: tl.constexpr, BITS: tl.constexpr, SELECT: tl.constexpr):
    """value(code) float32: for nuq with SELECT, a tree of selects over the 2^BITS levels held in
    registers (no per-element load); otherwise `_value_of` (a gather from the codebook for nuq)."""
    if KIND == 4 and SELECT and BITS <= 4:
        x = _select(c, _levels(cb, 1 << BITS, tl.float32), BITS)
    else:
        x = _value_of(c, cb, KIND)
    return x


@triton.jit
def _spread(w, S: tl.constexpr, M: tl.constexpr, PH: tl.constexpr):
    """Word tile [BN, W] -> codes [BN, PH * W] in phase-major order: column j*W + i holds code j of word i
    (head-dim channel i*PH + j, see `_phase_major`). (Head-dim order, [BN, W, PH] reshaped, gave wrong
    results in the wgmma path on triton 3.6 while this order is right.)"""
    if PH == 1:
        c = w
    else:
        BN: tl.constexpr = w.shape[0]
        W: tl.constexpr = w.shape[1]
        c = (w.to(tl.int32)[:, None, :] >> (tl.arange(0, PH) * S)[None, :, None]) & M
        c = tl.reshape(c, (BN, PH * W))
    return c


@triton.jit
def _repeat(x, PH: tl.constexpr):
    """Per-word values [BN, W] -> [BN, PH * W] in phase-major order (a per-word scale onto its channels)."""
    BN: tl.constexpr = x.shape[0]
    W: tl.constexpr = x.shape[1]
    return tl.reshape(tl.broadcast_to(x[:, None, :], (BN, PH, W)), (BN, PH * W))


@triton.jit
def _phase_major(D: tl.constexpr, PH: tl.constexpr):
    """Head-dim channel of each phase-major column k: (k % W) * PH + k // W, W = D / PH."""
    k = tl.arange(0, D)
    return (k % (D // PH)) * PH + k // (D // PH)


@triton.jit
def _unpack(w, cb, BITS: tl.constexpr, PH: tl.constexpr, KIND: tl.constexpr, MAGIC: tl.constexpr,
            SHIFT: tl.constexpr, SELECT: tl.constexpr):
    """Word tile w [BN, W] -> values [BN, D] in phase-major order. Integer codes come out as code + SHIFT (as
    int16 bits of a half float when MAGIC, see `magic`; else float32); nuq codes as their codebook level
    and fp8 bytes as their value (float32)."""
    if KIND == 1 or KIND == 2:  # fp8 bytes
        c = _spread(w, 8, 255, PH).to(tl.uint8)
    else:
        c = _spread(w, BITS, (1 << BITS) - 1, PH)
    if KIND == 1:
        x = c.to(tl.float8e4nv, bitcast=True)
    elif KIND == 2:
        x = c.to(tl.float8e5, bitcast=True)
    elif KIND == 3 and MAGIC != 0:
        x = (c | MAGIC).to(tl.int16)
    elif KIND == 3:
        x = c.to(tl.float32) + SHIFT
    else:
        x = _lut(c, cb, KIND, BITS, SELECT)
    return x


@triton.jit
def _operand(x, MAGIC: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr):
    """Unpacked values -> the dot operand dtype."""
    if MAGIC != 0:
        x = x.to(DT, bitcast=True)
    elif DOT_FP32:
        x = x.to(tl.float32)
    else:
        x = x.to(DT)
    return x


@triton.jit
def _mma(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a . b (fp32 inputs in full precision)."""
    if DOT_FP32:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _shift_back(a, a_dot, AXIS: tl.constexpr, SHIFT: tl.constexpr, BITS: tl.constexpr):
    """What to add to dot(a_dot, c + SHIFT) to get dot(a, c) with the operand's rounding error multiplying
    the centred codes (c - C, C = 2^(b-1)) instead of c + SHIFT: -(SHIFT + C) * sum(a_dot) + C * sum(a).
    The SHIFT + C part cancels exactly (same rounded operand); the centre uses the unrounded one."""
    C: tl.constexpr = 1 << (BITS - 1)
    return C * tl.sum(a, AXIS) - (SHIFT + C) * tl.sum(a_dot.to(tl.float32), AXIS)


@triton.jit(do_not_specialize=LENGTH_ARGS)
def _paged_split_kernel(
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
    WRITE_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr,
    PHK: tl.constexpr, PHV: tl.constexpr, WK: tl.constexpr, WV: tl.constexpr, K_WB: tl.constexpr,
    V_WB: tl.constexpr, K_MAGIC: tl.constexpr, K_SHIFT: tl.constexpr, V_MAGIC: tl.constexpr,
    V_SHIFT: tl.constexpr, PPI: tl.constexpr, QR: tl.constexpr, LUT_SELECT: tl.constexpr,
):
    """Grid (B * Hkv, body splits + 1). Partial rows per (b, query head): n_body_splits * PPI body rows
    (split s, page slot i at s * PPI + i), then the exact parts (sinks, tail) at n_body_splits * PPI.
    The body dots are computed transposed (tokens and channels as the M dimension, the few query rows as
    N) so that the warps split real work instead of replicating a 16-row tile (fp8 caches, cheap to decode,
    go to decode_fp8_triton, which keeps the query rows as M)."""
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    NS = n_body_splits * PPI + 1
    b = pid_bh // HKV
    h = pid_bh % HKV
    b64 = b.to(tl.int64)
    if HAS_STARTS:  # left padding: held positions before row_first are not attended
        row_first = tl.load(STARTS + b).to(tl.int32)
    else:
        row_first = 0
    if HAS_TLEN:  # tail length on the device: the tail buffer of a captured decode step is longer
        n_tail = tl.load(TLEN).to(tl.int32)

    if split == n_body_splits:  # the exact parts: sinks, then tail
        _exact_split(Q, q_sb, q_sh, SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
                     TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, n_body, SCORES, sc_sb, sc_sh,
                     M_OUT, L_OUT, ACC_OUT, b, h, row_first, NS, n_body_splits * PPI, qk_scale,
                     HKV, G, GP, DK, DV, DBN, WRITE_SCORES, DOT_FP32, DT)
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
        len_b, n_logical = _body_extent(LENS, b, n_body, n_sel, HAS_LENS, HAS_PL, P)
        # columns: PPI page slots x G heads (column i: slot i // G, head i % G); each is its own partial
        # softmax over the tokens of its slot, with that page's key scales folded into its query
        rq = tl.arange(0, QR)
        r_ok = rq < PPI * G
        slot = rq // G
        head = h * G + rq % G
        qk_rows = Q + b64 * q_sb + head[:, None] * q_sh
        sc_cols = SCORES + b64 * sc_sb + head[None, :] * sc_sh
        out_rows = (b * HKV * G + head) * NS + split * PPI + slot
        chk = _phase_major(DK, PHK)  # [DK] head-dim channel of each operand column
        chv = _phase_major(DV, PHV)
        q_pm = tl.load(qk_rows + chk[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)  # [QR, DK]
        if K_SCALE_AT == 1 and K_HAS_ZERO:
            q_sum = tl.sum(q_pm, 1)
        if K_SCALE_AT == 3:  # per row and channel: folded once
            q_use_row = q_pm * tl.load(ks + chk * ks_sc).to(tl.float32)[None, :]
            if K_HAS_ZERO:
                qz_row = tl.sum(q_pm * tl.load(kz + chk * ks_sc).to(tl.float32)[None, :], 1)
        m_i = tl.full([QR], NEG_BIG, tl.float32)
        l_i = tl.zeros([QR], tl.float32)
        c_acc = tl.zeros([QR], tl.float32)  # added to every output channel (value zeros, SHIFT)
        acc_t = tl.zeros([DV, QR], tl.float32)  # transposed, channels in phase-major order (chv)
        rows = tl.arange(0, BN)
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
            # -- scores, transposed: sT [BN, QR] = K_tile . q_use^T
            xk = _unpack(_load_words(kc, kc_sn, tok2, ok2, K_WB, WK), kcb, K_BITS, PHK, K_KIND, K_MAGIC, K_SHIFT,
                         LUT_SELECT)
            xk = _operand(xk, K_MAGIC, DOT_FP32, DT)
            qz = tl.zeros([QR], tl.float32)
            if K_SCALE_AT == 2:  # per page and channel: each column folds its own page's scales
                off = row_page[:, None] * ks_sn + chk[None, :] * ks_sc
                q_use = q_pm * tl.load(ks + off, mask=row_page_ok[:, None], other=0.0).to(tl.float32)
                if K_HAS_ZERO:
                    qz = tl.sum(q_pm * tl.load(kz + off, mask=row_page_ok[:, None], other=0.0).to(tl.float32), 1)
            elif K_SCALE_AT == 3:
                q_use = q_use_row
                if K_HAS_ZERO:
                    qz = qz_row
            else:
                q_use = q_pm
            q_dot = _cast(q_use, DOT_FP32, DT)
            if K_SHIFT != 0:  # the codes entered as c + SHIFT: see _shift_back
                qz += _shift_back(q_use, q_dot, 1, K_SHIFT, K_BITS)
            sT = _dot(xk, tl.trans(q_dot), DOT_FP32) + qz[None, :]
            if K_SCALE_AT == 1:  # per token (whole head): scale the score rows
                st = tl.load(ks + tok * ks_sn, mask=ok, other=0.0).to(tl.float32)
                sT = sT * st[:, None]
                if K_HAS_ZERO:
                    zt = tl.load(kz + tok * ks_sn, mask=ok, other=0.0).to(tl.float32)
                    sT += zt[:, None] * q_sum[None, :]
            elif K_SCALE_AT == 4:  # per head (static fp8)
                sT = sT * tl.load(ks).to(tl.float32)
            if K_NOUT > 0:
                r, d_o, delta, o_ok = _outlier_deltas(
                    KOI + b64 * ko_sb + h * ko_sh, KOV + b64 * ko_sb + h * ko_sh, ko_sp, kc, kc_sn, ks, kz, ks_sn,
                    ks_sc, kcb, pl, l0, n_logical, len_b, HAS_PL, P, BN, OPB, K_KCP, K_NOUT, K_KIND, K_BITS,
                    K_SCALE_AT, K_GROUP, K_HAS_ZERO, DK)
                q_at = tl.load(qk_rows + d_o[None, :], mask=r_ok[:, None] & o_ok[None, :], other=0.0)
                qd = q_at.to(tl.float32) * delta[None, :]  # [QR, OPB * KCP]
                hit = (rows[:, None] == r[None, :]) & o_ok[None, :]  # [BN, OPB * KCP]
                sT += _dot(_cast(hit.to(tl.float32), DOT_FP32, DT), tl.trans(_cast(qd, DOT_FP32, DT)), DOT_FP32)
            sT = sT * qk_scale
            valid = ok[:, None] & r_ok[None, :]
            if PPI > 1:  # each column reads the tokens of its own page slot
                valid = valid & ((rows // P)[:, None] == slot[None, :])
            sT = tl.where(valid, sT, float("-inf"))
            if WRITE_SCORES:
                tl.store(sc_cols + n_sink + tok2, sT, mask=valid)
            # -- online softmax (per column)
            m_new = tl.maximum(m_i, tl.max(sT, 0))
            alpha = tl.exp2(m_i - m_new)
            pT = tl.exp2(sT - m_new[None, :])
            l_i = l_i * alpha + tl.sum(pT, 0)
            c_acc = c_acc * alpha
            acc_t = acc_t * alpha[None, :]
            # -- values: acc_t [DV, QR] += V_tile^T . pv^T
            xv = _unpack(_load_words(vc, vc_sn, tok2, ok2, V_WB, WV), vcb, V_BITS, PHV, V_KIND, V_MAGIC, V_SHIFT,
                         LUT_SELECT)
            pv = pT
            if V_SCALE_AT == 1 and V_GROUP == DV:  # per token (whole head): fold into the probabilities
                st = tl.load(vs + tok * vs_sn, mask=ok, other=0.0).to(tl.float32)
                pv = pT * st[:, None]
                if V_HAS_ZERO:
                    c_acc += tl.sum(pT * tl.load(vz + tok * vs_sn, mask=ok, other=0.0).to(tl.float32)[:, None], 0)
            elif V_SCALE_AT == 4:
                pv = pT * tl.load(vs).to(tl.float32)
                if V_HAS_ZERO:
                    c_acc += tl.sum(pT, 0) * tl.load(vz).to(tl.float32)
            elif V_SCALE_AT == 1:  # per token and channel group (KIVI values): scaled per element
                if V_GROUP % PHV == 0:  # one scale per word, repeated onto its channels in registers
                    goff = tok2 * vs_sn + ((wv * PHV) // V_GROUP)[None, :] * vs_sc
                    xv = xv * _repeat(tl.load(vs + goff, mask=ok2, other=0.0).to(tl.float32), PHV)
                    if V_HAS_ZERO:
                        xv = xv + _repeat(tl.load(vz + goff, mask=ok2, other=0.0).to(tl.float32), PHV)
                else:
                    goff = tok2 * vs_sn + (chv // V_GROUP)[None, :] * vs_sc
                    xv = xv * tl.load(vs + goff, mask=ok2, other=0.0).to(tl.float32)
                    if V_HAS_ZERO:
                        xv = xv + tl.load(vz + goff, mask=ok2, other=0.0).to(tl.float32)
            elif V_SCALE_AT == 2:  # per page and channel: scaled per element
                off = (tok2 // P) * vs_sn + chv[None, :] * vs_sc
                xv = xv * tl.load(vs + off, mask=ok2, other=0.0).to(tl.float32)
                if V_HAS_ZERO:
                    xv = xv + tl.load(vz + off, mask=ok2, other=0.0).to(tl.float32)
            elif V_SCALE_AT == 3:  # per row and channel
                xv = xv * tl.load(vs + chv * vs_sc).to(tl.float32)[None, :]
                if V_HAS_ZERO:
                    xv = xv + tl.load(vz + chv * vs_sc).to(tl.float32)[None, :]
            xv = _operand(xv, V_MAGIC, DOT_FP32, DT)
            pv_dot = _cast(pv, DOT_FP32, DT)
            if V_SHIFT != 0:  # the codes entered as c + SHIFT: see _shift_back
                c_acc += _shift_back(pv, pv_dot, 0, V_SHIFT, V_BITS)
            acc_t = _mma(tl.trans(xv), pv_dot, acc_t, DOT_FP32)
            if V_NOUT > 0:
                r, d_o, delta, o_ok = _outlier_deltas(
                    VOI + b64 * vo_sb + h * vo_sh, VOV + b64 * vo_sb + h * vo_sh, vo_sp, vc, vc_sn, vs, vz, vs_sn,
                    vs_sc, vcb, pl, l0, n_logical, len_b, HAS_PL, P, BN, OPB, V_KCP, V_NOUT, V_KIND, V_BITS,
                    V_SCALE_AT, V_GROUP, V_HAS_ZERO, DV)
                hit_t = (r[:, None] == rows[None, :]) & o_ok[:, None]  # [OPB * KCP, BN]
                p_at = _dot(_cast(hit_t.to(tl.float32), DOT_FP32, DT), _cast(pT, DOT_FP32, DT), DOT_FP32)
                vd = tl.where(chv[:, None] == d_o[None, :], delta[None, :], 0.0)  # [DV, OPB * KCP]
                acc_t = _mma(_cast(vd, DOT_FP32, DT), _cast(p_at, DOT_FP32, DT), acc_t, DOT_FP32)
            m_i = m_new
        tl.store(ACC_OUT + out_rows[None, :] * DV + chv[:, None], acc_t + c_acc[None, :], mask=r_ok[None, :])
        tl.store(M_OUT + out_rows, m_i, mask=r_ok)
        tl.store(L_OUT + out_rows, l_i, mask=r_ok)
