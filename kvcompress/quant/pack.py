"""Bit-packing of b-bit codes along the last (head) dimension into uint8.

Layout (what the fused kernels read): the last dim is cut into groups of 8 codes; each group
becomes b bytes, little-endian: code i of the group sits at bits [b*i, b*i + b) of the 8b-bit word.
For b = 4 this is two codes per byte (low nibble first), for b = 2 four per byte, for b = 8 one.
The last dim is padded with zeros to a multiple of 8 codes.
"""

from __future__ import annotations

import torch

SUPPORTED_BITS = (1, 2, 3, 4, 5, 6, 7, 8)


def packed_width(n: int, bits: int) -> int:
    """Bytes that `n` codes of `bits` bits take along the last dim."""
    return (n + 7) // 8 * bits


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes: [..., N] integers in [0, 2**bits) -> [..., packed_width(N, bits)] uint8."""
    assert bits in SUPPORTED_BITS, f"bits must be one of {SUPPORTED_BITS}, got {bits}"
    n = codes.shape[-1]
    pad = (-n) % 8
    if bits == 8:  # one code per byte, padded like the other widths so packed_width holds
        return torch.nn.functional.pad(codes.to(torch.uint8), (0, pad))
    c = codes.to(torch.int64)
    if pad:
        c = torch.nn.functional.pad(c, (0, pad))
    c = c.reshape(*c.shape[:-1], -1, 8)  # [..., G, 8]
    shifts = torch.arange(8, device=c.device, dtype=torch.int64) * bits
    word = (c << shifts).sum(-1, keepdim=True)  # [..., G, 1]: 8*bits <= 64 bits
    byte_shifts = torch.arange(bits, device=c.device, dtype=torch.int64) * 8
    out = (word >> byte_shifts) & 0xFF  # [..., G, bits]
    return out.reshape(*c.shape[:-2], -1).to(torch.uint8)


def unpack(packed: torch.Tensor, bits: int, n: int) -> torch.Tensor:
    """packed: [..., packed_width(n, bits)] uint8 -> [..., n] uint8 codes."""
    assert bits in SUPPORTED_BITS, f"bits must be one of {SUPPORTED_BITS}, got {bits}"
    if bits == 8:
        return packed[..., :n]
    p = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, bits)  # [..., G, bits]
    byte_shifts = torch.arange(bits, device=p.device, dtype=torch.int64) * 8
    word = (p << byte_shifts).sum(-1, keepdim=True)  # [..., G, 1]
    shifts = torch.arange(8, device=p.device, dtype=torch.int64) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)  # [..., G, 8]
    return codes.reshape(*p.shape[:-2], -1)[..., :n].to(torch.uint8)
