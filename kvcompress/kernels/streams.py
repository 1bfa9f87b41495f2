"""How the fused kernels address one packed stream: its codec turned into pointers, strides and constants.

Every supported codec dequantizes as  x = value(code) * scale + zero,  where value() is the identity
(int), a codebook lookup (nuq), an fp8 bit pattern (fp8) or the stored element itself (no codec), and
scale / zero are read per token (optionally per group of channels), per page and channel, per row and
channel, or per head. Outliers (nuq) are a per-page list of (position t*D + d, exact value).
No Triton here: this module is plain torch so the CPU path can ask what the kernel supports.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.quant.base import Codec
from kvcompress.quant.fp8 import Fp8Codec
from kvcompress.quant.identity import IdentityCodec
from kvcompress.quant.nuq import NuqCodec
from kvcompress.quant.uniform import UniformCodec

# value(code)
KIND_DENSE, KIND_FP8E4, KIND_FP8E5, KIND_INT, KIND_NUQ = 0, 1, 2, 3, 4
# nuq page keys with a width per channel (NuqCodec.channel_widths): the codebook slot holds width_table()
KIND_NUQ_WIDTHS = 5
# where scale / zero are read
SCALE_NONE, SCALE_TOKEN, SCALE_PAGE, SCALE_ROW, SCALE_HEAD = 0, 1, 2, 3, 4


def stream_supported(codec: Codec) -> bool:
    if isinstance(codec, NuqCodec):
        return codec.codebook.dim() in (1, 2)
    if isinstance(codec, Fp8Codec) and codec.channel_shift is not None:
        return codec.static_scale is not None  # a shift with per-token scales: no kernel reads it
    return isinstance(codec, (Fp8Codec, IdentityCodec, UniformCodec))


@dataclass
class StreamArgs:
    """Kernel arguments of one stream. Tensors are views of the stored ones (nothing is copied per step,
    except shared codec tensors moved once to the data's device)."""

    codes: torch.Tensor  # [B, H, N, W] uint8 (packed / fp8 bits) or [B, H, N, D] model dtype
    scale: torch.Tensor
    zero: torch.Tensor
    scale_strides: tuple[int, int, int, int]  # batch, head, token-or-page, channel-or-group
    codebook: torch.Tensor  # [L] or [H, L] float32
    codebook_head_stride: int
    outlier_idx: torch.Tensor  # [B, H, n_pages, k]
    outlier_val: torch.Tensor
    kind: int
    bits: int
    scale_at: int
    group: int
    has_zero: bool
    n_outliers: int
    rotation_signs: torch.Tensor | None
    # nuq levels evenly spaced (the page-range keys' default codebook): level(c) = lo + step * c, so a
    # kernel may decode them as integers (no lookup); None otherwise
    affine_levels: tuple[float, float] | None = None


def stream_args(codec: Codec, data: dict[str, torch.Tensor], row: dict[str, torch.Tensor]) -> StreamArgs:
    if not stream_supported(codec):
        raise NotImplementedError(
            f"the fused decode kernel does not read {type(codec).__name__} streams; "
            "use KVCOMPRESS_KERNELS=torch (or decode_attention, which falls back for such codecs)"
        )
    d = codec.head_dim
    codes = data["codes"] if "codes" in data else data["data"]
    device = codes.device
    none = codes  # placeholder pointer for absent tensors: never read (guarded by constants)
    a = dict(
        codes=codes, scale=none, zero=none, scale_strides=(0, 0, 0, 0), codebook=none, codebook_head_stride=0,
        outlier_idx=none, outlier_val=none, kind=KIND_DENSE, bits=8, scale_at=SCALE_NONE, group=d,
        has_zero=False, n_outliers=0, rotation_signs=None, affine_levels=None,
    )
    if isinstance(codec, IdentityCodec):
        return StreamArgs(**a)
    if isinstance(codec, Fp8Codec):
        a["kind"] = KIND_FP8E4 if codec.fmt == "e4m3" else KIND_FP8E5
        if codec.channel_shift is not None:  # x = fp8 * scale + shift, read per row and channel
            codec.to(device)
            scale, shift = _fp8_row_tensors(codec, device)
            a.update(scale=scale, zero=shift, has_zero=True, scale_at=SCALE_ROW, group=1,
                     scale_strides=(0, scale.stride(0), 0, scale.stride(1)))
        elif codec.static_scale is not None:
            codec.to(device)
            a["scale"], a["scale_at"] = codec.static_scale.float().contiguous(), SCALE_HEAD
            a["scale_strides"] = (0, a["scale"].stride(0), 0, 0)
        else:
            a["scale"], a["scale_at"] = data["scale"], SCALE_TOKEN
            a["scale_strides"] = _strides4(data["scale"])
        return StreamArgs(**a)
    if isinstance(codec, UniformCodec):
        a.update(kind=KIND_INT, bits=codec.nbits, scale=data["scale"], zero=data["zero"], has_zero=True)
        a["scale_strides"] = _strides4(data["scale"])
        _same_strides(data["scale"], data["zero"], "scale", "zero")
        if codec.axis == "channel":
            a.update(scale_at=SCALE_PAGE, group=1)
        else:
            a.update(scale_at=SCALE_TOKEN, group=codec.group)
        return StreamArgs(**a)
    # NuqCodec
    if codec.codebook.device != device or (
        codec.rotation_signs is not None and codec.rotation_signs.device != device
    ):
        codec.to(device)
    cb = codec.codebook
    if cb.dtype != torch.float32 or not cb.is_contiguous():
        codec.codebook = cb = cb.float().contiguous()
    a.update(kind=KIND_NUQ, bits=codec.nbits, codebook=cb, codebook_head_stride=cb.shape[-1] if cb.dim() == 2 else 0)
    if codec.channel_widths is not None:
        table = width_table(codec, device)
        a.update(kind=KIND_NUQ_WIDTHS, bits=8, codebook=table, codebook_head_stride=table.stride(0))
    a["rotation_signs"] = codec.rotation_signs
    a["affine_levels"] = _affine_levels(codec)
    if codec.axis == "channel":
        if codec._calibrated_channels:
            mean = codec.channel_mean.to(device, torch.float32).contiguous()  # [H, D]
            scale = codec.channel_scale.to(device, torch.float32).contiguous()
            strides = (0, scale.stride(0), 0, scale.stride(1))
        else:
            mean, scale = row["channel_mean"], row["channel_scale"]  # [B, H, 1, D]
            _same_strides(scale, mean, "channel_scale", "channel_mean")
            strides = (scale.stride(0), scale.stride(1), 0, scale.stride(3))
        a.update(scale=scale, zero=mean, has_zero=True, scale_at=SCALE_ROW, group=1, scale_strides=strides)
    elif codec.axis == "page":
        scale, zero = codec.scales(data)  # FP8 ones viewed from their stored bytes: the kernel loads FP8
        _same_strides(scale, zero, "scale", "zero")
        a.update(scale=scale, zero=zero, has_zero=True, scale_at=SCALE_PAGE, group=1,
                 scale_strides=_strides4(scale))
    else:
        scale = codec.scales(data)[0]
        a.update(scale=scale, scale_at=SCALE_TOKEN, group=d, scale_strides=_strides4(scale))
    if codec.n_outliers:
        _same_strides(data["outlier_idx"], data["outlier_val"], "outlier_idx", "outlier_val")
        a.update(outlier_idx=data["outlier_idx"], outlier_val=data["outlier_val"], n_outliers=codec.n_outliers)
    return StreamArgs(**a)


def width_table(codec: NuqCodec, device) -> torch.Tensor:
    """int32 [H, D]: channel c of head h starts at bit `table >> 4` of its token's code stream and is
    `table & 15` bits wide (pack_widths.py). Made once per codec and device, so decode steps, captured ones
    included, never sync."""
    cached = codec.__dict__.get("_width_table")
    if cached is not None and cached.device == torch.device(device):
        return cached
    w = codec.channel_widths.detach().long().cpu()
    start = torch.cumsum(w, -1) - w
    table = ((start << 4) | w).to(torch.int32).contiguous().to(device)
    codec.__dict__["_width_table"] = table
    return table


def _fp8_row_tensors(codec: Fp8Codec, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A shifted FP8 stream's static scales broadcast to [H, D] and its shift [H, D], float32 on `device`;
    made once per codec and device so that decode steps, captured ones included, allocate nothing."""
    cached = codec.__dict__.get("_row_tensors")
    if cached is not None and cached[0].device == device:
        return cached
    h, d = codec.channel_shift.shape
    scale = codec.static_scale.to(device, torch.float32).view(h, 1).expand(h, d).contiguous()
    shift = codec.channel_shift.to(device, torch.float32).contiguous()
    codec.__dict__["_row_tensors"] = (scale, shift)
    return scale, shift


def _affine_levels(codec: NuqCodec) -> tuple[float, float] | None:
    """(lo, step) when the codec's one codebook is evenly spaced, else None. Read once per codec (the
    codebook is fixed once the codec exists) so that decode steps, captured ones included, never sync."""
    cached = codec.__dict__.get("_affine_levels", "unset")
    if cached != "unset":
        return cached
    cb = codec.codebook
    found = None
    if cb.dim() == 1 and cb.numel() > 1:
        levels = cb.detach().double().cpu()
        lo, step = float(levels[0]), float(levels[-1] - levels[0]) / (levels.numel() - 1)
        line = lo + step * torch.arange(levels.numel(), dtype=torch.float64)
        if step > 0 and float((levels - line).abs().max()) <= 1e-6 * float(levels.abs().max()):
            found = (lo, step)
    codec.__dict__["_affine_levels"] = found
    return found


def level_tables(codec: NuqCodec, device) -> torch.Tensor:
    """A 4-bit codebook as the byte tables read by the phase kernel's inline-PTX lookup (unpack_asm_triton):
    int32 [H or 1, 16], one row per codebook; columns 0-3 hold the low bytes of levels 4k..4k+3 rounded
    to bf16 (byte j = level 4k + j), columns 4-7 their high bytes, columns 8-15 the same for fp16. Made
    once per codec and device (the codebook is fixed once the codec exists), so decode steps, captured
    ones included, never sync."""
    cached = codec.__dict__.get("_level_tables")
    if cached is not None and cached.device == torch.device(device):
        return cached
    cb = codec.codebook.detach().float().cpu()
    cb = cb.reshape(-1, cb.shape[-1])
    if cb.shape[-1] != 16:
        raise ValueError(f"level tables are for 4-bit codebooks (16 levels), got {cb.shape[-1]}")
    shift = torch.tensor([0, 8, 16, 24], dtype=torch.int64)
    cols = []
    for dtype in (torch.bfloat16, torch.float16):
        bits = cb.to(dtype).view(torch.int16).to(torch.int64) & 0xFFFF  # [Hc, 16]
        for part in (bits & 0xFF, bits >> 8):
            cols.append((part.view(-1, 4, 4) << shift).sum(-1))  # [Hc, 4]: disjoint bytes, sum = OR
    words = torch.cat(cols, -1)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the same 32 bits, signed
    tables = words.contiguous().to(device)
    codec.__dict__["_level_tables"] = tables
    return tables


def _strides4(t: torch.Tensor) -> tuple[int, int, int, int]:
    return t.stride(0), t.stride(1), t.stride(2), t.stride(3) if t.dim() > 3 else 0


def _same_strides(a: torch.Tensor, b: torch.Tensor, name_a: str, name_b: str) -> None:
    if a.stride() != b.stride():
        raise ValueError(f"{name_a} and {name_b} must share one memory layout, got strides {a.stride()} / {b.stride()}")
