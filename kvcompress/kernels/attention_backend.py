"""The fused decode path of the `kvcompress` attention: which steps take it, and the backend that runs them.

A decode step (one query token) of a `CompressedLayer` whose codecs the fused kernel reads does not
decode its whole cache: `update()` asks `defers_dense(layer, new_keys)`, and when the answer is yes it
returns the new token itself as a placeholder and the layer is marked *deferred*; the `kvcompress`
attention then takes the mark (`take_deferred`) and runs `layer_decode_attention` over the packed
parts (sinks | packed body | tail). A prefill chunk of a layer without a sparsity policy, or with Quest,
is deferred the same way and runs `prefill_attention` (kvcompress.kernels.prefill_attention: a block of
pages at a time, so no dense copy of the cache is ever held; the chunk's own K/V, which `update()` returned
as the placeholder, read exactly, as the drop-in path reads them); the other sparse layers (H2O, SnapKV,
StreamingLLM) prefill over the dense K/V, since their policies score or reorder the prefill.

A step is deferred only inside a forward of a model enabled with the fused backend
(`kvcompress.enable(model)`), whose pre-hook calls `begin_forward` with the backend
`select_backend()` picks (Triton on CUDA, `KVCOMPRESS_KERNELS=triton|torch` forces one).

Left padding (how `generate()` batches prompts of different lengths): the forward's 2-D attention mask
gives each row's first real position, passed to the kernel as `row_starts`, so padded batches stay on the
fused path. Layers that evict (H2O, SnapKV, StreamingLLM) no longer hold positions in mask order, and a
mask with holes other than left padding is not one the kernel reads: those run on the torch path.

MLA layers (absorbed attention, kvcompress.layout.mla_attention) defer their decode steps too, when the
MLA kernel reads their codecs (`kvcompress.kernels.mla_layer.mla_fused_supported`); their prefill always
runs over the latent update() returns.

Sparse layers: Quest passes its selected body pages as the kernel's page list (the kernel always reads
the exact sinks and the whole tail, which Quest's selection always holds: the same tokens as the torch
path); H2O takes the per-token attention the kernel returns. Full-precision layers under an evicting policy
(H2O, with or without per-kv-head budgets, StreamingLLM, SnapKV) defer their decode steps too: the kernel
reads their held tokens in place (kvcompress.kernels.parts.dense_parts / ragged_parts), where the torch
reference would copy them to fp32 (and, with per-head budgets, rebuild a padded view) every step. Nothing
here imports transformers or Triton.
"""

from __future__ import annotations

import contextlib
import threading

import torch

from kvcompress.config import ConfigError

_local = threading.local()
_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# -- the forward scope --------------------------------------------------------------------------------
def begin_forward(use_fused: bool, row_starts: torch.Tensor | None = None) -> None:
    """Called before a model forward: decode steps of supported layers may defer their dense K/V.
    row_starts [B]: the first real position of each row (left padding), None without padding."""
    _local.fused = use_fused
    _local.deferred = None
    _local.row_starts = row_starts


def fused_active() -> bool:
    """Whether the current forward runs on the fused backend (set by `begin_forward`)."""
    return bool(getattr(_local, "fused", False))


def current_row_starts() -> torch.Tensor | None:
    """The row starts [B] of the forward in progress (left padding; None without), as `begin_forward` got them."""
    return getattr(_local, "row_starts", None)


def end_forward() -> None:
    _local.fused = False
    _local.deferred = None
    _local.row_starts = None


@contextlib.contextmanager
def known_row_starts(row_starts: torch.Tensor):
    """Inside the block, model forwards take these row starts [B] instead of reading the attention mask: a
    captured decode step (kvcompress.graph) cannot read a mask, which takes a host sync."""
    _local.known_starts = row_starts
    try:
        yield
    finally:
        _local.known_starts = None


def known_starts() -> torch.Tensor | None:
    return getattr(_local, "known_starts", None)


def batch_has_padding(attention_mask) -> bool:
    """True when a 2-D padding mask [B, T] masks any position (one host sync per forward)."""
    return isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all())


