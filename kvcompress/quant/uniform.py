"""Uniform asymmetric integers, KIVI style (Liu et al. 2024, arXiv:2402.02750): 2, 3, 4 or 8 bits.

axis="channel" (keys): one (scale, zero) per channel per page of P tokens.
axis="token" (values): one (scale, zero) per token per group of `group_size` channels.
Scales are rounded to fp16 before the codes are computed, so decode uses exactly what encode used.

range_fit="minmax" (KIVI) spans each group's min and max. "mse" shrinks each group's range about its middle
by the ratio in MSE_CLIPS with the least squared error over the group, clipping the elements beyond it
(the wider range wins ties). Only the encoder changes: the fields, their layout and decode are the same.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.quant.base import Codec, FieldKind, Role
from kvcompress.quant.pack import pack, packed_width, unpack


# Range ratios "mse" tries, widest first. On SmolLM2 (2048 tokens, float32, 8 sinks; BENCHMARKS.md "int2 with
# fitted key ranges") int2 keys fitted over these lose +5.1 % perplexity against +10.9 % with min-max ranges.
MSE_CLIPS = (1.0, 0.9, 0.8, 0.7, 0.6)


@dataclass
class UniformCodec(Codec):
    nbits: int = 4
    axis: str = "token"
    group_size: int = 0
    range_fit: str = "minmax"  # config.INT_RANGE_FITS: "minmax" or "mse"

    def __post_init__(self):
        g = self.group_size or self.head_dim
        if self.axis == "token" and self.head_dim % g:
            raise ValueError(f"group_size {g} must divide the head dim {self.head_dim}")

    @property
    def group(self) -> int:
        return self.group_size or self.head_dim

    def fields(self):
        kind = FieldKind.PAGE if self.axis == "channel" else FieldKind.TOKEN
        return {
            "codes": (FieldKind.TOKEN, Role.PAYLOAD),
            "scale": (kind, Role.METADATA),
            "zero": (kind, Role.METADATA),
        }

    def encode(self, x, row):
        levels = 2**self.nbits - 1
        b, h, n, d = x.shape
        xf = x.float()
        if self.axis == "channel":
            xp = self._pages(xf)  # [B, H, n_pages, P, D]
            scale, zero = self._range(xp, 3, levels)  # [B, H, n_pages, D]
            q = ((xp - zero.float().unsqueeze(3)) / scale.float().unsqueeze(3)).round().clamp(0, levels)
            q = q.reshape(b, h, n, d)
        else:
            xg = xf.reshape(b, h, n, d // self.group, self.group)
            scale, zero = self._range(xg, 4, levels)  # [B, H, N, G]
            q = ((xg - zero.float()[..., None]) / scale.float()[..., None]).round().clamp(0, levels)
            q = q.reshape(b, h, n, d)
        return {"codes": pack(q.to(torch.uint8), self.nbits), "scale": scale, "zero": zero}

    def decode(self, f, row, dtype):
        q = unpack(f["codes"], self.nbits, self.head_dim).float()  # [B, H, N, D]
        b, h, n, d = q.shape
        scale, zero = f["scale"].float(), f["zero"].float()
        if self.axis == "channel":
            qp = q.reshape(b, h, n // self.page_size, self.page_size, d)
            x = qp * scale.unsqueeze(3) + zero.unsqueeze(3)
        else:
            qg = q.reshape(b, h, n, d // self.group, self.group)
            x = qg * scale[..., None] + zero[..., None]
        return x.reshape(b, h, n, d).to(dtype)

    def _range(self, x: torch.Tensor, dim: int, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp16 (scale, zero) of each group of x, whose elements run along `dim` (dropped from the result)."""
        mn, mx = x.amin(dim), x.amax(dim)
        if self.range_fit == "minmax":
            return _scale_zero(mn, mx, levels)
        half = (mx - mn) / 2
        best = None
        for ratio in MSE_CLIPS:  # the range shrunk by (1 - ratio) * half at each end (1.0: min-max exactly)
            cut = half * (1.0 - ratio)
            scale, zero = _scale_zero(mn + cut, mx - cut, levels)
            s, z = scale.float().unsqueeze(dim), zero.float().unsqueeze(dim)
            err = ((((x - z) / s).round().clamp(0, levels) * s + z - x) ** 2).sum(dim)
            if best is None:
                best = [err, scale, zero]
                continue
            better = err < best[0]
            best = [torch.where(better, e, o) for e, o in zip((err, scale, zero), best)]
        return best[1], best[2]

    @property
    def bits(self):
        meta = 32.0 / self.page_size if self.axis == "channel" else 32.0 / self.group
        return packed_width(self.head_dim, self.nbits) * 8 / self.head_dim + meta


def _scale_zero(mn: torch.Tensor, mx: torch.Tensor, levels: int):
    zero = mn.to(torch.float16)
    scale = ((mx - zero.float()) / levels).clamp_min(1e-6).to(torch.float16)
    # fp16 rounding of the scale may shrink the range slightly; widen by one ulp where it does
    short = zero.float() + scale.float() * levels < mx
    scale = torch.where(short, torch.nextafter(scale, torch.full_like(scale, 65504.0)), scale)
    return scale, zero
