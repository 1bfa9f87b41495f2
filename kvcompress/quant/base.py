"""The small base every quantization method shares: a Codec turns pages of tokens into packed fields.

A Codec encodes whole pages of `page_size` tokens of one stream (keys or values) of one layer:
x [B, H, n_pages * P, D] -> a dict of tensors, each of one FieldKind:

- TOKEN: one entry per token,  [B, H, N, ...]   (packed codes, per-token scales)
- PAGE:  one entry per page,   [B, H, n_pages, ...] (per-channel page scales, outlier lists)
- ROW:   one entry per sequence, [B, H, 1, ...] (statistics frozen at the first page, e.g. key channel scales)
- SHARED tensors (codebooks, calibrated static scales) are attributes of the codec, not fields.

The store (kvcompress.layout.store) keeps the fields; the drop-in path calls `decode`; the fused
kernels read the same fields directly. `field_roles` says which fields are payload and which are
metadata, for the memory report.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch


class FieldKind(str, Enum):
    TOKEN = "token"
    PAGE = "page"
    ROW = "row"


class Role(str, Enum):
    PAYLOAD = "payload"
    METADATA = "metadata"


@dataclass
class Codec:
    """Base of all quantizers. Subclasses implement `fields`, `encode`, `decode` (and `prepare` if stateful)."""

    page_size: int
    head_dim: int
    num_heads: int

    def fields(self) -> dict[str, tuple[FieldKind, Role]]:
        raise NotImplementedError

    def prepare(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """ROW fields from the tokens available at the first flush, x: [B, H, N, D]. Default: none."""
        return {}

    def encode(self, x: torch.Tensor, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """x: [B, H, n_pages * P, D] -> TOKEN and PAGE fields."""
        raise NotImplementedError

    def decode(self, f: dict[str, torch.Tensor], row: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Fields of N tokens -> [B, H, N, D] in `dtype`."""
        raise NotImplementedError

    def shared_tensors(self) -> dict[str, torch.Tensor]:
        """Tensors held once per layer (codebooks, static scales): counted as metadata."""
        return {}

    def to(self, device) -> "Codec":
        for name, t in self.shared_tensors().items():
            setattr(self, name, t.to(device))
        return self

    @property
    def bits(self) -> float:
        raise NotImplementedError

    def _pages(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, n*P, D] -> [B, H, n, P, D]"""
        b, h, n, d = x.shape
        assert n % self.page_size == 0, f"encode takes whole pages of {self.page_size} tokens, got {n}"
        return x.reshape(b, h, n // self.page_size, self.page_size, d)
