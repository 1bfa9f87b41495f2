"""Bytes and bits per element of a policy, from the codecs themselves (no cache is built).

A full-attention layer holding C tokens of a batch row keeps, per stream: the first `sinks` tokens and
the tail (residual window plus the partly filled page) in the model dtype, whole pages at the codec's
`bits` per element, its ROW statistics once per sequence and its shared tensors (codebooks, calibrated
scales) once per layer, exactly as CompressedLayer stores them. A sliding-window layer keeps at most
W tokens exact. A sparse layer holds what its policy keeps at most (calib/held.py): eviction drops body
pages, the sinks and the tail stay, and the sparsity state (positions, scores, page summaries) counts too.
"All-in" bits per element divide all of that by the elements a plain cache of the same tokens would hold.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.calib.held import held_tokens, room_tokens, sparsity_state_bytes
from kvcompress.config import LayerPolicy, QuantSpec
from kvcompress.layout.arch import ModelLayout
from kvcompress.quant.factory import make_codec


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


@dataclass
class StreamCost:
    """One stream's storage: bits per element of a page, ROW bytes per sequence, shared bytes per layer."""

    body_bits: float
    row_bytes: int
    shared_bytes: int
    dtype_bits: int
    lossless: bool


def stream_cost(spec: QuantSpec, tensors: dict, page_size: int, num_heads: int, head_dim: int,
                dtype: torch.dtype) -> StreamCost:
    codec = make_codec(spec, page_size=page_size, head_dim=head_dim, num_heads=num_heads, dtype=dtype,
                       tensors=tensors, seed=0)
    dtype_bits = torch.finfo(dtype).bits
    row = codec.prepare(torch.zeros(1, num_heads, page_size, head_dim, dtype=dtype))
    return StreamCost(
        body_bits=float(codec.bits),
        row_bytes=_nbytes(row.values()),
        shared_bytes=_nbytes(codec.shared_tensors().values()),
        dtype_bits=dtype_bits,
        lossless=spec.is_lossless,
    )


def layer_tokens(policy: LayerPolicy, context: int) -> tuple[int, int]:
    """(tokens in packed pages, tokens kept in the model dtype) of a full layer after `context` tokens."""
    if policy.key.is_lossless and policy.value.is_lossless:
        return 0, context
    sinks = min(policy.sinks, context)
    pages = max(context - sinks - policy.residual, 0) // policy.page_size
    body = pages * policy.page_size
    return body, context - body


def layer_bytes(policy: LayerPolicy, layout: ModelLayout, layer_idx: int, context: int, batch: int = 1,
                dtype: torch.dtype = torch.float16) -> float:
    """Bytes one layer holds for `batch` sequences of `context` tokens under `policy`."""
    h, dk, dv = layout.num_kv_heads, layout.key_head_dim, layout.value_head_dim
    itemsize = torch.finfo(dtype).bits / 8
    if layout.is_sliding(layer_idx):
        held = min(context, layout.sliding_window or context)
        return batch * held * h * (dk + dv) * itemsize
    body, exact = layer_tokens(policy, context)
    held = held_tokens(policy, layer_idx, context)
    if held < context:  # evicted: body pages go, the sinks and the tail stay
        exact = min(exact, held)
        body = held - exact
    total = batch * (exact + room_tokens(policy)) * h * (dk + dv) * itemsize
    total += sparsity_state_bytes(policy, layer_idx, context, h, dk, batch, value_dim=dv)
    for spec, d, name in ((policy.key, dk, "key"), (policy.value, dv, "value")):
        cost = stream_cost(spec, policy.stream_tensors(name), policy.page_size, h, d, dtype)
        total += batch * body * h * d * cost.body_bits / 8 + cost.shared_bytes
        if body:
            total += batch * cost.row_bytes
    return total


def uncompressed_layer_bytes(layout: ModelLayout, layer_idx: int, context: int, batch: int = 1,
                             dtype: torch.dtype = torch.float16) -> float:
    """A plain cache's bytes for one layer (sliding layers bounded by their window)."""
    held = min(context, layout.sliding_window or context) if layout.is_sliding(layer_idx) else context
    return batch * held * layout.values_per_token(layer_idx) * torch.finfo(dtype).bits / 8


def config_bits_per_element(layers: list[LayerPolicy], layout: ModelLayout, context: int, batch: int = 1,
                            dtype: torch.dtype = torch.float16) -> float:
    """All-in bits per cached element of a whole config after `context` tokens (as memory_report counts)."""
    held = sum(layer_bytes(p, layout, i, context, batch, dtype) for i, p in enumerate(layers))
    elements = sum(uncompressed_layer_bytes(layout, i, context, batch, dtype) for i in range(layout.num_layers))
    elements /= torch.finfo(dtype).bits / 8
    return 8.0 * held / elements