def left_padding(attention_mask) -> tuple[bool, torch.Tensor | None]:
    """(whether the fused kernel can read this mask, row_starts [B] or None) from a 2-D mask [B, T]:
    no mask or no padding -> (True, None); pure left padding -> (True, first real position per row);
    any other hole -> (False, None). One host sync per forward."""
    if not batch_has_padding(attention_mask):
        return True, None
    real = attention_mask.bool()
    starts = real.shape[1] - real.sum(-1)  # [B]
    pure = torch.arange(real.shape[1], device=real.device)[None, :] >= starts[:, None]
    if not torch.equal(real, pure):
        return False, None
    return True, starts.to(torch.int32)


# -- which layers take it ----------------------------------------------------------------------------
def fused_supported(layer) -> bool:
    """Whether the fused kernel can serve `layer`'s decode steps (codecs, head dims, dtype, sparsity)."""
    from kvcompress.kernels.streams import stream_supported

    if not getattr(layer, "is_initialized", False):
        return False
    lossless = not getattr(layer, "compressed", False)
    if lossless and not _lossless_sparse_supported(layer):
        return False
    if getattr(layer, "mla_latent", False):  # absorbed MLA: kvcompress.kernels.mla_layer reads the parts
        from kvcompress.kernels.mla_layer import mla_fused_supported

        return mla_fused_supported(layer)
    codecs = (layer.key_store.codec, layer.value_store.codec)
    if not lossless and not all(stream_supported(c) for c in codecs):
        return False
    if layer.tail_k.dtype not in _DTYPES:
        return False
    for d in (layer.tail_k.shape[-1], layer.tail_v.shape[-1]):
        if d < 16 or d & (d - 1):
            return False
    sparse = getattr(layer, "sparse", None)
    if not lossless and sparse is not None and sparse.policy.keeps_page_summaries:  # Quest: body pages
        if sparse.policy.unread_means:
            return False  # it reads no page means (kvcompress.sparse.unread): the torch attention does
        page = layer.key_store.page_size
        return sparse.policy.page_size == page and layer.sink_k.shape[2] % page == 0
    return True


def _lossless_sparse_supported(layer) -> bool:
    """A full-precision layer: one under an evicting policy (H2O, StreamingLLM, SnapKV) decodes through the
    kernel over its held tokens, read in place (kvcompress.kernels.parts: `dense_parts`, and `ragged_parts` for
    H2O's per-kv-head budgets), which also gives H2O the attention mass without the torch reference's fp32
    copy of the held K/V; one without a policy returns its tail as is, for SDPA. Not here: merged H2O (a size
    bias per token), Quest over full precision and MLA latents run on the torch path, as do layers that ever
    saw padding (dead slots the kernel cannot mask). The dtype and head dims are checked by the caller."""
    sparse = getattr(layer, "sparse", None)
    if sparse is None or getattr(layer, "mla_latent", False):
        return False
    policy = sparse.policy
    return not (policy.keeps_page_summaries or getattr(policy, "merge", False) or sparse.pad_max)


def defers_dense(layer, new_keys: torch.Tensor) -> bool:
    """Called by `CompressedLayer.update` after appending new_keys [B, H, q, D]: True when this step's
    attention reads the packed parts, so the layer need not decode its dense K/V (it is then marked).
    Decode steps (q = 1) run the fused kernel; prefill chunks (q > 1) run `prefill_attention` (a block of
    pages at a time) in layers without a sparsity policy and in Quest layers (which evict nothing and need
    no prefill scores); the other sparse layers prefill over the dense K/V, since their policies score the
    prefill's attention or hold positions out of order."""
    if not getattr(_local, "fused", False) or not fused_supported(layer):
        return False
    if getattr(layer, "mla_latent", False) and new_keys.shape[2] > 1:
        return False  # an MLA prefill attends over the latent update() returns
    sparse = getattr(layer, "sparse", None)
    if new_keys.shape[2] > 1 and sparse is not None and not (
            sparse.policy.keeps_page_summaries and sparse.pos is None):
        return False
    if getattr(_local, "row_starts", None) is not None and sparse is not None:
        return False  # padded rows over held positions that no longer follow the mask (see the module doc)
    if getattr(_local, "deferred", None) is not None:
        waiting = _local.deferred[0]
        _local.deferred = None
        raise ConfigError(
            f"layer {waiting.layer_idx} deferred its attention to the kvcompress fused path, but the model ran "
            "another attention implementation. Use `kvcompress.enable(model)` / `kvcompress.disable(model)` "
            "rather than changing the attention implementation directly."
        )
    _local.deferred = (layer, new_keys)
    return True


