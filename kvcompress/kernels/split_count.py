"""How many splits along the sequence a decode kernel launch gets per (batch, kv head) pair.

The one-warp kernels (decode_fp8_triton, decode_phase_triton) hold about 8 programs per multiprocessor on
an H200 (the int phase kernel: 255 registers, Nsight Compute; the fp8 kernel: the timings below say the
same). A launch whose programs overflow that one wave by a few runs a second, nearly empty wave: at 32K x 8
(64 pairs, 132 multiprocessors) int4 ran at 0.75x the speed of bf16 SDPA with 17 splits and at 1.17x with
16 (fp8: 1.30x against 1.69x), and at batch 32 the former rule's 9 splits (2.2 waves) gave int4 0.94x where
4 splits gave 1.19x. So the one-warp kernels (fp8, and the phase kernel: KIVI int codes and 4-bit nuq
codebooks) take at most one wave, rounded down, with at least 128 tokens per split (nuq4 0.55x -> 0.68x at
32K x 32, 0.65x -> 0.82x at 32K x 1). Before the merge read all partial rows in one block (merge_block),
short splits cost more in the merge than they hid (32K x 1 fp8 0.90x at 264 splits of 124 tokens, 1.22x
at 128 of 256), so the floor was 256; with it, 128 tokens per split took 8K x 1 from 0.77x to 0.93x
(fp8) and 0.65x to 0.87x (int4), 16K x 1 from 1.22x / 1.07x to 1.26x / 1.14x, and changed nothing
from 32K at batch 1 or at batch 8 and more (the wave is the bound there). Measured in BENCHMARKS.md
("Split counts by waves", 2026-12-03). The other kernels and every kernel walking a Quest page list
(short walks, tuned and timed with the former rule) keep 16 programs per multiprocessor, rounded up.
"""

from __future__ import annotations

ONE_WARP_PER_SM = 8  # resident programs of the one-warp kernels per multiprocessor (H200, measured)
MIN_SPLIT_TOKENS = 128


def default_splits(pairs: int, sms: int, n_logical: int, one_wave: bool, min_tokens: int = MIN_SPLIT_TOKENS) -> int:
    """Splits per pair for `pairs` = batch x kv heads over `sms` multiprocessors, `n_logical` tokens to
    walk (the body or the page list's pages). one_wave: one wave of the one-warp kernels at most, >=
    min_tokens per split (the one-warp kernels without a page list); else 16 programs per
    multiprocessor, rounded up."""
    if not one_wave:
        return max(1, -(-16 * sms // pairs))
    return max(1, min(ONE_WARP_PER_SM * sms // pairs, n_logical // max(min_tokens, 1)))


def merge_block(n_splits: int) -> int:
    """Partial rows the split merge reads per step: all of them up to 128 (a power of two >= 16), so
    that the merge of a batch-1 launch (about 128 splits per pair) makes one pass over them instead of
    eight dependent ones (32K x 1 fp8: the merge took 13.2 us against the body's 22 us with 16 per step;
    BENCHMARKS.md, 2026-12-03)."""
    return min(128, max(16, 1 << max(0, n_splits - 1).bit_length()))
