"""Attention over what a sparse layer keeps: the pure-torch reference backend.

A backend is a function `(query, layer, scaling) -> (output, mass)`:
query [B, Hq, q, D]; it reads `layer.sparse.step` (the held K [B, H, held, Dk] / V, the mask
[B, H, q, held] with True = attend, and optionally the held indices [B, H, n] to read) and, for Quest's
`unread_means`, `layer.sparse.policy` and its page summaries (kvcompress.sparse.unread); it returns the
output [B, Hq, q, Dv] and, when `step.mass_queries` > 0, the attention mass per held token [B, H, held]
summed over the newest `mass_queries` queries and the GQA group's query heads (None otherwise).
Query heads h*G .. h*G+G-1 share kv head h, as in transformers' repeat_kv; K/V are never repeated.
A Triton backend with the same signature registers itself in BACKENDS.
"""

from __future__ import annotations

from typing import Callable

import torch

from kvcompress.sparse.merge import attention_bias
from kvcompress.sparse.state import gather_step
from kvcompress.sparse.unread import unread_tokens

Backend = Callable[[torch.Tensor, object, float], tuple[torch.Tensor, torch.Tensor | None]]

QUERY_BLOCK = 256  # queries per block at prefill: bounds the [G*block, held] score matrix


def attend_torch(query: torch.Tensor, layer, scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    step = layer.sparse.step
    k, v, mask = gather_step(step)  # [B, H, n, Dk], [B, H, n, Dv], [B, H, q, n]
    b, hq, q, _ = query.shape
    h = k.shape[1]
    g = hq // h
    outs, mass = [], None
    first_mass = q - step.mass_queries
    bias = attention_bias(layer)  # [B, H, held]: log size of merged tokens (H2O merge), else None
    if bias is not None and step.index is not None:
        bias = bias.gather(2, step.index.clamp_min(0))
    n_read = k.shape[2]
    selected = q == 1 and step.index is not None  # a decode step that reads a selection (Quest)
    stand_ins = unread_tokens(layer.sparse, step) if selected and layer.sparse.policy.unread_means else None
    if stand_ins is not None:  # Quest's skipped pages, one token each after the tokens read
        uk, uv, ubias = stand_ins
        k, v = torch.cat([k.float(), uk], 2), torch.cat([v.float(), uv], 2)
        mask = torch.cat([mask, ubias.isfinite()[:, :, None]], 3)
        bias = torch.cat([k.new_zeros(b, h, n_read) if bias is None else bias.float(), ubias.clamp_min(0)], 2)
    for lo in range(0, q, QUERY_BLOCK):
        hi = min(lo + QUERY_BLOCK, q)
        qb = query[:, :, lo:hi].reshape(b, h, g, hi - lo, -1).float()  # [B, H, G, s, D]
        scores = torch.einsum("bhgsd,bhnd->bhgsn", qb, k.float()) * scaling  # [B, H, G, s, n]
        if bias is not None:
            scores = scores + bias[:, :, None, None]
        allowed = mask[:, :, None, lo:hi]  # [B, H, 1, s, n]
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        w = torch.softmax(scores, dim=-1) * allowed  # a query that may attend nothing gets zeros
        outs.append(torch.einsum("bhgsn,bhnd->bhgsd", w, v.float()))
        if step.mass_queries and hi > first_mass:
            part = w[:, :, :, max(first_mass - lo, 0):, :n_read].sum((2, 3))  # [B, H, n]
            mass = part if mass is None else mass + part
    out = torch.cat(outs, dim=3).reshape(b, hq, q, -1).to(query.dtype)
    if mass is not None and step.index is not None:
        # report the mass against every held token (unread ones and padding slots, index -1, got none)
        full = mass.new_zeros(b, h, step.keys.shape[2])
        mass = full.scatter_add(2, step.index.clamp_min(0), mass)
    return out, mass


def attend_fused(query: torch.Tensor, layer, scaling: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The fused Triton kernel on decode steps that deferred their dense K/V (kvcompress.kernels.attention_backend),
    the torch reference on every other step."""
    from kvcompress.kernels.attention_backend import attend_fused as fused

    return fused(query, layer, scaling, deferred=getattr(layer.sparse.step, "deferred", False))


BACKENDS: dict[str, Backend] = {"torch": attend_torch, "fused": attend_fused}
