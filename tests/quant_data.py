"""Test data and the SQNR measure shared by the quantizer tests (imported by test modules, not a test)."""

from __future__ import annotations

import torch


def gaussian(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def heavy_keys(shape, seed: int) -> torch.Tensor:
    """Student-t with 3 degrees of freedom, and 4 of the 64 channels scaled x20, like real keys."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(shape, generator=g)
    chi2 = torch.randn(*shape, 3, generator=g).pow(2).sum(-1)
    x = z / (chi2 / 3).sqrt()
    x[..., [3, 17, 40, 59]] *= 20
    return x


def sqnr_db(x: torch.Tensor, y: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio of y against x, in dB."""
    x, y = x.double(), y.double()
    return float(10 * torch.log10(x.pow(2).sum() / (x - y).pow(2).sum()))
