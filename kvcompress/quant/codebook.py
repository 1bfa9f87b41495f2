"""Scalar codebooks: Lloyd-Max levels for a unit-variance Gaussian, Laplace or Student-t (5 dof) density,
and weighted 1-D k-means on samples.

The Gaussian codebook is the data-oblivious default (TurboQuant's observation: after a random
rotation, or after normalising each channel / token, a coordinate is close to Gaussian); the Laplace
one has wider outer levels for heavy-tailed streams (per-token normalised values are); the weighted
k-means fit is what calibration uses on real activations.
"""

from __future__ import annotations

import functools
import math

import torch


def _lloyd_max(density, half_width: float, bits: int, iters: int) -> torch.Tensor:
    """Lloyd-Max levels (sorted, float32 [2**bits]) minimising MSE for `density` (unnormalised, of a
    float64 grid) on [-half_width, half_width]."""
    grid = torch.linspace(-half_width, half_width, 64001, dtype=torch.float64)
    levels = torch.linspace(-2.5, 2.5, 2**bits, dtype=torch.float64) * (1.0 if bits > 1 else 0.8)
    return _lloyd(grid, density(grid), levels, iters).to(torch.float32)


@functools.lru_cache(maxsize=None)
def gaussian_lloyd_max(bits: int, iters: int = 200) -> torch.Tensor:
    """Lloyd-Max levels (sorted, float32 [2**bits]) minimising MSE for N(0, 1)."""
    return _lloyd_max(lambda x: torch.exp(-0.5 * x**2), 8.0, bits, iters)


@functools.lru_cache(maxsize=None)
def laplace_lloyd_max(bits: int, iters: int = 300) -> torch.Tensor:
    """Lloyd-Max levels (sorted, float32 [2**bits]) minimising MSE for a unit-variance Laplace density."""
    return _lloyd_max(lambda x: torch.exp(-math.sqrt(2.0) * x.abs()), 16.0, bits, iters)


@functools.lru_cache(maxsize=None)
def student_t5_lloyd_max(bits: int, iters: int = 300) -> torch.Tensor:
    """Lloyd-Max levels (sorted, float32 [2**bits]) minimising MSE for a unit-variance Student-t density with
    5 degrees of freedom (tails between the Gaussian's and far wider outer levels)."""
    nu = 5.0
    s = math.sqrt((nu - 2.0) / nu)  # the t5 scale of unit variance
    return _lloyd_max(lambda x: (1.0 + (x / s) ** 2 / nu) ** (-(nu + 1.0) / 2.0), 16.0, bits, iters)


_DEFAULT_CODEBOOKS = {"gaussian": gaussian_lloyd_max, "laplace": laplace_lloyd_max, "student_t5": student_t5_lloyd_max}


def default_codebook(name: str, bits: int) -> torch.Tensor:
    """The data-oblivious codebook `name` (one of config.CODEBOOKS) of 2**bits levels."""
    return _DEFAULT_CODEBOOKS[name](bits)


def fit_codebook(samples: torch.Tensor, bits: int, weights: torch.Tensor | None = None, iters: int = 30) -> torch.Tensor:
    """Weighted 1-D k-means (Lloyd) of `samples` (any shape) into 2**bits sorted float32 levels.

    weights: same shape as samples, how much each element's error matters (e.g. attention it gets).
    Starts from the Gaussian Lloyd-Max levels scaled to the sample spread.
    """
    x = samples.detach().reshape(-1).to(torch.float64)
    w = torch.ones_like(x) if weights is None else weights.detach().reshape(-1).to(torch.float64).clamp_min(0)
    if x.numel() > 2_000_000:  # a fixed subsample keeps the fit fast; the levels move by < 1e-3 beyond this
        idx = torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))[:2_000_000]
        x, w = x[idx], w[idx]
    std = math.sqrt(float((w * (x - (w * x).sum() / w.sum()) ** 2).sum() / w.sum())) or 1.0
    start = gaussian_lloyd_max(bits).to(torch.float64) * std + float((w * x).sum() / w.sum())
    return _lloyd(x, w, start, iters).to(torch.float32)


def _lloyd(x: torch.Tensor, w: torch.Tensor, levels: torch.Tensor, iters: int) -> torch.Tensor:
    order = torch.argsort(x)
    x, w = x[order], w[order]
    cw = torch.cat([w.new_zeros(1), torch.cumsum(w, 0)])
    cwx = torch.cat([w.new_zeros(1), torch.cumsum(w * x, 0)])
    for _ in range(iters):
        levels, _ = torch.sort(levels)
        edges = (levels[1:] + levels[:-1]) / 2
        cut = torch.searchsorted(x, edges)
        bounds = torch.cat([cut.new_zeros(1), cut, cut.new_full((1,), x.numel())])
        mass = cw[bounds[1:]] - cw[bounds[:-1]]
        moment = cwx[bounds[1:]] - cwx[bounds[:-1]]
        new = torch.where(mass > 0, moment / mass.clamp_min(1e-300), levels)
        if torch.allclose(new, levels, atol=1e-9, rtol=0):
            levels = new
            break
        levels = new
    return torch.sort(levels)[0]


def nearest_level(u: torch.Tensor, levels: torch.Tensor) -> torch.Tensor:
    """Index of the nearest level for each element of u (levels sorted ascending) -> uint8."""
    edges = (levels[1:] + levels[:-1]) / 2
    return torch.bucketize(u.contiguous(), edges.to(u.dtype)).to(torch.uint8)
