"""A `CompressedLayer` whose decode step runs at fixed addresses, so a CUDA graph can replay it.

A captured step cannot run Python: every length that changes from step to step must live on the device,
and every buffer it reads must stay where it was at capture. `StaticLayer` gives a layer that:
- the tail is a buffer of R + P tokens (residual window + one page); the step writes the new token at
  `tail_n` (a [1] int64 on the device) and increments it, and the fused kernel reads the tail's length from
  it (`AttentionParts.tail_lengths`);
- the body is a `PagedStore` with room reserved for `max_tokens`, so page writes never move it, and the
  kernel reads the body's length from `body_len` ([B] int32 on the device) over a split plan made for the
  whole reservation (splits past the length read nothing);
- everything the host must know (tokens seen, the tail's length, when a page fills) is advanced by the host
  after each step (`advance`), outside the graph. A page is encoded there, eagerly, *before* the step that
  would fill the tail (when it holds R + P - 1 tokens, its oldest P are all known), so the cache holds
  exactly what the growing layer holds after every step (with R = 0 the page is encoded after the step
  that fills it: that step read its P tokens exact).
- an H2O layer over quantized pages (kvcompress.graph.static_h2o) reserves room for its budget, not for
  `max_tokens`: the step adds the attention mass to a score buffer, and `advance` evicts when the growing
  layer would, gathering the kept pages to the front of the buffers in place.
- a Quest layer over quantized pages (kvcompress.graph.static_quest) keeps its page summaries in buffers
  for the whole reservation: the step scores them and takes the top pages as the growing layer does, and a
  page's summary is written when the page is flushed into the body.

Shapes: tail buffers [B, H, R + P, D] in the model dtype; the new token [B, H, 1, D].
"""

from __future__ import annotations

import weakref

import torch

from kvcompress.config import ConfigError
from kvcompress.graph.static_h2o import StaticH2O, h2o_room_pages, static_h2o_supported
from kvcompress.graph.static_quest import StaticQuest, static_quest_supported
from kvcompress.kernels.attention_backend import defers_dense
from kvcompress.kernels.parts import AttentionParts, PackedStream


def static_sparse_supported(layer) -> bool:
    """Whether a decode graph can hold this sparse layer (H2O or Quest over quantized pages)."""
    return static_h2o_supported(layer) or static_quest_supported(layer)


