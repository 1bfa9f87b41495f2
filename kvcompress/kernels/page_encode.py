"""Encode whole pages of new tokens into the packed layout (the append path, `PagedStore.append`): torch
twin and Triton.

`encode_pages_torch(codec, x, row)` is the codec's own `encode`; `encode_pages_triton` does the same in
one launch per call, one program per (batch, head, page), for FP8 (per-token dynamic scales) and KIVI
integers (per-page-channel or per-token-group min-max scales, 2/4/8 bits). NUQ encoding (nearest codebook
level plus the per-page outlier top-k) stays on the torch path, replayed from a CUDA graph on the GPU
when the caller passes a `GraphedEncoder` (page_encode_graph.py). `encode_pages` dispatches.
x: [B, H, n_pages * P, D] -> fields as the codec's `encode` returns them.
"""

from __future__ import annotations

import torch

from kvcompress.quant.base import Codec


def encode_pages_torch(codec: Codec, x: torch.Tensor, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return codec.encode(x, row)


def triton_encodes(codec: Codec) -> bool:
    """Whether `encode_pages_triton` handles this codec."""
    from kvcompress.quant.fp8 import Fp8Codec
    from kvcompress.quant.uniform import UniformCodec

    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731  (tl.arange needs powers of two)
    if isinstance(codec, Fp8Codec):  # dynamic per-token scales (static scales and shifts: torch)
        return (codec.static_scale is None and codec.channel_shift is None
                and pow2(codec.head_dim) and pow2(codec.page_size))
    if isinstance(codec, UniformCodec):  # min-max ranges (fitted ranges search on the torch path)
        return (codec.range_fit == "minmax" and codec.nbits in (2, 4, 8)
                and pow2(codec.head_dim) and pow2(codec.page_size) and pow2(codec.group))
    return False


def encode_pages_triton(codec: Codec, x: torch.Tensor, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not triton_encodes(codec):
        raise NotImplementedError(
            f"the Triton page encoder does not handle {type(codec).__name__} with these settings; use encode_pages_torch"
        )
    from kvcompress.kernels.page_encode_triton import encode_fp8, encode_uniform
    from kvcompress.quant.fp8 import Fp8Codec

    if isinstance(codec, Fp8Codec):
        return encode_fp8(codec, x)
    return encode_uniform(codec, x)


def encode_pages(codec: Codec, x: torch.Tensor, row: dict[str, torch.Tensor], backend: str | None = None,
                 graphed=None) -> tuple[dict[str, torch.Tensor], bool]:
    """The selected backend's encoder (torch for codecs the Triton encoder does not handle; from `graphed`,
    a GraphedEncoder of this codec, where page_encode_graph.graphs_enabled(x)).

    Returns (fields, fresh): fresh is False when the fields are a graph's outputs, which the next encode
    of the same shape overwrites (copy them before that)."""
    from kvcompress.kernels.backend import select_backend
    from kvcompress.kernels.page_encode_graph import graphs_enabled

    backend = backend or select_backend(x.device)
    if backend == "triton" and triton_encodes(codec):
        return encode_pages_triton(codec, x, row), True
    if graphed is not None and graphs_enabled(x):
        return graphed(x, row), False
    return encode_pages_torch(codec, x, row), True
