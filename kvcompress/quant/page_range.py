"""Scales in one byte: a page's per-channel key range [lo, hi] stored as x = u * scale + zero, u in
[-1, 1] (the form the fused kernels read), and per-token scales, in fp16 (2 bytes each) or FP8 e4m3 / e5m2
(1 byte each). FP8 scales are held as their uint8 bit patterns, as FP8 codes are (torch's CPU gather and
index_select, which eviction and beam reordering use, do not take FP8 dtypes); `as_float8` views them back
for decoding and for the kernels, which load the FP8 dtype and convert it to float32.

For a page range in FP8 the zero is rounded to the nearest FP8 value first, then the scale is the
half-width that reaches both ends from that zero, rounded to the nearest FP8 value. Rounding the scale to
nearest can leave the page's extreme element outside [zero - scale, zero + scale] by at most half an FP8
step of the scale (3 % of it in e4m3, a quarter of a 4-bit code step); it is then clipped to the range end,
an error no larger than a code's own rounding. Rounding the scale up instead keeps every element inside but
widens every step: on the 4-bit SQNR test data (pages of 32, 1 % outliers) up gives 22.16 dB, nearest
22.78 dB, fp16 ranges 22.92 dB. On SmolLM2's keys (2048 tokens) e4m3's rounding of the zero widens the
half-width by 1.3 % on average and 11 % at the 99th percentile: page zeros lie within 4 half-widths of 0
for 99 % of the (page, channel) ranges, so the zero's relative error stays small against the range. FP8
has no infinity here (e4m3 tops out at 448, e5m2 at 57344), so zero and scale saturate there and larger
keys are clipped (and are the first candidates for the exact outliers).
"""

from __future__ import annotations

import warnings

import torch

FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
ZERO_TOKEN = 1e-6  # the floor callers clamp a per-token scale to: the scale of an all-zero token
_warned = False


def page_range(lo: torch.Tensor, hi: torch.Tensor, fmt: str,
               check: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """lo, hi [..., D] float32 -> (scale, zero) in the storage format ("fp16", "e4m3" or "e5m2").

    check: warn (once per process) when an FP8 range saturates. The check reads a result back to the
    host, which stalls a GPU decode loop, so a codec checks its first encode only (the prefill's pages,
    where a model's key range shows)."""
    if fmt == "fp16":
        scale = ((hi - lo) / 2).clamp_min(1e-5).to(torch.float16)
        zero = ((hi + lo) / 2).to(torch.float16)
        return scale, zero
    dtype = _fp8(fmt)
    fmax = torch.finfo(dtype).max
    mid = (hi + lo) / 2
    zero = mid.clamp(-fmax, fmax).to(dtype)
    zf = zero.float()
    need = torch.maximum(hi - zf, zf - lo).clamp_min(1e-5)
    if check and not _warned and need.numel() and (mid.abs().amax() > fmax or need.amax() > fmax):
        _warn_clipped(float(torch.maximum(hi.abs(), lo.abs()).amax()), fmt, fmax)
    return need.clamp(max=fmax).to(dtype), zero


def token_scale(scale: torch.Tensor, fmt: str, check: bool = False) -> torch.Tensor:
    """Positive per-token scales (float32) -> the storage format, rounded to nearest (the codes are then
    taken against the stored scale, so its rounding only stretches the grid by up to half an FP8 step).
    FP8 scales are clamped to the format's normal range (e4m3: 2^-6 .. 448; e5m2: 2^-14 .. 57344); check:
    warn (once per process) when some are, as `page_range` does for key ranges."""
    if fmt == "fp16":
        return scale.to(torch.float16)
    dtype = _fp8(fmt)
    tiny, fmax = torch.finfo(dtype).smallest_normal, torch.finfo(dtype).max
    if check and not _warned:
        live = scale.detach()[scale > ZERO_TOKEN]  # all-zero tokens (padding) aside
        lo, hi = (float(live.amin()), float(live.amax())) if live.numel() else (tiny, fmax)
        if lo < tiny or hi > fmax:
            _warn(f"per-token scales reach {lo:.3g} .. {hi:.3g}, outside {fmt}'s normal range [{tiny:g}, "
                  f"{fmax:g}]: they are clamped, so those tokens lose precision. Use scale_format='fp16' (or "
                  f"'e5m2', whose range is wider) for this model's values.")
    return scale.clamp(tiny, fmax).to(dtype)


def as_stored(t: torch.Tensor) -> torch.Tensor:
    """A scale tensor as the store holds it: FP8 as its uint8 bit patterns, fp16 as it is."""
    return t.view(torch.uint8) if t.dtype in FP8.values() else t


def as_float8(t: torch.Tensor, fmt: str) -> torch.Tensor:
    """A stored scale tensor in its real dtype (a view, no copy): uint8 bit patterns -> FP8 `fmt`."""
    return t.view(_fp8(fmt)) if fmt != "fp16" else t


def _fp8(fmt: str) -> torch.dtype:
    if fmt not in FP8:
        raise ValueError(f"unknown scale format {fmt!r}; use 'fp16', 'e4m3' or 'e5m2'")
    return FP8[fmt]


def _warn_clipped(amax: float, fmt: str, fmax: float) -> None:
    _warn(f"keys reach |x| = {amax:.1f}, beyond what {fmt} page ranges hold (zero and scale up to "
          f"{fmax:g}): the largest are clipped. Use scale_format='fp16' for this model's keys.")


def _warn(message: str) -> None:
    global _warned
    if not _warned:
        _warned = True
        warnings.warn(message, stacklevel=4)
