"""The split merge of the fused decode attention with the exact parts (sinks, then tail) attended in the
same launch, for body kernels that leave them out (decode_fp8_triton's BODY_ONLY).

Why: in the fp8 body kernel the exact parts' code sat beside the body's, and the compiled kernel held
the registers and shared memory of both (255 registers, 36.9 KB at one warp, against 168 and 21 KB
without), so fewer programs fit on a multiprocessor; a launch of their own costs as much again in host
time per step as the whole kernel. The merge is launched anyway, so it takes them. Torch twin: the
exact parts and the merge of `decode_attention_torch`.

The merge can run as a programmatic dependent launch of the body (`PDL`): its programs are launched
while the body runs, attend over the exact parts and wait for the body only to read the partial rows.
In an fp8 step at 32K x 8 the body took 135 us and body plus merge 143 us, while the merge alone took
1.3 us above an empty graph's replay (H200, BENCHMARKS.md): the merge's cost is its launch and its
chain of dependent loads after the body, which PDL overlaps.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from kvcompress.kernels.decode_attention_triton import NEG_BIG, _cast, _merge_splits, _sinks_then_tail


@triton.jit
def _exact_reduce_row(
    row, Q, q_sb, q_sh,
    SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
    TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, TLEN, STARTS, n_body,
    SCORES, sc_sb, sc_sh, M_IN, L_IN, ACC_IN, n_body_splits, n_splits, OUT, LSE, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DBN: tl.constexpr,
    SB: tl.constexpr, HAS_TLEN: tl.constexpr, HAS_STARTS: tl.constexpr, WRITE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr,
):
    """Query head row = b * Hq + j of kv head j // G: attends over its kv head's sinks and tail (a tile of
    16 query rows of which only the first is real: the dots need 16), then merges the result with the
    n_body_splits partial rows (m, l, acc) at row * n_splits + s; writes out [B, Hq, DV] and lse (base 2)
    [B, Hq]. Scores of the exact positions go to SCORES when WRITE_SCORES. PDL: wait for the launch before
    (the body) only to read its partial rows."""
    b = row // (HKV * G)
    j = row % (HKV * G)
    h = j // G
    b64 = b.to(tl.int64)
    if HAS_STARTS:
        row_first = tl.load(STARTS + b).to(tl.int32)
    else:
        row_first = 0
    if HAS_TLEN:
        n_tail = tl.load(TLEN).to(tl.int32)
    g = tl.arange(0, 16)
    g_ok = g < 1
    dk = tl.arange(0, DK)
    q = tl.load(Q + b64 * q_sb + (j + g)[:, None] * q_sh + dk[None, :], mask=g_ok[:, None], other=0.0)
    m_e = tl.full([16], NEG_BIG, tl.float32)
    l_e = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, DV], tl.float32)
    m_e, l_e, acc = _sinks_then_tail(
        m_e, l_e, acc, _cast(q.to(tl.float32), DOT_FP32, DT), SK + b64 * sk_sb + h * sk_sh,
        SV + b64 * sv_sb + h * sv_sh, sk_sn, sv_sn, n_sink,
        TK + b64 * tk_sb + h * tk_sh, TV + b64 * tv_sb + h * tv_sh, tk_sn, tv_sn, n_tail, n_body, row_first,
        SCORES + b64 * sc_sb + (j + g)[:, None] * sc_sh, g_ok, qk_scale, WRITE_SCORES, DBN, DK, DV, DOT_FP32,
        DT)
    m0 = tl.max(tl.where(g_ok, m_e, NEG_BIG), 0)
    l0 = tl.sum(tl.where(g_ok, l_e, 0.0), 0)
    a0 = tl.sum(tl.where(g_ok[:, None], acc, 0.0), 0)
    if PDL:
        gdc_wait()
    _merge_splits(M_IN, L_IN, ACC_IN, OUT, LSE, row, n_body_splits, n_splits, m0, l0, a0, DV, SB)


@triton.jit(do_not_specialize=("n_sink", "n_tail", "n_body", "n_body_splits", "n_splits"))
def _exact_reduce_kernel(
    Q, q_sb, q_sh,
    SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
    TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, TLEN, STARTS, n_body,
    SCORES, sc_sb, sc_sh, M_IN, L_IN, ACC_IN, n_body_splits, n_splits, OUT, LSE, qk_scale,
    HKV: tl.constexpr, G: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, DBN: tl.constexpr,
    SB: tl.constexpr, HAS_TLEN: tl.constexpr, HAS_STARTS: tl.constexpr, WRITE_SCORES: tl.constexpr,
    DOT_FP32: tl.constexpr, DT: tl.constexpr, PDL: tl.constexpr = False,
):
    """Grid (B * Hq,): `_exact_reduce_row` of each query head."""
    _exact_reduce_row(
        tl.program_id(0), Q, q_sb, q_sh, SK, sk_sb, sk_sh, sk_sn, SV, sv_sb, sv_sh, sv_sn, n_sink,
        TK, tk_sb, tk_sh, tk_sn, TV, tv_sb, tv_sh, tv_sn, n_tail, TLEN, STARTS, n_body,
        SCORES, sc_sb, sc_sh, M_IN, L_IN, ACC_IN, n_body_splits, n_splits, OUT, LSE, qk_scale,
        HKV, G, DK, DV, DBN, SB, HAS_TLEN, HAS_STARTS, WRITE_SCORES, DOT_FP32, DT, PDL)
