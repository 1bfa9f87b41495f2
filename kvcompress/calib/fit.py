"""Fit a layer's calibrated tensors from what `collect` saw: NUQ codebooks, key channel statistics,
outlier thresholds and FP8 static scales.

Codebooks are fitted on the values the NuqCodec will actually code (kvcompress/quant/nuq.py):
keys normalised per channel, u = (k - mean_c) / scale_c with the calibrated statistics; values per
token, u = v / s_t with s_t the rms (per-page outliers left out) rounded as the codec stores it (fp16 or
FP8: an e5m2 scale is up to 12 % off the rms, which widens the distribution the levels must cover).
Rotated streams are not fitted (candidates.py says why). Elements the codec keeps exactly (the largest
|u|, `outlier_fraction` of them) are left out of the fit. The k-means is weighted by how much an
element's error costs in the attention (see collect.py), converted to the normalised domain: an error du
on a key is scale_c * du on the logit's input, on a value s_t * du.
"""

from __future__ import annotations

import torch

from kvcompress.calib.collect import LayerStats
from kvcompress.quant.codebook import fit_codebook
from kvcompress.quant.fp8 import FP8_DTYPES
from kvcompress.quant.page_range import token_scale

_MIN_SCALE = 1e-4  # the same floor the codec puts under a per-channel std