def take_deferred(key: torch.Tensor):
    """The deferred layer whose update returned `key` (clears the mark), or None."""
    entry = getattr(_local, "deferred", None)
    if entry is None or entry[1] is not key:
        return None
    _local.deferred = None
    return entry[0]


# -- the attention itself ----------------------------------------------------------------------------
def attend_layer(query: torch.Tensor, layer, scaling: float, key: torch.Tensor, value: torch.Tensor
                 ) -> torch.Tensor:
    """Attention of a deferred dense (not sparse) layer, or of an H2O or Quest layer held by a decode graph
    (whose step adds the attention mass to the graph's score buffer, kvcompress.graph.static_h2o, or selects
    its pages, kvcompress.graph.static_quest): query
    [B, Hq, q, D] -> [B, Hq, q, Dv]; the fused kernel for a decode step (q = 1), `prefill_attention` for a
    prefill chunk, whose own K/V [B, H, q, D] (what the deferred update returned) it attends to exactly, as
    the drop-in path does."""
    row_starts = getattr(_local, "row_starts", None)
    if query.shape[2] > 1:
        from kvcompress.kernels.prefill_attention import prefill_attention

        return prefill_attention(query, layer, scaling, row_starts, chunk=(key, value))
    from kvcompress.kernels.decode_attention import layer_decode_attention

    static = getattr(layer, "static", None)  # a decode graph's H2O layer: its step adds the mass to its scores
    scores = static.h2o.scores if static is not None and static.h2o is not None else None
    # a decode graph's Quest layer: the step selects its pages (kvcompress.graph.static_quest)
    quest = static.quest if static is not None else None
    page_list = quest.select(query[:, :, 0], scaling) if quest is not None else None
    out, probs = layer_decode_attention(layer, query[:, :, 0], scaling, page_list, backend="triton",
                                        row_starts=row_starts, return_probs=scores is not None)
    if scores is not None:
        scores.add_(probs)
    return out[:, :, None]


def attend_fused(query: torch.Tensor, layer, scaling: float, deferred: bool = False):
    """The sparse-attention backend (kvcompress.sparse.attention.BACKENDS["fused"]).

    On a deferred decode step: the fused kernel over the packed parts, with Quest's pages as the page
    list and, when the policy wants it, the per-token attention mass [B, H, held] (H2O). On a deferred
    prefill chunk (Quest): `prefill_attention`. On any other step (prefill, torch backend): the torch
    reference over the dense K/V.
    """
    from kvcompress.sparse.attention import attend_torch

    if not deferred:
        return attend_torch(query, layer, scaling)
    if query.shape[2] > 1:  # a deferred prefill chunk (Quest reads everything at prefill), its own K/V exact
        from kvcompress.kernels.prefill_attention import prefill_attention

        step = layer.sparse.step  # a deferred step's keys / values are the chunk update() returned
        starts = getattr(_local, "row_starts", None)
        return prefill_attention(query, layer, scaling, starts, chunk=(step.keys, step.values)), None
    from kvcompress.kernels.decode_attention import layer_decode_attention

    step = layer.sparse.step
    page_list = quest_page_list(layer, step.index) if step.index is not None else None
    out, probs = layer_decode_attention(
        layer, query[:, :, 0], scaling, page_list, return_probs=step.mass_queries > 0, backend="triton"
    )
    return out[:, :, None], probs


def quest_page_list(layer, index: torch.Tensor) -> torch.Tensor:
    """Quest's held-token selection index [B, H, k*P + last] -> body page list [B, H, k+1] (-1: not in the
    body).

    Quest lists k whole pages (sorted; under budget sharing a head that reads fewer starts with pages of
    -1, which list -1) then the `last` newest tokens (`read_last`: the exact tail, which the kernel reads
    anyway, or the newest page when the tail is empty and that page is in the body); held tokens are
    positions (Quest evicts nothing) and its pages line up with the body's (checked by `fused_supported`).
    """
    from kvcompress.sparse.quest import read_last

    page = layer.key_store.page_size
    newest = read_last(layer.held_tokens, page, layer.tail_k.shape[2])
    k = (index.shape[-1] - newest) // page
    first = index[:, :, : k * page + 1 : page]  # first token of each selected page and the newest [B, H, k+1]
    body_page = (first - layer.sink_k.shape[2]) // page
    inside = (body_page >= 0) & (body_page < layer.key_store.n_pages)
    return torch.where(inside, body_page, torch.full_like(body_page, -1))
