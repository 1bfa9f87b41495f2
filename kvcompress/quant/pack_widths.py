"""Bit-packing of codes whose width differs by channel (per-channel bit allocation, calib/widths.py).

Layout: for kv head h, channel c holds widths[h, c] bits (0..8); a token's codes are one little-endian
bit stream: channel 0's bits first (least significant bit first), then channel 1's, and so on. Every head
must hold the same total T bits, so a token of every head takes ceil(T / 8) bytes, zero-padded. A channel of
width 0 stores nothing (its code reads as 0).

torch.bitwise ops have no variable-width pack, hence these two gathers.
"""

from __future__ import annotations

import torch

MAX_WIDTH = 8


def stream_bits(widths: torch.Tensor) -> int:
    """Bits per token and head of widths [H, D] (the same for every head)."""
    totals = widths.long().sum(-1)
    if widths.numel() and not bool((totals == totals[0]).all()):
        raise ValueError(f"every kv head must hold the same number of code bits; got {totals.tolist()}")
    return int(totals[0]) if widths.numel() else 0


def widths_packed_width(widths: torch.Tensor) -> int:
    """Bytes one token of one head takes."""
    return (stream_bits(widths) + 7) // 8


def bit_map(widths: torch.Tensor, total: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(channel [H, T], bit [H, T]) of each stream position, on widths' device: position t of head h is bit
    `bit` of channel `channel`'s code. total: stream_bits(widths) where the caller knows it (then nothing
    syncs with the host)."""
    h, d = widths.shape
    t = stream_bits(widths) if total is None else total
    w = widths.long().flatten()
    flat = torch.repeat_interleave(torch.arange(h * d, device=widths.device), w, output_size=h * t)  # [H * T]
    starts = torch.cumsum(w, 0) - w  # stream offset of each (head, channel), counted across heads
    pos = torch.arange(h * t, device=widths.device)
    return (flat % d).reshape(h, t), (pos - starts[flat]).reshape(h, t)


def pack_widths(codes: torch.Tensor, widths: torch.Tensor, bits=None) -> torch.Tensor:
    """codes [B, H, N, D] integers, channel c of head h in [0, 2**widths[h, c]) -> [B, H, N, W] uint8.
    bits: bit_map(widths) where the caller has it."""
    b, h, n, d = codes.shape
    channel, bit = bits if bits is not None else bit_map(widths.to(codes.device))
    t = channel.shape[1]
    nbytes = (t + 7) // 8
    src = codes.long().gather(-1, channel[None, :, None, :].expand(b, h, n, t))  # [B, H, N, T]
    bits = (src >> bit[None, :, None, :]) & 1
    bits = torch.nn.functional.pad(bits, (0, nbytes * 8 - t)).reshape(b, h, n, nbytes, 8)
    return (bits << torch.arange(8, device=codes.device)).sum(-1).to(torch.uint8)


def unpack_widths(packed: torch.Tensor, widths: torch.Tensor, bits=None) -> torch.Tensor:
    """packed [B, H, N, W] uint8 -> codes [B, H, N, D] (int64); bits as for pack_widths."""
    b, h, n, _ = packed.shape
    d = widths.shape[1]
    channel, bit = bits if bits is not None else bit_map(widths.to(packed.device))
    t = channel.shape[1]
    bits = (packed.long()[..., None] >> torch.arange(8, device=packed.device)) & 1  # [B, H, N, W, 8]
    bits = bits.reshape(b, h, n, -1)[..., :t]
    out = torch.zeros(b, h, n, d, dtype=torch.long, device=packed.device)
    return out.scatter_add_(-1, channel[None, :, None, :].expand(b, h, n, t), bits << bit[None, :, None, :])