class StaticLayer:
    def __init__(self, layer, max_tokens: int):
        p = layer.policy
        if not layer.is_initialized or not layer.compressed or (
                layer.sparse is not None and not static_sparse_supported(layer)):
            raise ConfigError(
                f"layer {layer.layer_idx}: a captured decode step needs a compressed layer without a "
                "sparsity policy (quantization presets such as nuq4, int4, fp8) or with H2O (nuq4+h2o-20) or "
                "Quest (nuq4+quest-1024)"
            )
        if layer.key_store.n_tokens == 0:
            raise ConfigError(f"layer {layer.layer_idx} holds no packed page yet: decode until it does")
        # a weak reference: the layer holds this object, and a cycle would keep a dropped cache's memory alive
        # until the garbage collector runs
        self._layer = weakref.ref(layer)
        self.page, self.residual = p.page_size, p.residual
        self.max_tokens = max_tokens
        pages = -(-max(max_tokens - layer.sink_k.shape[2] - p.residual, 0) // p.page_size) + 1
        h2o, quest = static_h2o_supported(layer), static_quest_supported(layer)
        if h2o:  # H2O: its budget bounds the body
            pages = min(pages, h2o_room_pages(layer, max_tokens))
        layer.key_store.reserve(pages)
        layer.value_store.reserve(pages)
        size = p.residual + p.page_size
        self.h2o = StaticH2O(layer, layer.key_store.capacity, size) if h2o else None
        self.quest = StaticQuest(layer, layer.key_store.capacity, max_tokens) if quest else None
        self.tail_k = self._buffer(layer.tail_k, size)
        self.tail_v = self._buffer(layer.tail_v, size)
        self.n_tail = layer.tail_k.shape[2]
        dev = self.tail_k.device
        self.tail_n = torch.tensor([self.n_tail], dtype=torch.int64, device=dev)
        self.body_len = torch.full(
            (self.tail_k.shape[0],), layer.key_store.n_tokens, dtype=torch.int32, device=dev
        )
        self._flush_if_due()
        self._views()
        if self.quest is not None:
            self.quest.prepare(layer, self.n_tail)

    @property
    def layer(self):
        return self._layer()

    @staticmethod
    def _buffer(tail: torch.Tensor, size: int) -> torch.Tensor:
        buf = tail.new_zeros((*tail.shape[:2], size, tail.shape[-1]))
        buf[:, :, : tail.shape[2]].copy_(tail)
        return buf

    # -- inside the step (captured) ---------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor):
        """Write the new token [B, H, 1, D] into the tail on the device; the fused kernel attends."""
        if key_states.shape[2] != 1:
            raise ConfigError(
                f"layer {self.layer.layer_idx} is in a decode graph: it takes one token per step, got "
                f"{key_states.shape[2]}. Call DecodeGraph.release() before another prefill."
            )
        self.tail_k.index_copy_(2, self.tail_n, key_states)
        self.tail_v.index_copy_(2, self.tail_n, value_states)
        self.tail_n.add_(1)
        if not defers_dense(self.layer, key_states):
            raise ConfigError(
                "a decode graph runs on the fused Triton path: call kvcompress.enable(model) and run on CUDA "
                "(or KVCOMPRESS_KERNELS=triton)"
            )
        return key_states, value_states

    def parts(self, row_starts: torch.Tensor | None = None) -> AttentionParts:
        """What the kernel reads: the reserved buffers whole, the lengths on the device; row_starts [B]: left
        padding (see AttentionParts)."""
        layer, ks, vs = self.layer, self.layer.key_store, self.layer.value_store
        key = PackedStream(ks.codec, ks.buffers, ks.row, ks.capacity)
        value = PackedStream(vs.codec, vs.buffers, vs.row, vs.capacity)
        return AttentionParts(
            key,
            value,
            layer.sink_k,
            layer.sink_v,
            self.tail_k,
            self.tail_v,
            body_lengths=self.body_len,
            row_starts=row_starts,
            tail_lengths=self.tail_n,
        )

    # -- on the host, after each step ---------------------------------------------------------------
    def advance(self) -> None:
        """Account for one step that ran: tokens seen, the tail's length, and the next page when due."""
        layer = self.layer
        layer.cumulative_length += 1
        self.n_tail += 1
        if self.quest is not None:
            self.quest.ran(layer, self.n_tail)
        if self.h2o is not None:
            # evict after the step with the tokens split between body and tail as the growing layer had them:
            # it encodes a page before the attention of the step that fills its tail (R = 0: that step's)
            if not self.residual:
                self._flush_if_due()
            self._views()
            if self.h2o.evict(layer):
                self.body_len.fill_(layer.key_store.n_tokens)
            state = layer.sparse
            state.read_held, state.read_index = layer.held_tokens, None
            state.read_body = (layer.sink_k.shape[2], layer.key_store.n_tokens)
        self._flush_if_due()
        self._views()
        if self.quest is not None:
            self.quest.prepare(layer, self.n_tail)

    def _flush_if_due(self) -> None:
        p, r = self.page, self.residual
        if self.n_tail < (r + p - 1 if r else p):
            return
        ks, vs = self.layer.key_store, self.layer.value_store
        if ks.n_tokens + p > ks.capacity:
            raise ConfigError(
                f"the decode graph was built for max_tokens={self.max_tokens} and layer "
                f"{self.layer.layer_idx} is full; build a new DecodeGraph with a larger max_tokens"
            )
        if self.h2o is not None:
            self.h2o.flush(self.layer.sparse, ks.n_tokens, self.n_tail, p, self.layer.cumulative_length)
        if self.quest is not None:
            self.quest.flush(self.tail_k[:, :, :p], self.layer)
        ks.append(self.tail_k[:, :, :p])
        vs.append(self.tail_v[:, :, :p])
        rest = self.n_tail - p
        self.tail_k[:, :, :rest] = self.tail_k[:, :, p : self.n_tail].clone()
        self.tail_v[:, :, :rest] = self.tail_v[:, :, p : self.n_tail].clone()
        self.n_tail = rest
        self.tail_n.fill_(rest)
        self.body_len.fill_(ks.n_tokens)

    def _views(self) -> None:
        """The layer's own tail: views of the filled part (held_tokens, dense() and memory stay right)."""
        self.layer.tail_k = self.tail_k[:, :, : self.n_tail]
        self.layer.tail_v = self.tail_v[:, :, : self.n_tail]

    def release(self) -> None:
        """Back to a growing layer (the tail copied out; the body keeps its reservation until it is full)."""
        if self.h2o is not None:
            self.h2o.release(self.layer)
        if self.quest is not None:
            self.quest.release(self.layer, self.tail_k[:, :, : self.n_tail])
        self.layer.tail_k = self.tail_k[:, :, : self.n_tail].clone()
        self.layer.tail_v = self.tail_v[:, :, : self.n_tail].clone()
        self.layer.static = None
