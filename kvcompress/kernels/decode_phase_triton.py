"""The body path of the fused decode attention for 2-, 3- and 4-bit caches whose keys have a (scale, zero)
per page and channel and whose values are scaled per token: the KIVI int presets (int2 / int3 / int4: values
per token and group of channels, with zeros) and the nuq presets' layout (nuq4 / nuq3 / nuq2: codebook
levels, keys with 1-2% outliers per page, values per whole token). 3-bit codes are read at head dims of 128
and more as 24-bit words of 8 codes, at head dim 64 as 12-bit words of 4 (`_words3`). Same result as
`_decode_split_kernel`
(decode_attention_triton.py), whose torch twin is `decode_attention_torch`; the launcher picks this kernel
when `phase_supported` says so.

Why a third kernel: in `decode_paged_triton` the tokens are the M dimension of both dots, so every code is
unpacked into one big operand tile that goes through shared memory (a 16-bit store per element), and the
page scales fold into a stacked block of 16 query rows. Measured on an H200 (BENCHMARKS.md) that kernel
reads a 4-bit cache at 0.44x the speed of bf16 SDPA. Here nothing per element goes through shared memory:
- codes are read as words of WB bits and used one *phase* at a time (phase I = code I of every word, the
  head-dim channels w * PH + I); each phase is its own dot with K = the W words of a token, so the
  unpacked operand is an elementwise function of the word tile and Triton keeps it in registers
  (int: one shift and one AND-OR per code, no conversion: (c | magic) read as a half float is offset + c;
  nuq: the code's level, by a tree of selects or a warp shuffle over levels held in registers, or a load
  per element; on the GPU the 4-bit levels by byte permutes instead of the shuffle, unpack_asm_triton.py);
- keys: scores^T [BN, GQ] = sum over phases of codes_I [BN, W] . (q * key scale)_I^T [W, GQ]: the tokens
  are M and the G query heads of the kv head are N, so a page's scales fold into a [W, GQ] query tile per
  phase (tiny) instead of a stacked [16, D] one; the zeros and the code offset come back as one sum; the
  page's scales and zeros are one load each, split by phase in registers;
  key outliers are exact corrections, one sparse one-hot dot per tile as in the paged kernel (or a gather
  per token), computed before the tile's dense work so that their dependent loads run under it;
- values: out_I^T [W, RV] += codes_I^T [W, BN] . a^T [BN, RV], where the RV columns are (channel group,
  head) pairs and a = p times that group's per-token scale; each output channel keeps the column of its
  own group (with G = 4 and 4 groups of 32 channels the 16 columns are all used);
- one warp per program, tiles of one page of 32 tokens, two pipeline stages (measured best, BENCHMARKS.md);
  on the GPU, int codes and 4-bit codebook levels are unpacked by inline PTX, several per instruction
  (unpack_asm_triton.py).
Quest page lists, left padding, ragged lengths and the H2O scores are supported as in the other kernels;
sinks and tail are the exact split, as there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvcompress.kernels.decode_attention_triton import (
    LENGTH_ARGS,
    NEG_BIG,
    _body_extent,
    _cast,
    _dequant_points,
    _dot,
    _exact_split,
    _outlier_deltas,
)
from kvcompress.kernels.decode_paged_triton import _levels, _mma, _select
from kvcompress.kernels.decode_paged_triton import word_bits as fast_word_bits
from kvcompress.kernels.streams import KIND_INT, KIND_NUQ, SCALE_PAGE, SCALE_TOKEN, StreamArgs
from kvcompress.kernels.unpack_asm_triton import byte_codes, byte_levels, table_tiles

LUT_SELECT, LUT_GATHER, LUT_SHUFFLE = 0, 1, 2
LUTS = {"select": LUT_SELECT, "gather": LUT_GATHER, "shuffle": LUT_SHUFFLE}


def phase_supported(key: StreamArgs, value: StreamArgs, dk: int, dv: int, page_size: int) -> bool:
    """Whether this kernel reads the pair: 2/3/4-bit keys (int or nuq, both streams the same kind; int both
    the same width, nuq values at any of 2/3/4 bits) with a (scale, zero) per page and channel, values
    scaled per token (int: per group of channels with zeros; nuq: per whole token), outliers only in the
    keys, word loads of >= 16 words per token (3-bit codes: words of 8 or 4 codes, so head dims of 64 and
    more), pages of >= 16 tokens."""
    if key.kind != value.kind or key.kind not in (KIND_INT, KIND_NUQ):
        return False
    if key.bits != value.bits and key.kind == KIND_INT:  # int codes of both streams share one offset
        return False
    if {key.bits, value.bits} - {2, 3, 4} or key.scale_at != SCALE_PAGE or not key.has_zero or page_size < 16:
        return False
    if value.scale_at != SCALE_TOKEN or dv % value.group or value.n_outliers:
        return False
    if key.kind == KIND_INT and (key.n_outliers or not value.has_zero):
        return False
    # rotated values are attended in the rotated basis: the launcher rotates the exact parts and unrotates
    # the output, so the kernel reads them as any per-token stream (rotated keys have per-token scales)
    if key.kind == KIND_NUQ and (value.group != dv or key.rotation_signs is not None):
        return False
    if key.scale_strides[3] != 1 or value.scale_strides[3] not in (0, 1):
        return False  # the kernel reads scales as unit-stride channels (groups); the codecs store them so
    for a, d in ((key, dk), (value, dv)):
        wb = word_bits(a, d)
        if wb < 0 or a.codes.stride(2) % (4 if wb % 8 else wb // 8) or a.codes.data_ptr() % 4:
            return False
        if wb % 8 and (d * a.bits // 8) % 4:
            return False  # a 3-bit code word is read from the two 32-bit words it straddles, inside the row
    return True


def word_bits(a: StreamArgs, head_dim: int) -> int:
    """Bits per word of the phases: decode_paged_triton's choice (32 / 16 / 8, >= 16 words per token) for 2
    and 4 bits; for 3 bits 24 (8 codes, 3 bytes, as pack.py lays them out) where that gives >= 16 words
    (head dim 128 and more), else 12 (4 codes; head dim 64); -1: none."""
    if a.bits == 3:
        if head_dim % 8:
            return -1
        return 24 if head_dim // 8 >= 16 else 12 if head_dim // 4 >= 16 else -1
    return fast_word_bits(a, head_dim)


def phases(a: StreamArgs, head_dim: int) -> int:
    """Codes per word."""
    return word_bits(a, head_dim) // a.bits


def words(a: StreamArgs, head_dim: int) -> int:
    """Words per token."""
    return head_dim // phases(a, head_dim)


def phase_magic(kind: int, bits: int, dot_dtype: str) -> tuple[int, int]:
    """(OR pattern, SHIFT) of int codes as dot operands: (c | pattern) read as bf16 is 128 + c (7 mantissa
    bits), as fp16 1024 + c; fp32 dots take the centred codes c - 2^(b-1) (SHIFT) directly. (0, 0) for nuq
    (the operand is the code's level)."""
    if kind != KIND_INT:
        return 0, 0
    if dot_dtype == "bf16":
        return 0x4300, 128
    if dot_dtype == "fp16":
        return 0x6400, 1024
    return 0, -(1 << (bits - 1))


def phase_block(page_size: int, block_n: int | None) -> int:
    """Tokens per tile: whole pages, 32 unless asked (one page of the int presets; measured best). A page
    whose size is not a power of two (48) is read a part at a time: tiles of the largest power of two that
    divides it, at most 32 or block_n (tl.arange needs powers of two)."""
    if page_size & (page_size - 1):
        bn = page_size & -page_size
        cap = 32 if block_n is None else block_n
        if cap & (cap - 1):
            raise ValueError(f"block_n must be a power of two for pages of {page_size} tokens, got {block_n}")
        return min(bn, cap)
    bn = max(32 if block_n is None else block_n, page_size)
    return -(-bn // page_size) * page_size


@triton.jit
def _phase(w, I: tl.constexpr, BITS: tl.constexpr, MAGIC: tl.constexpr, SHIFT: tl.constexpr,
           DOT_FP32: tl.constexpr, DT: tl.constexpr, KIND: tl.constexpr, LUT: tl.constexpr, lev, cb):
    """Code I of every word of tile w as dot operands: int codes as code + SHIFT, nuq codes as their level
    (LUT_SELECT: a select tree over `lev`, the levels as scalars in registers; LUT_SHUFFLE: tl.gather from
    `lev`, the levels as a [L] tensor, a warp shuffle on the GPU; LUT_GATHER: a load per element from
    `cb`, the float32 codebook)."""
    c = (w >> (I * BITS)) & ((1 << BITS) - 1)
    if KIND == 4:  # KIND_NUQ
        if LUT == 0:
            x = _select(c, lev, BITS)
        elif LUT == 2:
            x = tl.gather(tl.broadcast_to(lev[None, :], (c.shape[0], lev.shape[0])), c, 1)
        else:
            x = _cast(tl.load(cb + c), DOT_FP32, DT)
    elif MAGIC != 0:
        x = (c | MAGIC).to(tl.int16).to(DT, bitcast=True)
    elif DOT_FP32:
        x = (c + SHIFT).to(tl.float32)
    else:
        x = (c + SHIFT).to(DT)
    return x


@triton.jit
def _word_ptr(ptr, sn, WB: tl.constexpr):
    """(pointer to WB-bit words, words per token) of a code tensor with a row stride of sn bytes (24-bit
    and 12-bit words: 32-bit pointer and step, `_words3` assembles them)."""
    if WB == 32 or WB == 24 or WB == 12:
        p = ptr.to(tl.pointer_type(tl.int32))
        step = sn // 4
    elif WB == 16:
        p = ptr.to(tl.pointer_type(tl.int16))
        step = sn // 2
    else:
        p = ptr
        step = sn
    return p, step


@triton.jit
def _words(p, step, tok, ok, W: tl.constexpr, TRANS: tl.constexpr, WB: tl.constexpr):
    """Words [BN, W] of the tokens tok [BN], or [W, BN] when TRANS, as int32 (16-bit words sign-extend; the
    phases mask what they read)."""
    cols = tl.arange(0, W)
    if WB == 24 or WB == 12:
        return _words3(p, step, tok, ok, cols, TRANS, WB)
    if TRANS:
        w = tl.load(p + tok[None, :] * step + cols[:, None], mask=ok[None, :], other=0)
    else:
        w = tl.load(p + tok[:, None] * step + cols[None, :], mask=ok[:, None], other=0)
    return w.to(tl.int32)


@triton.jit
def _words3(p, step, tok, ok, cols, TRANS: tl.constexpr, WB: tl.constexpr):
    """WB-bit words of 3-bit codes (WB 24: 8 codes, the 3 bytes 3w .. 3w + 2 of the row; WB 12: 4 codes, a
    byte and a half) from the one or two 32-bit words each straddles, as int32. Two word loads per word
    instead of byte loads: such words have no load of their own width, and a row of whole 4-byte words stays
    aligned (phase_supported)."""
    bit = cols * WB
    first = bit // 32
    last = (bit + WB - 1) // 32  # == first where the word fits in one 32-bit word: the same word twice
    off = bit % 32
    if TRANS:
        at, m, sh = tok[None, :] * step, ok[None, :], off[:, None]
        lo = tl.load(p + at + first[:, None], mask=m, other=0)
        hi = tl.load(p + at + last[:, None], mask=m, other=0)
    else:
        at, m, sh = tok[:, None] * step, ok[:, None], off[None, :]
        lo = tl.load(p + at + first[None, :], mask=m, other=0)
        hi = tl.load(p + at + last[None, :], mask=m, other=0)
    lo = lo.to(tl.uint32, bitcast=True)
    hi = hi.to(tl.uint32, bitcast=True)
    # hi << (32 - off) in two steps, so that no shift is by 32 (off 0: the high word's bits all leave)
    w = (lo >> sh) | ((hi << 1) << (31 - sh))
    return (w & ((1 << WB) - 1)).to(tl.int32)


@triton.jit
def _token_outlier_scores(oidx, oval, o_sp, codes, c_sn, ks, kz, ks_sn, ks_sc, kcb, pl, q_cols, gh_ok, l0, end,
                          len_b, HAS_PL: tl.constexpr, P: tl.constexpr, BN: tl.constexpr, K_TOK: tl.constexpr,
                          KIND: tl.constexpr, BITS: tl.constexpr, DK: tl.constexpr):
    """[BN, GQ] score corrections of the BN tokens from logical token l0 whose key outliers were chosen
    K_TOK per token: sum over the token's slots of (exact - coded value) * q[channel]. Why a gather: with a
    fixed count per token each token's slots sit at t * K_TOK + j of its page, so the corrections need no
    match of every slot against every row (the one-hot dot of the per-page lists, whose compares and
    shared-memory operands cost more than the rest of nuq4's tile: compiled SASS for sm_90, BENCHMARKS.md).
    q_cols: Q's columns of the kv head's query heads ([1, GQ] pointers)."""
    KP: tl.constexpr = triton.next_power_of_2(K_TOK)
    o = tl.arange(0, BN * KP)
    j = o % KP
    l = l0 + o // KP
    ok = (l < end) & (j < K_TOK)
    if HAS_PL:
        page = tl.load(pl + l // P, mask=ok, other=-1)
        ok = ok & (page >= 0)
        page = tl.maximum(page, 0)
    else:
        page = l // P
    tok = page * P + l % P
    ok = ok & (tok < len_b)
    slot = page * o_sp + (l % P) * K_TOK + j
    d = tl.load(oidx + slot, mask=ok, other=0).to(tl.int32) % DK
    val = tl.load(oval + slot, mask=ok, other=0.0).to(tl.float32)
    coded = _dequant_points(codes, c_sn, ks, kz, ks_sn, ks_sc, kcb, tok, page, d, ok, KIND, BITS, 2, 1, True, DK)
    delta = tl.where(ok, val - coded, 0.0)
    q_at = tl.load(q_cols + d[:, None], mask=ok[:, None] & gh_ok[None, :], other=0.0).to(tl.float32)
    return tl.sum(tl.reshape(q_at * delta[:, None], (BN, KP, q_at.shape[1])), 1)


@triton.jit
def _split2(x):
    """[W, 2M] -> its even and its odd columns, [W, M] each."""
    return tl.split(tl.reshape(x, (x.shape[0], x.shape[1] // 2, 2)))


@triton.jit
def _cols4(x):
    e, o = _split2(x)
    e0, e1 = tl.split(e)
    o0, o1 = tl.split(o)
    return e0, o0, e1, o1


@triton.jit
def _cols8(x):
    e, o = _split2(x)
    a0, a1, a2, a3 = _cols4(e)
    b0, b1, b2, b3 = _cols4(o)
    return a0, b0, a1, b1, a2, b2, a3, b3


@triton.jit
def _by_phase(x, N: tl.constexpr):
    """x [W, N] -> a tuple of its N columns [W] (N = 1, 2, 4 or 8: a word holds at most
    decode_paged_triton.MAX_PHASES codes), by halving splits: no data moves between threads when each thread
    holds whole rows."""
    tl.static_assert(N == 1 or N == 2 or N == 4 or N == 8)
    if N == 1:
        return (tl.reshape(x, (x.shape[0],)),)
    elif N == 2:
        return tl.split(x)
    elif N == 4:
        return _cols4(x)
    else:
        return _cols8(x)


@triton.jit
def _tile_tokens(l, end, pl, len_b, n_sink, row_first, HAS_PL: tl.constexpr, HAS_STARTS: tl.constexpr,
                 P: tl.constexpr):
    """(held position, validity) of the logical tokens l [BN]: through the Quest page list when there is
    one (an empty slot, -1, reads nothing), before the row's end, after its left padding."""
    if HAS_PL:
        page = tl.load(pl + l // P, mask=l < end, other=-1)
        tok = page * P + l % P
        ok = (l < end) & (page >= 0) & (tok < len_b)
    else:
        tok = l
        ok = l < end
    if HAS_STARTS:
        ok = ok & (tok + n_sink >= row_first)
    return tok, ok


@triton.jit
def _fold_scales(q_i, ks_i, kz_i, fix, k_lo, k_step, K_AFFINE: tl.constexpr, K_INT: tl.constexpr,
                 C: tl.constexpr, K_SHIFT: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr):
    """Phase I of a page's key scales and zeros folded into the query: (q * scale as the dot operand
    [WK, GQ], fix + q * zero, the part of every score that does not depend on the codes)."""
    k_s = ks_i.to(tl.float32)
    k_z = kz_i.to(tl.float32)
    if K_AFFINE:  # x = z + s * (lo + step * c) = (z + s * lo) + (s * step) * c
        k_z = k_z + k_s * k_lo
        k_s = k_s * k_step
    qs = q_i * k_s[:, None]
    qd = _cast(qs, DOT_FP32, DT)
    fix += q_i * k_z[:, None]
    if K_INT:
        # codes enter as c + K_SHIFT: (K_SHIFT + C) comes out with the same rounded operand and C goes back
        # unrounded, so the operand's rounding multiplies the centred codes
        fix += C * qs - (K_SHIFT + C) * qd.to(tl.float32)
    return qd, fix


@triton.jit
def _operand(w, I: tl.constexpr, held, ASM_INT: tl.constexpr, ASM_LUT: tl.constexpr, BITS: tl.constexpr,
             PPB: tl.constexpr, MAGIC: tl.constexpr, SHIFT: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr,
             KIND: tl.constexpr, LUT: tl.constexpr, lev, cb, tt):
    """Phase I's dot operand of the word tile w, and `held`: the codes or levels that inline PTX unpacked
    a byte at a time (ASM_INT: int codes, PPB phases per byte; ASM_LUT: 4-bit levels, two per byte), which
    the next phases of the byte take theirs from (pass it back in; 0 before the first phase)."""
    if ASM_INT:
        if I % PPB == 0:
            held = byte_codes(w, I // PPB, BITS, MAGIC, DT)
        x = held[I % PPB]
    elif ASM_LUT:
        if I % 2 == 0:
            held = byte_levels(w, I // 2, tt, DT)
        x = held[I % 2]
    else:
        x = _phase(w, I, BITS, MAGIC, SHIFT, DOT_FP32, DT, KIND, LUT, lev, cb)
    return x, held


@triton.jit
def _value_tile(pT, tok, ok, vs, vz, vs_sn, vc, vc_step, ng, z_acc, accs, alpha_v, vtt, vlev, vcb,
                BN: tl.constexpr, RV: tl.constexpr, NG: tl.constexpr, NGP: tl.constexpr, GQ: tl.constexpr,
                PHV: tl.constexpr, WV: tl.constexpr, V_WB: tl.constexpr, VB: tl.constexpr, BITS: tl.constexpr,
                PPB: tl.constexpr, MAGIC: tl.constexpr, SHIFT: tl.constexpr, C: tl.constexpr, IS_INT: tl.constexpr,
                V_HAS_ZERO: tl.constexpr, V_ASM: tl.constexpr, V_LUT_ASM: tl.constexpr, DOT_FP32: tl.constexpr,
                DT: tl.constexpr, KIND: tl.constexpr, LUT: tl.constexpr):
    """One tile's values into the accumulators (z_acc, accs[I] [WV, RV]; accs scaled by alpha_v first): the
    column (group, head) of a^T is p^T [BN, GQ] times the group's per-token scale."""
    voff = tok[:, None] * vs_sn + ng[None, :]
    vmask = ok[:, None] & (ng < NG)[None, :]
    v_scale = tl.load(vs + voff, mask=vmask, other=0.0).to(tl.float32)
    aT = tl.reshape(pT[:, None, :] * v_scale[:, :, None], (BN, RV))
    ad = _cast(aT, DOT_FP32, DT)
    if V_HAS_ZERO:
        v_zero = tl.load(vz + voff, mask=vmask, other=0.0).to(tl.float32)
        zT = tl.reshape(pT[:, None, :] * v_zero[:, :, None], (BN, RV))
        z_acc += tl.sum(zT, 0)
    if IS_INT:
        z_acc += tl.sum(C * aT - (SHIFT + C) * ad.to(tl.float32), 0)
    vw = _words(vc, vc_step, tok, ok, WV, True, V_WB)  # [WV, BN]
    new = ()
    vbyte = 0
    for I in tl.static_range(PHV):  # int values have the keys' width (VB == BITS)
        vcodes, vbyte = _operand(vw, I, vbyte, V_ASM, V_LUT_ASM, VB, PPB, MAGIC, SHIFT, DOT_FP32, DT, KIND, LUT,
                                 vlev, vcb, vtt)
        acc = accs[I]
        if alpha_v is not None:
            acc = acc * alpha_v[None, :]
        new = new + (_mma(vcodes, ad, acc, DOT_FP32),)
    return z_acc, new


@triton.jit(do_not_specialize=LENGTH_ARGS)
def _phase_split_kernel(
    Q, q_sb, q_sh,
    KC, kc_sb, kc_sh, kc_sn, KS, KZ, ks_sb, ks_sh, ks_sn, ks_sc, KCB, kcb_sh, KOI, KOV, ko_sb, ko_sh, ko_sp,
    VC, vc_sb, vc_sh, vc_sn, VS, VZ, vs_sb, vs_sh, vs_sn, vs_sc, VCB, vcb_sh, VOI, VOV, vo_sb, vo_sh, vo_sp,
    SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
    TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, TLEN,
    LENS, STARTS, n_body, PL, pl_sb, pl_sh, n_sel, tokens_per_split, n_body_splits,
    M_OUT, L_OUT, ACC_OUT, SCORES, sc_sb, sc_sh,
    qk_scale, k_lo, k_step, KLT, klt_sh, VLT, vlt_sh,
    HKV: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
    P: tl.constexpr, BN: tl.constexpr, DBN: tl.constexpr, KIND: tl.constexpr, BITS: tl.constexpr,
    V_GROUP: tl.constexpr, V_HAS_ZERO: tl.constexpr, K_NOUT: tl.constexpr, K_KCP: tl.constexpr,
    OPB: tl.constexpr, LUT: tl.constexpr,
    HAS_LENS: tl.constexpr, HAS_TLEN: tl.constexpr, HAS_STARTS: tl.constexpr, HAS_PL: tl.constexpr,
    WRITE_SCORES: tl.constexpr, DOT_FP32: tl.constexpr, DT: tl.constexpr,
    PHK: tl.constexpr, PHV: tl.constexpr, WK: tl.constexpr, WV: tl.constexpr, K_WB: tl.constexpr,
    V_WB: tl.constexpr, MAGIC: tl.constexpr, SHIFT: tl.constexpr, GQ: tl.constexpr, NGP: tl.constexpr,
    K_AFFINE: tl.constexpr, K_MAGIC: tl.constexpr, K_SHIFT: tl.constexpr, ASM: tl.constexpr,
    K_LUT_ASM: tl.constexpr, V_LUT_ASM: tl.constexpr, LT_OFF: tl.constexpr, K_TOK: tl.constexpr = 0,
    V_BITS: tl.constexpr = 0, SUB: tl.constexpr = 1,
):
    """Grid (B * Hkv, body splits + 1). Partial rows per (b, query head): one per body split, then the exact
    parts (sinks, tail) at n_body_splits. KIND: int (3) or nuq (4); GQ: G rounded up to a power of two;
    NGP: value channel groups (DV / V_GROUP) rounded up so that RV = NGP * GQ >= 8 columns. K_AFFINE: nuq
    keys whose levels are evenly spaced, lo + step * c (k_lo, k_step): decoded as integer codes (K_MAGIC,
    K_SHIFT) with the page scale and zero folded, no level lookup. ASM: codes unpacked by inline PTX
    (unpack_asm_triton; the GPU only, bf16 / fp16 dots): int codes, and with K_LUT_ASM / V_LUT_ASM 4-bit
    levels in place of the shuffle, from KLT / VLT, the codebooks' byte tables (streams.level_tables),
    LT_OFF: their columns for DT. K_TOK: the key outliers were chosen K_TOK per token (outlier_scope "token",
    slot t * K_TOK + j of the token's page): corrected by a gather per token (`_token_outlier_scores`)
    instead of the one-hot dot over the page's list. V_BITS: the nuq values' bits where they differ from the
    keys' (BITS; calibrated mixed configs), 0: the same. SUB: tiles per page (a page of 48 tokens in 3 tiles
    of 16: its folded query, outlier list and online-softmax update once per page), 1: tiles of whole pages
    or of one page."""
    RV: tl.constexpr = NGP * GQ
    NG: tl.constexpr = DV // V_GROUP
    IS_INT: tl.constexpr = KIND == 3
    K_INT: tl.constexpr = IS_INT or K_AFFINE  # keys enter the dots as integer codes
    K_KIND: tl.constexpr = 3 if K_AFFINE else KIND
    C: tl.constexpr = 1 << (BITS - 1)
    PPB: tl.constexpr = 8 // BITS  # codes per byte
    K_ASM: tl.constexpr = ASM and K_INT
    V_ASM: tl.constexpr = ASM and IS_INT
    tl.static_assert(BN % P == 0 or P % BN == 0)  # whole pages, or a part of one page (OPB 1)
    tl.static_assert(SUB == 1 or SUB * BN == P)
    VB: tl.constexpr = BITS if V_BITS == 0 else V_BITS  # nuq values may be coded at other bits than the keys
    tl.static_assert(not ASM or BITS != 3)  # the inline PTX unpacks whole bytes of codes
    tl.static_assert(VB == BITS or not IS_INT)
    pid_bh = tl.program_id(0)
    split = tl.program_id(1)
    NS = n_body_splits + 1
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
                     M_OUT, L_OUT, ACC_OUT, b, h, row_first, NS, n_body_splits, qk_scale,
                     HKV, G, GP, DK, DV, DBN, WRITE_SCORES, DOT_FP32, DT)
    else:
        kc_bytes = KC + b64 * kc_sb + h * kc_sh
        kc, kc_step = _word_ptr(kc_bytes, kc_sn, K_WB)
        vc, vc_step = _word_ptr(VC + b64 * vc_sb + h * vc_sh, vc_sn, V_WB)
        ks = KS + b64 * ks_sb + h * ks_sh
        kz = KZ + b64 * ks_sb + h * ks_sh
        vs = VS + b64 * vs_sb + h * vs_sh
        vz = VZ + b64 * vs_sb + h * vs_sh
        kcb = KCB + h * kcb_sh
        vcb = VCB + h * vcb_sh
        pl = PL + b64 * pl_sb + h * pl_sh
        len_b, n_logical = _body_extent(LENS, b, n_body, n_sel, HAS_LENS, HAS_PL, P)
        gh = tl.arange(0, GQ)
        gh_ok = gh < G
        q_cols = Q + b64 * q_sb + (h * G + gh)[None, :] * q_sh  # q^T: head g is column g
        sc_cols = SCORES + b64 * sc_sb + (h * G + gh)[None, :] * sc_sh
        # value columns (channel group, head)
        rv = tl.arange(0, RV)
        rv_grp = rv // GQ
        rv_ok = ((rv % GQ) < G) & (rv_grp < NG)
        ng = tl.arange(0, NGP)
        wk = tl.arange(0, WK)
        k_rows = wk[:, None] * PHK + tl.arange(0, PHK)[None, :]  # a page's key channels as [word, phase]
        wv = tl.arange(0, WV)
        t = tl.arange(0, BN)
        # the query by phase, q^T [WK, GQ] each (loaded once)
        qph = ()
        for I in tl.static_range(PHK):
            qi = tl.load(q_cols + (wk * PHK + I)[:, None], mask=gh_ok[None, :], other=0.0)
            qph = qph + (qi.to(tl.float32),)
        if KIND == 4 and LUT == 0:  # nuq levels in registers
            vlev = _levels(vcb, 1 << VB, DT)
        elif KIND == 4 and LUT == 2:
            vlev = tl.load(vcb + tl.arange(0, 1 << VB)).to(DT)
        else:
            vlev = 0
        if K_KIND == 4 and LUT == 0:
            klev = _levels(kcb, 1 << BITS, DT)
        elif K_KIND == 4 and LUT == 2:
            klev = tl.load(kcb + tl.arange(0, 1 << BITS)).to(DT)
        else:
            klev = 0
        ktt = 0
        if K_LUT_ASM:
            ktt = table_tiles(KLT + h * klt_sh + LT_OFF, BN, WK)
        vtt = 0
        if V_LUT_ASM:
            vtt = table_tiles(VLT + h * vlt_sh + LT_OFF, WV, BN)
        m_i = tl.full([GQ], NEG_BIG, tl.float32)
        l_i = tl.zeros([GQ], tl.float32)
        z_acc = tl.zeros([RV], tl.float32)  # added to every channel of the column (value zeros, SHIFT)
        accs = ()
        for I in tl.static_range(PHV):
            accs = accs + (tl.zeros([WV, RV], tl.float32),)
        start = split * tokens_per_split
        end = tl.minimum(start + tokens_per_split, n_logical)
        for l0 in range(start, end, BN * SUB):
            if SUB == 1:  # tiles of whole pages, or of one page
                tok, ok = _tile_tokens(l0 + t, end, pl, len_b, n_sink, row_first, HAS_PL, HAS_STARTS, P)
                # -- the exact key outliers' corrections first: their chains of dependent loads (slot -> channel ->
                # code, page range, query) then run under the dense work of the tile instead of after it
                corr = 0.0
                if K_TOK > 0:  # exact key outliers, K_TOK per token: (exact - coded) . q gathered per token
                    corr = _token_outlier_scores(
                        KOI + b64 * ko_sb + h * ko_sh, KOV + b64 * ko_sb + h * ko_sh, ko_sp, kc_bytes, kc_sn, ks, kz,
                        ks_sn, ks_sc, kcb, pl, q_cols, gh_ok, l0, end, len_b, HAS_PL, P, BN, K_TOK, KIND, BITS, DK)
                elif K_NOUT > 0:  # exact key outliers: (exact - coded) . q, one sparse one-hot dot per tile
                    r, d_o, delta, o_ok = _outlier_deltas(
                        KOI + b64 * ko_sb + h * ko_sh, KOV + b64 * ko_sb + h * ko_sh, ko_sp, kc_bytes, kc_sn, ks,
                        kz, ks_sn, ks_sc, kcb, pl, l0, n_logical, len_b, HAS_PL, P, BN, OPB, K_KCP, K_NOUT, KIND,
                        BITS, 2, 1, True, DK)
                    q_at = tl.load(q_cols + d_o[:, None], mask=o_ok[:, None] & gh_ok[None, :], other=0.0)
                    qd_o = q_at.to(tl.float32) * delta[:, None]  # [OPB * KCP, GQ]
                    hit = (t[:, None] == r[None, :]) & o_ok[None, :]  # [BN, OPB * KCP]
                    corr = _dot(_cast(hit.to(tl.float32), DOT_FP32, DT), _cast(qd_o, DOT_FP32, DT), DOT_FP32)
                # -- scores^T [BN, GQ], a page at a time (each folds its own key scales into the query)
                kw = _words(kc, kc_step, tok, ok, WK, False, K_WB)  # [BN, WK]
                sT = tl.zeros([BN, GQ], tl.float32)
                for j in tl.static_range(OPB):
                    if HAS_PL:  # an empty slot (-1) reads page 0's scales: its tokens are masked out (ok)
                        kpage = tl.maximum(tl.load(pl + l0 // P + j, mask=l0 + j * P < end, other=0), 0)
                    else:
                        kpage = l0 // P + j
                    part = tl.zeros([BN, GQ], tl.float32)
                    fix = tl.zeros([WK, GQ], tl.float32)
                    # the page's key scales and zeros: one [WK, PHK] load each (channel w * PHK + I at [w, I]), split
                    # by phase in registers. Loaded phase by phase ([WK] each), they were 2 * PHK small loads that the
                    # loop waited on: int4 1.18x -> 1.36x bf16 SDPA at 32K x 8, nuq4 0.68x -> 0.74x (H200)
                    ks_ph = _by_phase(tl.load(ks + kpage * ks_sn + k_rows), PHK)
                    kz_ph = _by_phase(tl.load(kz + kpage * ks_sn + k_rows), PHK)
                    kbyte = 0
                    for I in tl.static_range(PHK):
                        qd, fix = _fold_scales(qph[I], ks_ph[I], kz_ph[I], fix, k_lo, k_step, K_AFFINE, K_INT, C,
                                               K_SHIFT, DOT_FP32, DT)
                        codes, kbyte = _operand(kw, I, kbyte, K_ASM, K_LUT_ASM, BITS, PPB, K_MAGIC, K_SHIFT,
                                                DOT_FP32, DT, K_KIND, LUT, klev, kcb, ktt)
                        part = _mma(codes, qd, part, DOT_FP32)
                    sT = tl.where(((t // P) == j)[:, None], part + tl.sum(fix, 0)[None, :], sT)
                if K_TOK > 0 or K_NOUT > 0:
                    sT += corr
                valid = ok[:, None] & gh_ok[None, :]
                sT = tl.where(valid, sT * qk_scale, float("-inf"))
                if WRITE_SCORES:
                    tl.store(sc_cols + n_sink + tok[:, None], sT, mask=valid)
                # -- online softmax (per head column)
                m_new = tl.maximum(m_i, tl.max(sT, 0))
                alpha = tl.exp2(m_i - m_new)
                pT = tl.exp2(sT - m_new[None, :])
                l_i = l_i * alpha + tl.sum(pT, 0)
                alpha_v = tl.reshape(tl.broadcast_to(alpha[None, :], (NGP, GQ)), (RV,))
                z_acc, accs = _value_tile(
                    pT, tok, ok, vs, vz, vs_sn, vc, vc_step, ng, z_acc * alpha_v, accs, alpha_v, vtt, vlev, vcb,
                    BN, RV, NG, NGP, GQ, PHV, WV, V_WB, VB, BITS, PPB, MAGIC, SHIFT, C, IS_INT, V_HAS_ZERO, V_ASM,
                    V_LUT_ASM, DOT_FP32, DT, KIND, LUT)
                m_i = m_new
            else:  # a page of P = SUB * BN tokens (P not a power of two) in SUB tiles of BN
                # the page's folded query and exact key outliers once per page, one online-softmax update
                if HAS_PL:  # an empty slot (-1) reads page 0's scales: its tokens are masked out (ok)
                    kpage = tl.maximum(tl.load(pl + l0 // P), 0)
                else:
                    kpage = l0 // P
                ks_ph = _by_phase(tl.load(ks + kpage * ks_sn + k_rows), PHK)
                kz_ph = _by_phase(tl.load(kz + kpage * ks_sn + k_rows), PHK)
                qds = ()
                fix = tl.zeros([WK, GQ], tl.float32)
                for I in tl.static_range(PHK):
                    qd, fix = _fold_scales(qph[I], ks_ph[I], kz_ph[I], fix, k_lo, k_step, K_AFFINE, K_INT, C, K_SHIFT,
                                           DOT_FP32, DT)
                    qds = qds + (qd,)
                fix_row = tl.sum(fix, 0)[None, :]
                if K_TOK == 0 and K_NOUT > 0:  # the page's outlier list, matched against each tile's rows
                    r, d_o, delta, o_ok = _outlier_deltas(
                        KOI + b64 * ko_sb + h * ko_sh, KOV + b64 * ko_sb + h * ko_sh, ko_sp, kc_bytes, kc_sn, ks,
                        kz, ks_sn, ks_sc, kcb, pl, l0, n_logical, len_b, HAS_PL, P, P, 1, K_KCP, K_NOUT, KIND,
                        BITS, 2, 1, True, DK)
                    q_at = tl.load(q_cols + d_o[:, None], mask=o_ok[:, None] & gh_ok[None, :], other=0.0)
                    qd_o = _cast(q_at.to(tl.float32) * delta[:, None], DOT_FP32, DT)  # [KCP, GQ]
                sTs = ()
                toks = ()
                oks = ()
                m_new = m_i
                for sub in tl.static_range(SUB):
                    tok, ok = _tile_tokens(l0 + sub * BN + t, end, pl, len_b, n_sink, row_first, HAS_PL, HAS_STARTS, P)
                    kw = _words(kc, kc_step, tok, ok, WK, False, K_WB)  # [BN, WK]
                    part = tl.zeros([BN, GQ], tl.float32)
                    kbyte = 0
                    for I in tl.static_range(PHK):
                        codes, kbyte = _operand(kw, I, kbyte, K_ASM, K_LUT_ASM, BITS, PPB, K_MAGIC, K_SHIFT,
                                                DOT_FP32, DT, K_KIND, LUT, klev, kcb, ktt)
                        part = _mma(codes, qds[I], part, DOT_FP32)
                    sT = part + fix_row
                    if K_TOK > 0:
                        sT += _token_outlier_scores(
                            KOI + b64 * ko_sb + h * ko_sh, KOV + b64 * ko_sb + h * ko_sh, ko_sp, kc_bytes, kc_sn,
                            ks, kz, ks_sn, ks_sc, kcb, pl, q_cols, gh_ok, l0 + sub * BN, end, len_b, HAS_PL, P, BN,
                            K_TOK, KIND, BITS, DK)
                    elif K_NOUT > 0:
                        hit = ((t + sub * BN)[:, None] == r[None, :]) & o_ok[None, :]  # [BN, KCP]
                        sT += _dot(_cast(hit.to(tl.float32), DOT_FP32, DT), qd_o, DOT_FP32)
                    valid = ok[:, None] & gh_ok[None, :]
                    sT = tl.where(valid, sT * qk_scale, float("-inf"))
                    if WRITE_SCORES:
                        tl.store(sc_cols + n_sink + tok[:, None], sT, mask=valid)
                    m_new = tl.maximum(m_new, tl.max(sT, 0))
                    sTs = sTs + (sT,)
                    toks = toks + (tok,)
                    oks = oks + (ok,)
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha
                alpha_v = tl.reshape(tl.broadcast_to(alpha[None, :], (NGP, GQ)), (RV,))
                z_acc = z_acc * alpha_v
                scaled = ()
                for I in tl.static_range(PHV):
                    scaled = scaled + (accs[I] * alpha_v[None, :],)
                accs = scaled
                for sub in tl.static_range(SUB):
                    pT = tl.exp2(sTs[sub] - m_new[None, :])
                    l_i += tl.sum(pT, 0)
                    z_acc, accs = _value_tile(
                        pT, toks[sub], oks[sub], vs, vz, vs_sn, vc, vc_step, ng, z_acc, accs, None, vtt, vlev,
                        vcb, BN, RV, NG, NGP, GQ, PHV, WV, V_WB, VB, BITS, PPB, MAGIC, SHIFT, C, IS_INT,
                        V_HAS_ZERO, V_ASM, V_LUT_ASM, DOT_FP32, DT, KIND, LUT)
                m_i = m_new
        out_g = (b * HKV * G + h * G + gh) * NS + split
        tl.store(M_OUT + out_g, m_i, mask=gh_ok)
        tl.store(L_OUT + out_g, l_i, mask=gh_ok)
        out_v = (b * HKV * G + h * G + rv % GQ) * NS + split
        for I in tl.static_range(PHV):
            ch = wv * PHV + I
            mine = rv_ok[None, :] & ((ch // V_GROUP)[:, None] == rv_grp[None, :])
            tl.store(ACC_OUT + out_v[None, :] * DV + ch[:, None], accs[I] + z_acc[None, :], mask=mine)
