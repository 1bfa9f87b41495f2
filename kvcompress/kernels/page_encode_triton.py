"""Triton page encoders (twin: the codecs' own `encode`); one program per (batch, head, page).

Bit-exact with the torch codecs: IEEE division (div_rn), round-half-even, no fused multiply-add
(launched with enable_fp_fusion=False), the same fp16 rounding of scales and the same one-ulp widening.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvcompress.quant.pack import packed_width

RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (y + M) - M rounds |y| < 2**22 to the nearest integer, ties to even


@triton.jit
def _round_to_fp8_grid(y, MANT: tl.constexpr, EMIN: tl.constexpr):
    """Round to the nearest fp8 value (ties to even) in fp32, so the final conversion is exact everywhere
    (Triton's interpreter drops the exponent carry when its own conversion rounds up a binade). The
    rounding is done on |y| and the sign put back by its bit: a negative y that rounds to zero stays
    -0.0, as torch's conversion keeps it (0x80, not 0x00: the one difference measured on an H200)."""
    bits = y.to(tl.int32, bitcast=True)
    e = ((bits >> 23) & 0xFF) - 127  # exponent of |y| (y = 0 gives -127)
    ulp_e = tl.maximum(e, EMIN) - MANT
    ulp = ((ulp_e + 127) << 23).to(tl.float32, bitcast=True)
    r = ((tl.abs(y) / ulp + RNE_MAGIC) - RNE_MAGIC) * ulp  # |y| / ulp is exact (power of two)
    return (r.to(tl.int32, bitcast=True) | ((bits >> 31) << 31)).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_page_kernel(X, x_sb, x_sh, x_sn, C, c_sb, c_sh, c_sn, S, s_sb, s_sh, s_sn, H: tl.constexpr,
                     P: tl.constexpr, D: tl.constexpr, FMAX: tl.constexpr, E5M2: tl.constexpr,
                     MANT: tl.constexpr, EMIN: tl.constexpr):
    bh = tl.program_id(0)
    b = (bh // H).to(tl.int64)
    h = bh % H
    t = tl.program_id(1) * P + tl.arange(0, P)
    d = tl.arange(0, D)
    x = tl.load(X + b * x_sb + h * x_sh + t[:, None] * x_sn + d[None, :]).to(tl.float32)  # [P, D]
    amax = tl.max(tl.abs(x), 1)
    scale = tl.maximum(tl.math.div_rn(amax, tl.full([P], FMAX, tl.float32)), 1e-7).to(tl.float16)
    sf = scale.to(tl.float32)
    y = tl.math.div_rn(x, tl.broadcast_to(sf[:, None], [P, D]))
    y = _round_to_fp8_grid(tl.minimum(tl.maximum(y, -FMAX), FMAX), MANT, EMIN)
    if E5M2:
        code = y.to(tl.float8e5).to(tl.uint8, bitcast=True)
    else:
        code = y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    tl.store(C + b * c_sb + h * c_sh + t[:, None] * c_sn + d[None, :], code)
    tl.store(S + b * s_sb + h * s_sh + t * s_sn, scale)


@triton.jit
def _pack_rows(c, R: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr, CPB: tl.constexpr):
    """codes [R, GS] -> bytes [R, GS * BITS // 8] (CPB = 8 // BITS little-endian codes per byte)."""
    if CPB == 1:
        out = c
    else:
        c3 = tl.reshape(c, [R, GS // CPB, CPB])
        shifts = (tl.arange(0, CPB) * BITS)[None, None, :]
        out = tl.sum(c3 << shifts, 2)
    return out.to(tl.uint8)


@triton.jit
def _int_page_kernel(X, x_sb, x_sh, x_sn, C, c_sb, c_sh, c_sn, S, Z, s_sb, s_sh, s_sn, H: tl.constexpr,
                     P: tl.constexpr, D: tl.constexpr, GS: tl.constexpr, BITS: tl.constexpr,
                     CHANNEL: tl.constexpr, LEVELS: tl.constexpr, NG: tl.constexpr, R: tl.constexpr,
                     CPB: tl.constexpr, WB: tl.constexpr):
    """R = P * NG rows (token, group of GS channels), LEVELS = 2**BITS - 1, WB = GS * BITS // 8 bytes a row."""
    bh = tl.program_id(0)
    page = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = bh % H
    r = tl.arange(0, R)
    c = tl.arange(0, GS)
    tok = page * P + r // NG
    col = (r % NG)[:, None] * GS + c[None, :]
    x = tl.load(X + b * x_sb + h * x_sh + tok[:, None] * x_sn + col).to(tl.float32)  # [R, GS]
    if CHANNEL:  # statistics per channel over the page's tokens
        mn = tl.min(x, 0)[None, :]
        mx = tl.max(x, 0)[None, :]
    else:  # per token, per group of GS channels
        mn = tl.min(x, 1)[:, None]
        mx = tl.max(x, 1)[:, None]
    zero = mn.to(tl.float16)
    zf = zero.to(tl.float32)
    scale = tl.maximum(tl.math.div_rn(mx - zf, tl.full(mx.shape, LEVELS, tl.float32)), 1e-6).to(tl.float16)
    # fp16 rounding may shrink the range: widen by one ulp (scales are positive: next bit pattern up)
    short = zf + scale.to(tl.float32) * LEVELS < mx
    scale = tl.where(short, (scale.to(tl.int16, bitcast=True) + 1).to(tl.int16).to(tl.float16, bitcast=True), scale)
    y = tl.math.div_rn(x - zf, tl.broadcast_to(scale.to(tl.float32), [R, GS]))
    y = (y + RNE_MAGIC) - RNE_MAGIC
    code = tl.minimum(tl.maximum(y, 0.0), LEVELS).to(tl.int32)
    packed = _pack_rows(code, R, GS, BITS, CPB)  # [R, WB]
    wb = tl.arange(0, WB)
    tl.store(C + b * c_sb + h * c_sh + tok[:, None] * c_sn + (r % NG)[:, None] * WB + wb[None, :],
             packed)
    if CHANNEL:
        s_off = b * s_sb + h * s_sh + page * s_sn + tl.arange(0, GS)[None, :]
    else:
        s_off = b * s_sb + h * s_sh + tok[:, None] * s_sn + (r % NG)[:, None]
    tl.store(S + s_off, scale)
    tl.store(Z + s_off, zero)


def _pages(codec, x):
    b, h, n, d = x.shape
    if n % codec.page_size:
        raise ValueError(f"encode takes whole pages of {codec.page_size} tokens, got {n}")
    return b, h, n, d, n // codec.page_size


def encode_fp8(codec, x: torch.Tensor) -> dict[str, torch.Tensor]:
    b, h, n, d, pages = _pages(codec, x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    codes = torch.empty(b, h, n, d, dtype=torch.uint8, device=x.device)
    scale = torch.empty(b, h, n, 1, dtype=torch.float16, device=x.device)
    if pages:
        _fp8_page_kernel[(b * h, pages)](
            x, x.stride(0), x.stride(1), x.stride(2), codes, codes.stride(0), codes.stride(1), codes.stride(2),
            scale, scale.stride(0), scale.stride(1), scale.stride(2), H=h, P=codec.page_size, D=d,
            FMAX=codec.fmax, E5M2=codec.fmt == "e5m2", MANT=2 if codec.fmt == "e5m2" else 3,
            EMIN=-14 if codec.fmt == "e5m2" else -6, enable_fp_fusion=False,
        )
    return {"codes": codes, "scale": scale}


def encode_uniform(codec, x: torch.Tensor) -> dict[str, torch.Tensor]:
    b, h, n, d, pages = _pages(codec, x)
    x = x if x.stride(-1) == 1 else x.contiguous()
    channel = codec.axis == "channel"
    gs = d if channel else codec.group
    codes = torch.empty(b, h, n, packed_width(d, codec.nbits), dtype=torch.uint8, device=x.device)
    stat_shape = (b, h, pages, d) if channel else (b, h, n, d // gs)
    scale = torch.empty(stat_shape, dtype=torch.float16, device=x.device)
    zero = torch.empty_like(scale)
    if pages:
        _int_page_kernel[(b * h, pages)](
            x, x.stride(0), x.stride(1), x.stride(2), codes, codes.stride(0), codes.stride(1), codes.stride(2),
            scale, zero, scale.stride(0), scale.stride(1), scale.stride(2), H=h, P=codec.page_size, D=d, GS=gs,
            BITS=codec.nbits, CHANNEL=channel, LEVELS=2**codec.nbits - 1, NG=d // gs, R=codec.page_size * (d // gs),
            CPB=8 // codec.nbits, WB=gs * codec.nbits // 8, enable_fp_fusion=False,
        )
    return {"codes": codes, "scale": scale, "zero": zero}