def channel_stats(stats: LayerStats, stream: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per kv head and channel mean and scale, [H, D] each (the codec's calibrated statistics).

    Keys use the running statistics over every calibration token; values (rarely coded per channel)
    the sampled tokens.
    """
    if stream == "key":
        mean, std = stats.key_mean, stats.key_std
    else:
        mean, std = stats.values.mean(1), stats.values.std(1, correction=0)
    return mean.float().contiguous(), std.float().clamp_min(_MIN_SCALE).contiguous()


def _outlier_keep(u: torch.Tensor, fraction: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Mask of elements kept for coding (|u| under the per-head quantile) and the thresholds [H].

    u: [H, N, D]. The codec picks the top `fraction` of |u| per page; a per-head quantile over the
    samples is the same cut on average.
    """
    h = u.shape[0]
    if fraction <= 0:
        return torch.ones_like(u, dtype=torch.bool), torch.full((h,), float("inf"))
    flat = u.abs().reshape(h, -1)
    k = max(1, round((1.0 - fraction) * flat.shape[1]))
    thr = flat.kthvalue(k, dim=1).values  # [H], the (1 - fraction) quantile
    return u.abs() <= thr[:, None, None], thr


def _samples(stats: LayerStats, stream: str):
    """Sampled tokens [H, N, D] and their importance [H, N, D] (or None) of one stream."""
    if stream == "key":
        return stats.keys, stats.key_weight
    w = None if stats.value_weight is None else stats.value_weight[..., None].expand_as(stats.values)
    return stats.values, w


def normalised_per_channel(stats: LayerStats, stream: str, fraction: float):
    """u [H, N, D], kept mask, weights in the u domain (or None), outlier thresholds [H]."""
    x, w = _samples(stats, stream)
    mean, scale = channel_stats(stats, stream)
    u = (x - mean[:, None]) / scale[:, None]
    keep, thr = _outlier_keep(u, fraction)
    return u, keep, (None if w is None else w * scale[:, None].pow(2)), thr


def normalised_per_token(stats: LayerStats, stream: str, fraction: float, scale_format: str = "fp16"):
    """u [H, N, D], kept mask, weights in the u domain (or None), outlier thresholds [H]; u is divided by
    the per-token scale as the codec stores it in `scale_format`."""
    x, w = _samples(stats, stream)
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    keep, thr = _outlier_keep(x / rms.clamp_min(1e-6), fraction)
    kf = keep.float()
    rms = ((x.pow(2) * kf).sum(-1, keepdim=True) / kf.sum(-1, keepdim=True).clamp_min(1)).sqrt()
    scale = token_scale(rms.clamp_min(1e-6), scale_format).float()  # the scale the codec stores
    return x / scale, keep, (None if w is None else w * scale.pow(2)), thr


def fit_levels(u: torch.Tensor, keep: torch.Tensor, weights, bits: int, per_head: bool) -> torch.Tensor:
    """Weighted k-means levels: [H, 2**bits] per kv head or [2**bits] for the layer."""
    if not per_head:
        w = None if weights is None else weights[keep]
        return fit_codebook(u[keep], bits, w, iters=50)
    books = []
    for h in range(u.shape[0]):
        w = None if weights is None else weights[h][keep[h]]
        books.append(fit_codebook(u[h][keep[h]], bits, w, iters=50))
    return torch.stack(books)


def widen_outer_levels(levels: torch.Tensor, oblivious: torch.Tensor) -> torch.Tensor:
    """levels [..., L] sorted -> the same with the outermost level on each side at least as far out as the
    data-oblivious codebook's `oblivious` [L], and (L >= 8) the next one at least halfway to its
    counterpart there.

    Why: k-means levels minimise the mean squared error of the sampled values and give up their rare large
    elements (SmolLM2 layer 5's fitted values end at -2.8 / +5.9 against the Student-t preset's +-6.1).
    Passkey retrieval needs those: calibrated nuq4 found 4 of 12 keys with plain fitted levels, 12 of 12
    with widened ones (the uncompressed cache 8), and perplexity over 4 windows of 1024 of eval.txt moved
    from +0.000 % to -0.070 % (preset +0.290 %; BENCHMARKS.md, 2026-12-03)."""
    lv = levels.clone()
    ob = oblivious.to(lv)
    lv[..., 0] = torch.minimum(lv[..., 0], ob[0])
    lv[..., -1] = torch.maximum(lv[..., -1], ob[-1])
    if lv.shape[-1] >= 8:
        lv[..., 1] = torch.minimum(lv[..., 1], (lv[..., 1] + ob[1]) / 2)
        lv[..., -2] = torch.maximum(lv[..., -2], (lv[..., -2] + ob[-2]) / 2)
    return lv.sort(-1).values


def fit_nuq_tensors(stats: LayerStats, stream: str, bits: int, fraction: float, per_head: bool = True,
                    axis: str = "channel", scale_format: str = "fp16",
                    oblivious: torch.Tensor | None = None) -> dict:
    """The calibrated tensors of one nuq stream, keyed as in a LayerPolicy ("key.codebook", ...).
    oblivious: the spec's data-oblivious levels [2**bits]; per-token levels are widened toward them
    (widen_outer_levels)."""
    out = {}
    if axis == "page":
        # Keys coded on each page's own range keep the codec's uniform levels: calibration samples are
        # scattered tokens, not pages, and on SmolLM2 keys k-means levels fitted in the page-range
        # domain measured 0.7-0.9 dB below the uniform grid (whose ends sit on the range). What calibration
        # gives them is which channels the queries read most, for picking each page's outliers
        # (quant/outlier_select.py).
        if stream == "key" and fraction > 0 and stats.query_energy is not None:
            out["key.outlier_weight"] = outlier_weights(stats.query_energy)
        return out
    if axis == "channel":
        u, keep, w, thr = normalised_per_channel(stats, stream, fraction)
        mean, scale = channel_stats(stats, stream)
        out.update({f"{stream}.channel_mean": mean, f"{stream}.channel_scale": scale})
    else:
        u, keep, w, thr = normalised_per_token(stats, stream, fraction, scale_format)
    levels = fit_levels(u, keep, w, bits, per_head)
    if axis == "token" and oblivious is not None:
        levels = widen_outer_levels(levels, oblivious)
    out[f"{stream}.codebook"] = levels
    if fraction > 0:  # for inspection: the codec keeps a fixed count per page (config.STREAM_TENSORS)
        out[f"{stream}.outlier_threshold"] = thr.float()
    return out


# Headroom of static FP8 scales over the calibration absmax. Other text exceeds it: with scales from 16 x
# 1024 tokens of calib.txt, 35 of 240 (stream, layer, 1024-token window) of eval.txt had elements above
# the calibrated range, by up to 1.35x, and clipping hits exactly the largest elements. FP8's error is
# relative, so a binade of headroom costs nothing but the bottom of the range (values below 7e-5 of the
# absmax, instead of 3.5e-5, become subnormal).
FP8_HEADROOM = 2.0


def fp8_shift_tensors(stats: LayerStats, stream: str, fmt: str = "e4m3") -> dict[str, torch.Tensor]:
    """An FP8 stream's per-channel shift (its calibrated channel means, [H, D]) and the static scales [H]
    of what is left: headroom * the largest |x - shift| over the sampled tokens / the format's max."""
    mean, _ = channel_stats(stats, stream)
    x, _ = _samples(stats, stream)
    amax = (x.float() - mean[:, None, :]).abs().amax((1, 2))
    return {"shift": mean, "scale": fp8_scales(amax, fmt)}


def fp8_scales(amax: torch.Tensor, fmt: str = "e4m3", headroom: float = FP8_HEADROOM) -> torch.Tensor:
    """Static FP8 scales [H] float32: headroom * amax / the format's max (448 for e4m3); dequant = fp8 * scale."""
    fmax = float(torch.finfo(FP8_DTYPES[fmt]).max)
    return (headroom * amax.float() / fmax).clamp_min(1e-8)


def outlier_weights(query_energy: torch.Tensor) -> torch.Tensor:
    """Per-channel query energies [H, D] -> the key codec's outlier weights [H, D] float16, each head's mean 1
    (only their ratios within a head matter; float16 halves what every layer holds)."""
    e = query_energy.float().clamp_min(0)
    return (e / e.mean(-1, keepdim=True).clamp_min(1e-12)).to(torch.float16)
