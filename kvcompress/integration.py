"""The `kvcompress` attention implementation, switched on per model and scoped.

    kvcompress.enable(model)             # model.config._attn_implementation == "kvcompress"
    ...
    kvcompress.disable(model)            # back to what it was
    with kvcompress.enabled(model): ...  # both

Registered with transformers' AttentionInterface (the function) and AttentionMaskInterface (its mask)
under the name "kvcompress"; nothing of transformers is patched. Sparse cache layers (H2O,
StreamingLLM, SnapKV, Quest) only run under it: it hands the policy the query and the attention
weights. Every other layer (dense, quantization-only, sliding-window, or a plain DynamicCache) gets
torch SDPA, exactly as the "sdpa" implementation computes it.

The mask is indexed by position: [B, 1, q, seen + q], True = attend. Layers that hold their tokens
contiguously (dense, sliding) read its last columns; a layer that evicted tokens gathers the columns
of the positions it still holds, so padding stays masked after eviction and layers holding different
counts (per-layer budgets) share one mask.
"""

from __future__ import annotations

import contextlib
from typing import Callable

import torch

from kvcompress.config import ConfigError

NAME = "kvcompress"


def kvcompress_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, **kwargs):
    """The position-indexed boolean mask [B, 1, q, q_offset + q] (never skipped, so padding is known)."""
    from transformers.masking_utils import sdpa_mask

    kwargs["allow_is_causal_skip"] = False
    q_offset = int(q_offset)
    return sdpa_mask(batch_size, q_length, q_offset + q_length, q_offset=q_offset, kv_offset=0, **kwargs)


def kvcompress_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers attention function.

    query [B, Hq, q, D], key/value [B, H, held, D] -> (output [B, q, Hq, Dv], None).
    """
    from kvcompress.sparse.state import take_pending

    layer = take_pending(key)
    if layer is None:
        return _dense_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    state, step = layer.sparse, layer.sparse.step
    step.mask = held_mask(attention_mask, state.positions(key.shape[2], key), query.shape[2])
    step.index = state.policy.select(state, query, step.mask)
    step.mass_queries = state.policy.mass_queries(query.shape[2])
    backend = getattr(module, "_kvcompress_backend", None) or _backend("torch")
    out, mass = backend(query, layer, scaling)
    state.tokens_read = step.index.shape[-1] if step.index is not None else key.shape[2]
    state.policy.after_attention(layer, state, mass, step.mask[:, :, -1, :])
    state.step = None  # drop this step's dense K/V
    return out.transpose(1, 2).contiguous(), None


def held_mask(attention_mask, pos: torch.Tensor, q_len: int) -> torch.Tensor:
    """The mask of the held tokens: pos [B, H, held] positions -> [B, H, q, held] bool, True = attend."""
    b, h, held = pos.shape
    if attention_mask is None:
        seen = int(pos.max()) + 1 if held else q_len
        q_pos = torch.arange(seen - q_len, seen, device=pos.device)
        return (pos[:, :, None, :] <= q_pos[:, None]).expand(b, h, q_len, held)
    m = attention_mask
    if m.dtype != torch.bool:  # an additive float mask: 0 where allowed
        m = m > torch.finfo(m.dtype).min / 2
    m = m.expand(b, h, q_len, m.shape[-1])
    return m.gather(3, pos[:, :, None, :].expand(b, h, q_len, held))


def _dense_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is not None and attention_mask.shape[-1] != key.shape[-2]:
        attention_mask = attention_mask[..., -key.shape[-2]:]
    return sdpa_attention_forward(
        module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
    )


# -- switching it on and off ----------------------------------------------------------------------
def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, kvcompress_attention)
    AttentionMaskInterface.register(NAME, kvcompress_mask)


def _backend(backend: str | Callable) -> Callable:
    from kvcompress.sparse.attention import BACKENDS

    if callable(backend):
        return backend
    if backend not in BACKENDS:
        raise ConfigError(f"unknown kvcompress attention backend {backend!r}; available: {sorted(BACKENDS)}")
    return BACKENDS[backend]


def enable(model, backend: str | Callable = "torch"):
    """Run `model`'s attention through kvcompress (needed by sparse configs). Returns the model.

    backend: "torch" (the reference), another name in kvcompress.sparse.attention.BACKENDS, or a
    function (query, layer, scaling) -> (output, mass). MLA models also get absorbed attention.
    """
    from kvcompress.layout.arch import ModelLayout
    from kvcompress.sparse.state import clear_pending

    fn = _backend(backend)
    _register()
    clear_pending()
    if getattr(model, "_kvcompress_restore", None) is None:
        previous = model.config._attn_implementation
        model.set_attn_implementation(NAME)
        undo_mla = None
        if ModelLayout.from_model_config(model.config).attention == "mla":
            from kvcompress.layout.mla_attention import patch_mla

            undo_mla = patch_mla(model)
        model._kvcompress_restore = (previous, undo_mla)
    for m in model.modules():
        if hasattr(m, "layer_idx"):
            m._kvcompress_backend = fn
    return model


def disable(model):
    """Restore the attention implementation `model` had before `enable`. Returns the model."""
    from kvcompress.sparse.state import clear_pending

    restore = getattr(model, "_kvcompress_restore", None)
    if restore is None:
        return model
    previous, undo_mla = restore
    if undo_mla is not None:
        undo_mla()
    model.set_attn_implementation(previous)
    for m in model.modules():
        if hasattr(m, "_kvcompress_backend"):
            del m._kvcompress_backend
    model._kvcompress_restore = None
    clear_pending()
    return model


@contextlib.contextmanager
def enabled(model, backend: str | Callable = "torch"):
    """`with kvcompress.enabled(model): ...` enables the kvcompress attention for the block only."""
    already = getattr(model, "_kvcompress_restore", None) is not None
    enable(model, backend)
    try:
        yield model
    finally:
        if not already:
            disable(model)
