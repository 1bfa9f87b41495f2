"""No quantization: tokens kept in the model dtype, in the same paged store as the others."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.quant.base import Codec, FieldKind, Role


@dataclass
class IdentityCodec(Codec):
    dtype: torch.dtype = torch.float32

    def fields(self):
        return {"data": (FieldKind.TOKEN, Role.PAYLOAD)}

    def encode(self, x, row):
        return {"data": x.to(self.dtype)}

    def decode(self, f, row, dtype):
        return f["data"].to(dtype)

    @property
    def bits(self):
        return torch.finfo(self.dtype).bits
