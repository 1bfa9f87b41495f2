"""Randomized Hadamard rotation of the head dim (TurboQuant / QuaRot style).

x -> H diag(s) x / sqrt(D), with H the Sylvester Hadamard matrix and s random signs: orthogonal,
so q.k and p.V are unchanged when the query / output are rotated the same way, and it spreads a
few large channels over all of them, making each coordinate close to Gaussian.
"""

from __future__ import annotations

import functools

import torch

from kvcompress.tensor_version import tensor_version


@functools.lru_cache(maxsize=None)
def _hadamard(d: int, device: torch.device) -> torch.Tensor:
    """The normalised [d, d] Sylvester matrix, made once per device: a decode step rotates the exact parts
    and the output at every step, and a host-to-device copy of it there would stall the step (and cannot
    be captured in a CUDA graph)."""
    assert d > 0 and d & (d - 1) == 0, f"the Hadamard rotation needs a power-of-two head dim, got {d}"
    h = torch.ones(1, 1)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / d**0.5).to(device)


def random_signs(d: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randint(0, 2, (d,), generator=g) * 2 - 1).to(torch.float32)


def rotation_matrix(signs: torch.Tensor) -> torch.Tensor:
    """[D, D] orthogonal R with rotate(x) = x @ R."""
    h = _hadamard(signs.numel(), signs.device)
    return signs[:, None].to(h.dtype) * h  # diag(s) @ H (H symmetric)


def rotate(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """x: [..., D] -> rotated [..., D] (float32)."""
    return x.float() @ rotation_matrix(signs)


def unrotate(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    return y.float() @ rotation_matrix(signs).T


def rotation_as(signs: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """rotation_matrix(signs) in `dtype`, made once per signs tensor and dtype and held on that tensor: a
    decode step over rotated streams rotates the exact parts and the output at every step, each with a
    product and three small kernels around it (the matrix built, casts to float32 and back); rotated values
    added about 40 us to a captured batch-1 step on an H200 (BENCHMARKS.md). Made again (and the old ones
    dropped) if the signs are modified in place. Signs made under `torch.inference_mode()` (a cache built
    in an inference-mode loop) keep no version counter, and nothing outside that mode can change them."""
    current = tensor_version(signs)
    version, by_dtype = signs.__dict__.get("_kvcompress_rotations", (None, {}))
    if version != current:
        by_dtype = {}
        signs.__dict__["_kvcompress_rotations"] = (current, by_dtype)
    if dtype not in by_dtype:
        by_dtype[dtype] = rotation_matrix(signs).to(dtype)
    return by_dtype[dtype]


def rotate_in(x: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """rotate(x) in x's dtype (one product, accumulated in float32 by the backend) for the decode step."""
    return x @ rotation_as(signs, x.dtype)


def unrotate_in(y: torch.Tensor, signs: torch.Tensor) -> torch.Tensor:
    """unrotate(y) in y's dtype, as rotate_in (the transpose is a view the product reads as it is)."""
    return y @ rotation_as(signs, y.dtype).mT
