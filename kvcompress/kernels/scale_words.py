"""Per-token 16-bit scales handed to a kernel as int32 words, two tokens per word.

A Triton load of one 2-byte element per token is too small for the asynchronous copies a pipelined loop
issues (4, 8 or 16 bytes), so the fp8 kernel stalled on its scale loads: on an H200 at 128K x 8 they cost
about a fifth of its time (BENCHMARKS.md, 2026-12-02). Read as words, two scales per 4-byte load, they
cost nothing measurable. No Triton here: plain torch, so the launcher can decide on any machine.
"""

from __future__ import annotations

import dataclasses

import torch

from kvcompress.kernels.streams import SCALE_TOKEN, StreamArgs

# the kernels' SW constant: scales loaded one per token, or fp16 pairs as words (what the fp8 codec stores)
WORDS_NONE, WORDS_FP16 = 0, 1


def scale_words(a: StreamArgs) -> tuple[StreamArgs, int]:
    """(a with its per-token scales as an int32 view and word strides, SW) where the scales are fp16
    [B, H, N, 1] with tokens adjacent, an even number of them per row, and every row starting on a
    4-byte boundary; else (a, WORDS_NONE). Nothing is copied: the view shares the scales' storage."""
    s = a.scale
    sb, sh, sn, sc = a.scale_strides
    if a.scale_at != SCALE_TOKEN or s.dtype != torch.float16 or s.dim() != 4 or sn != 1:
        return a, WORDS_NONE
    if s.shape[2] % 2 or sb % 2 or sh % 2 or s.storage_offset() % 2 or s.data_ptr() % 4:
        return a, WORDS_NONE
    words = s.untyped_storage().nbytes() // 4 - s.storage_offset() // 2
    view = torch.empty(0, dtype=torch.int32, device=s.device).set_(
        s.untyped_storage(), s.storage_offset() // 2, (words,), (1,))
    return dataclasses.replace(a, scale=view, scale_strides=(sb // 2, sh // 2, 1, sc)), WORDS_FP16
