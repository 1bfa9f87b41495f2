"""The `kvcompress` attention implementation, switched on per model and scoped.

    kvcompress.enable(model)             # model.config._attn_implementation == "kvcompress"
    ...
    kvcompress.disable(model)            # back to what it was
    with kvcompress.enabled(model): ...  # both

Registered with transformers' AttentionInterface (the function) and AttentionMaskInterface (its mask)
under the name "kvcompress"; nothing of transformers is patched. Sparse cache layers (H2O,
StreamingLLM, SnapKV, Quest) only run under it: it hands the policy the query and the attention
weights (kvcompress.sparse.step; MLA layers, whose attention the absorbed forward computes, take the same
steps there). Every other layer (dense, quantization-only, sliding-window, or a plain DynamicCache) gets
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
    from kvcompress.kernels.attention_backend import attend_layer, take_deferred
    from kvcompress.sparse.state import take_pending
    from kvcompress.sparse.step import begin_sparse_step, finish_sparse_step

    if scaling is None:
        scaling = getattr(module, "scaling", query.shape[-1] ** -0.5)
    layer = take_pending(key)
    deferred = take_deferred(key)  # a fused decode step: `key` is only the new token
    if layer is None:
        if deferred is not None:
            return attend_layer(query, deferred, scaling, key, value).transpose(1, 2).contiguous(), None
        return _dense_attention(module, query, key, value, attention_mask, scaling, dropout, **kwargs)
    begin_sparse_step(layer, query, key, attention_mask, scaling, deferred is not None)
    backend = getattr(module, "_kvcompress_backend", None) or _backend("torch")
    if layer.sparse.step.deferred:  # there is no dense K/V to give another backend
        backend = _backend("fused")
    out, mass = backend(query, layer, scaling)
    finish_sparse_step(layer, mass)
    return out.transpose(1, 2).contiguous(), None


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


def enable(model, backend: str | Callable = "fused"):
    """Run `model`'s attention through kvcompress (needed by sparse configs). Returns the model.

    backend: "fused" (decode steps of compressed layers run the fused kernel where
    `kvcompress.kernels.select_backend()` says "triton", i.e. on CUDA or with KVCOMPRESS_KERNELS=triton;
    the torch reference elsewhere), "torch" (the reference only), another name in
    kvcompress.sparse.attention.BACKENDS, or a function (query, layer, scaling) -> (output, mass).
    MLA models also get absorbed attention.
    """
    from kvcompress.layout.arch import ModelLayout
    from kvcompress.sparse.state import clear_pending

    fn = _backend(backend)
    _register()
    clear_pending()
    _remove_forward_hooks(model)
    if backend == "fused":
        _add_forward_hooks(model)
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
    model._kvcompress_backend_arg = backend  # what `enabled` restores when it nests in an earlier enable
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
    _remove_forward_hooks(model)
    for m in model.modules():
        if hasattr(m, "_kvcompress_backend"):
            del m._kvcompress_backend
    model._kvcompress_restore = None
    model._kvcompress_backend_arg = None
    clear_pending()
    return model


def _add_forward_hooks(model) -> None:
    """Scope the fused decode path to this model's forwards (removed by `disable`)."""
    from kvcompress.kernels.attention_backend import begin_forward, end_forward, known_starts, left_padding
    from kvcompress.kernels.backend import select_backend

    def before(module, args, kwargs):
        device = next(module.parameters()).device
        if select_backend(device) != "triton":
            begin_forward(False)
            return
        if known_starts() is not None:  # a decode graph's step: the row starts were read once, up front
            begin_forward(True, known_starts())
            return
        # left padding: each row's first real position goes to the kernel; other masks: the torch path
        readable, starts = left_padding(kwargs.get("attention_mask", args[1] if len(args) > 1 else None))
        begin_forward(readable, starts)

    def after(module, args, kwargs, output):
        end_forward()

    model._kvcompress_hooks = (
        model.register_forward_pre_hook(before, with_kwargs=True),
        model.register_forward_hook(after, with_kwargs=True, always_call=True),
    )


def _remove_forward_hooks(model) -> None:
    for handle in getattr(model, "_kvcompress_hooks", None) or ():
        handle.remove()
    model._kvcompress_hooks = None


@contextlib.contextmanager
def enabled(model, backend: str | Callable = "fused"):
    """`with kvcompress.enabled(model): ...` enables the kvcompress attention for the block only; on a model
    enabled before, the block's backend is undone to the earlier one on exit."""
    was_enabled = getattr(model, "_kvcompress_restore", None) is not None
    earlier = getattr(model, "_kvcompress_backend_arg", None) if was_enabled else None
    enable(model, backend)
    try:
        yield model
    finally:
        if earlier is None:
            disable(model)
        else:
            enable(model, earlier)
