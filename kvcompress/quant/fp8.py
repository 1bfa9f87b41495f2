"""FP8 keys/values (E4M3 or E5M2) through torch's float8 dtypes, 1 byte per element.

Scales: static per kv head from calibration when given ([H] float32, dequant = fp8 * scale), else
dynamic per token (absmax / format max, one fp16 per token and head).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.quant.base import Codec, FieldKind, Role

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@dataclass
class Fp8Codec(Codec):
    fmt: str = "e4m3"
    static_scale: torch.Tensor | None = None  # [H] float32

    @property
    def fp8_dtype(self):
        return FP8_DTYPES[self.fmt]

    @property
    def fmax(self) -> float:
        return float(torch.finfo(self.fp8_dtype).max)

    def fields(self):
        f = {"codes": (FieldKind.TOKEN, Role.PAYLOAD)}
        if self.static_scale is None:
            f["scale"] = (FieldKind.TOKEN, Role.METADATA)
        return f

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        if self.static_scale is not None:
            return self.static_scale.to(x.device, torch.float32).view(1, -1, 1, 1)
        amax = x.abs().amax(-1, keepdim=True).float()
        # fp16 has a normal range down to 6e-5; the clamp keeps an all-zero token finite
        return (amax / self.fmax).clamp_min(1e-7).to(torch.float16)

    def encode(self, x, row):
        scale = self._scale(x)
        q = (x.float() / scale.float()).clamp(-self.fmax, self.fmax).to(self.fp8_dtype)
        out = {"codes": q.view(torch.uint8)}
        if self.static_scale is None:
            out["scale"] = scale
        return out

    def decode(self, f, row, dtype):
        x = f["codes"].view(self.fp8_dtype).float()
        scale = f["scale"].float() if self.static_scale is None else self._scale(x)
        return (x * scale).to(dtype)

    def shared_tensors(self):
        return {} if self.static_scale is None else {"static_scale": self.static_scale}

    @property
    def bits(self):
        return 8.0 + (0 if self.static_scale is not None else 16.0 / self.head_dim)
