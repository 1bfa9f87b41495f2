"""Bits per key channel: where a layer's key code bits go (NuqCodec.channel_widths).

A key page is coded per channel on the page's range. Channel c's rounding error e_c moves an attention
score by sum_c q_c e_c, so its cost is E[q_c^2] E[e_c^2], and the queries' energy and the keys' page ranges
differ by decades across channels (post-RoPE keys: the slow pairs carry most of both). With the same bits
per token, giving those channels more bits and the idle ones fewer lowers that cost: on SmolLM2's probe,
2.5x less attention loss at an average of 3 bits than 3 bits everywhere (BENCHMARKS.md).

Each channel's error at 0..8 bits is measured on the calibration probe's pages (the uniform grid the codec
uses, both ends on the range; 0 bits keeps the page's middle), weighted by the query energy, and a knapsack
over the head's channels picks the widths with the least total cost whose bits add up to exactly
round(avg * D), the same for every kv head, so that every token of every head packs to one width.
"""

from __future__ import annotations

import torch

from kvcompress.calib.collect import LayerStats
from kvcompress.config import ConfigError
from kvcompress.quant.pack_widths import MAX_WIDTH


def page_errors(keys: torch.Tensor, page_size: int, sinks: int) -> torch.Tensor:
    """keys [1, H, T, D] -> [H, D, MAX_WIDTH + 1] mean squared error of each channel coded on its pages'
    ranges with 0..MAX_WIDTH bits (pages start after the sinks; a partial last page is left out)."""
    k = keys[0, :, sinks:].float()
    n = k.shape[1] // page_size
    if n == 0:
        raise ConfigError(
            f"the calibration probe holds {keys.shape[2]} tokens, fewer than sinks + one page ({sinks + page_size}): "
            "raise --seq-len"
        )
    pages = k[:, : n * page_size].reshape(k.shape[0], n, page_size, -1)  # [H, n, P, D]
    lo, hi = pages.amin(2, keepdim=True), pages.amax(2, keepdim=True)
    u = (pages - lo) / (hi - lo).clamp_min(1e-12)  # [0, 1]
    errors = []
    for b in range(MAX_WIDTH + 1):
        top = float((1 << b) - 1)
        q = torch.round(u * top) / top if b else torch.full_like(u, 0.5)
        errors.append(((q - u) * (hi - lo)).pow(2).mean((1, 2)))  # [H, D]
    return torch.stack(errors, -1)


def least_cost_widths(cost: torch.Tensor, total: int) -> torch.Tensor:
    """cost [D, W + 1] (channel c at w bits) -> widths [D] with sum == total and the least summed cost
    (a knapsack by dynamic programming over the bits spent; costs need not be convex in w)."""
    d, options = cost.shape
    inf = float("inf")
    best = torch.full((total + 1,), inf, dtype=torch.float64)
    best[0] = 0.0
    picks = torch.zeros(d, total + 1, dtype=torch.long)
    c64 = cost.to(torch.float64)
    for c in range(d):
        cand = torch.full((options, total + 1), inf, dtype=torch.float64)
        for w in range(options):
            cand[w, w:] = best[: total + 1 - w] + c64[c, w]
        best, picks[c] = cand.min(0)
    if best[total] == inf:
        raise ConfigError(f"cannot spend {total} bits over {d} channels of at most {options - 1} bits each")
    widths = torch.zeros(d, dtype=torch.long)
    left = total
    for c in range(d - 1, -1, -1):
        widths[c] = picks[c, left]
        left -= int(widths[c])
    return widths


def channel_widths(stats: LayerStats, avg_bits: float, page_size: int, sinks: int) -> torch.Tensor:
    """[H, D] uint8 bits per key channel, round(avg_bits * D) per kv head, from the layer's probe keys and
    query energies (equal weights where the layer records none, e.g. an MLA latent)."""
    if not 0 < avg_bits <= MAX_WIDTH:
        raise ConfigError(f"an average key width must be in (0, {MAX_WIDTH}] bits, got {avg_bits}")
    err = page_errors(stats.probe_k, page_size, sinks)  # [H, D, W + 1]
    h, d = err.shape[:2]
    weight = stats.query_energy if stats.query_energy is not None else torch.ones(h, d)
    cost = err * weight.float()[..., None]
    total = round(avg_bits * d)
    return torch.stack([least_cost_widths(cost[i], total) for i in range(h)]).to(torch.uint8)
