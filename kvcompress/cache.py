"""CompressedCache: a drop-in `transformers.Cache` whose layers keep K and V compressed.

    cache = CompressedCache(model.config, "nuq4")
    out = model.generate(**inputs, past_key_values=cache)
    cache.memory_report()

Each full-attention layer keeps, per stream (keys, values), three parts in token order:
``sinks`` (first S tokens, exact) | ``body`` (a PagedStore of packed pages) | ``tail`` (newest
tokens in the model dtype: the partly filled page plus the residual window R). New tokens join
the tail; whenever the tail holds R + P tokens or more, its oldest whole pages are encoded into the
body, so nothing stored is ever re-quantized. `update()` returns the dense K/V for any attention
implementation (a prefill chunk's own tokens exact, the tokens held before it as stored); the `kvcompress`
attention reads the parts directly, to the same effect.
Sliding-window layers keep transformers' bounded sliding layer (exact, never more than W tokens).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicSlidingWindowLayer

from kvcompress.config import ConfigError, KVCompressConfig, LayerPolicy
from kvcompress.kernels.attention_backend import defers_dense
from kvcompress.layout.arch import ModelLayout
from kvcompress.layout.grow import append_in_place
from kvcompress.layout.store import PagedStore
from kvcompress.memory import LayerMemory, layer_memory_from_tensors, storage_bytes
from kvcompress.quant.base import Role
from kvcompress.quant.factory import make_codec
from kvcompress.sparse.state import attach_sparsity, body_tokens_read, tokens_read


def _empty_like_tokens(x: torch.Tensor) -> torch.Tensor:
    """[B, H, 0, D] with x's dtype and device, sharing no storage with x."""
    return x.new_empty((*x.shape[:2], 0, x.shape[-1]))


class CompressedLayer(CacheLayerMixin):
    """One full-attention layer: sinks | packed body | full-precision tail, per stream."""

    is_sliding = False
    is_compileable = False
    is_croppable = True

    def __init__(self, policy: LayerPolicy, layer_idx: int = 0):
        super().__init__()
        self.policy = policy
        self.layer_idx = layer_idx
        self.cumulative_length = 0  # tokens seen (positions), may exceed what is held after eviction
        self.sparse = None  # a kvcompress.sparse SparseState when the policy has sparsity
        self.static = None  # a kvcompress.graph StaticLayer while a DecodeGraph holds this layer
        # an H2O layer with per-kv-head budgets: the tokens each head kept, packed (kvcompress.sparse.ragged);
        # the held tokens are its padded view, then the tail
        self.ragged = None
        # MLA: the absorbed attention reads the latent update() returns, so update() must always return it
        # (the fused GQA path, which defers it, does not serve these layers)
        self.mla_latent = False
        # a full-precision sparse layer's tail is a view of these buffers, which have room for the next tokens
        self.room_k = self.room_v = None

    # `keys` / `values`: the dense states, for code that reads a layer's tensors directly.
    @property
    def keys(self):
        return self.dense()[0] if self.is_initialized else None

    @keys.setter
    def keys(self, value):
        if value is not None:
            raise AttributeError("CompressedLayer.keys is derived from the compressed store and cannot be set")

    @property
    def values(self):
        return self.dense()[1] if self.is_initialized else None

    @values.setter
    def values(self, value):
        if value is not None:
            raise AttributeError("CompressedLayer.values is derived from the compressed store and cannot be set")

    # -- life cycle ----------------------------------------------------------------------------
    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """key_states: [B, H, T, Dk], value_states: [B, H, T, Dv] (Dk may differ from Dv, e.g. MLA)."""
        self.device, self.dtype = key_states.device, key_states.dtype
        p = self.policy
        self.compressed = not (p.key.is_lossless and p.value.is_lossless)
        stores = []
        for s, (spec, x) in enumerate(((p.key, key_states), (p.value, value_states))):
            name = "key" if s == 0 else "value"
            codec = make_codec(
                spec,
                page_size=p.page_size,
                head_dim=x.shape[-1],
                num_heads=x.shape[1],
                dtype=x.dtype,
                tensors={k: v.to(x.device) for k, v in p.stream_tensors(name).items()},
                seed=2 * self.layer_idx + s,
            ).to(x.device)  # codebooks and rotations beside the data: no host copy per step (and capturable)
            stores.append(PagedStore(codec))
        self.key_store, self.value_store = stores
        # empty tensors of their own: a [:, :, :0] view would pin the whole prefill's storage
        self.sink_k, self.sink_v = _empty_like_tokens(key_states), _empty_like_tokens(value_states)
        self.tail_k, self.tail_v = _empty_like_tokens(key_states), _empty_like_tokens(value_states)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append new tokens [B, H, q, D]; return the dense K, V [B, H, held, D] the attention consumes.

        A prefill chunk (q > 1) gets the tokens held before it decoded and its own q tokens exact, as they
        were computed (what transformers' QuantizedCache and KIVI do): compression costs the tokens that come
        later, never the prompt's own forward. Attending a long prompt over its own compressed K/V compounds
        the error through the layers (nuq4 at 4096 tokens: 20x the passkey log-probability loss, BENCHMARKS).
        A decode step's token sits in the exact tail (residual >= 1) either way."""
        if self.static is not None:  # a captured decode step: fixed addresses, lengths on the device
            return self.static.update(key_states, value_states)
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        if not self.compressed and self.sparse is None:
            # Lossless: exactly what transformers' DynamicLayer does.
            self.tail_k = torch.cat([self.tail_k, key_states], dim=-2)
            self.tail_v = torch.cat([self.tail_v, value_states], dim=-2)
            k, v = self.dense()
        elif not self.compressed:
            # full precision under a sparsity policy: appended in place (kvcompress.layout.grow); a decode step
            # on the fused path reads the held tokens itself (the new ones are only a placeholder)
            spare = self.sparse.policy.page_size  # the policy evicts a page at a time (calib.held counts it)
            self.tail_k, self.room_k = append_in_place(self.tail_k, key_states, self.room_k, spare)
            self.tail_v, self.room_v = append_in_place(self.tail_v, value_states, self.room_v, spare)
            k, v = (key_states, value_states) if defers_dense(self, key_states) else self.dense()
        else:
            self.append(key_states, value_states)
            # a fused step reads the packed parts itself: the new tokens are only a placeholder
            if defers_dense(self, key_states):
                k, v = key_states, value_states
            else:
                k, v = self.dense()
                if key_states.shape[2] > 1:  # a prefill chunk attends to its own tokens as computed
                    k[:, :, -key_states.shape[2]:] = key_states
                    v[:, :, -value_states.shape[2]:] = value_states
        if self.sparse is not None:  # the kvcompress attention (or the absorbed MLA forward) reads the step
            # an MLA token's key is its latent and RoPE key together: Quest summarises both parts
            new_keys = torch.cat([key_states, value_states], -1) if self.mla_latent else key_states
            self.sparse.on_update(self, new_keys, k, v, value_states)
        return k, v

    def append(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Add tokens to sinks / tail, then encode the tail's oldest whole pages into the body."""
        n_sink = min(max(self.policy.sinks - self.sink_k.shape[2], 0), key_states.shape[2])
        if n_sink:
            self.sink_k = torch.cat([self.sink_k, key_states[:, :, :n_sink]], dim=2)
            self.sink_v = torch.cat([self.sink_v, value_states[:, :, :n_sink]], dim=2)
            key_states, value_states = key_states[:, :, n_sink:], value_states[:, :, n_sink:]
        self.tail_k = torch.cat([self.tail_k, key_states], dim=2)
        self.tail_v = torch.cat([self.tail_v, value_states], dim=2)
        self._flush()

    def _flush(self) -> None:
        p = self.policy
        n_pages = (self.tail_k.shape[2] - p.residual) // p.page_size
        if n_pages <= 0:
            return
        n = n_pages * p.page_size
        # statistics frozen at the first flush see every token available then (not the sinks)
        self.key_store.prepare(self.tail_k)
        self.value_store.prepare(self.tail_v)
        self.key_store.append(self.tail_k[:, :, :n])
        self.value_store.append(self.tail_v[:, :, :n])
        self.tail_k = self.tail_k[:, :, n:].clone()
        self.tail_v = self.tail_v[:, :, n:].clone()

    def dense(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The held tokens decoded: K [B, H, held, Dk], V [B, H, held, Dv] in the model dtype."""
        if not self.compressed:
            if self.ragged is None:
                return self.tail_k, self.tail_v
            k, v = self.ragged.padded()  # per-kv-head budgets: rebuilt for the step, freed after it
            return torch.cat([k, self.tail_k], 2), torch.cat([v, self.tail_v], 2)
        ks = [self.sink_k, self.key_store.decode(self.dtype), self.tail_k]
        vs = [self.sink_v, self.value_store.decode(self.dtype), self.tail_v]
        return torch.cat([k for k in ks if k is not None], 2), torch.cat([v for v in vs if v is not None], 2)

    # -- lengths -------------------------------------------------------------------------------
    @property
    def held_tokens(self) -> int:
        if not self.is_initialized:
            return 0
        ragged = self.ragged.width if self.ragged is not None else 0
        return self.sink_k.shape[2] + self.key_store.n_tokens + ragged + self.tail_k.shape[2]

    def get_seq_length(self, *args) -> int:
        return self.cumulative_length

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # 5.x passes the query length (an int); older releases a cache_position tensor.
        q = query_length if isinstance(query_length, int) else int(query_length.shape[0])
        return self.held_tokens + q, 0

    def get_max_length(self) -> int:
        return -1

    def get_max_cache_shape(self) -> int:
        return -1

    # -- editing ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.static = None
        self.ragged = None
        self.room_k = self.room_v = None
        self.is_initialized = False
        self.cumulative_length = 0
        if self.sparse is not None:
            self.sparse.reset()
        for name in ("key_store", "value_store", "sink_k", "sink_v", "tail_k", "tail_v"):
            self.__dict__.pop(name, None)

    def crop(self, tokens_to_remove: int) -> None:
        """Negative: remove that many newest tokens (5.24+). Positive: keep that many (older 5.x)."""
        if not self.is_initialized:
            return
        if self.static is not None:  # a decode graph's buffers would move: the graph can no longer replay
            self.static.release()
        if self.sparse is not None:
            raise NotImplementedError(f"layer {self.layer_idx} has a sparsity policy; cropping it is not supported")
        held = self.held_tokens
        keep = held + tokens_to_remove if tokens_to_remove <= 0 else min(tokens_to_remove, held)
        if keep < 0:
            raise ValueError(f"cannot remove {-tokens_to_remove} tokens from a layer holding {held}")
        self._truncate(keep)
        self.cumulative_length -= held - keep

    def _truncate(self, keep: int) -> None:
        """Keep the oldest `keep` held tokens."""
        n_sink, n_body = self.sink_k.shape[2], self.key_store.n_tokens
        if keep >= n_sink + n_body:
            self.tail_k = self.tail_k[:, :, : keep - n_sink - n_body].clone()
            self.tail_v = self.tail_v[:, :, : keep - n_sink - n_body].clone()
            return
        if keep >= n_sink:
            # pages past `keep` come back into the tail as full precision (they were already lossy)
            pages_kept = (keep - n_sink) // self.key_store.page_size
            drop = self.key_store.n_pages - pages_kept
            k = self.key_store.pop_pages(drop, self.dtype)
            v = self.value_store.pop_pages(drop, self.dtype)
            rest = keep - n_sink - pages_kept * self.key_store.page_size
            self.tail_k, self.tail_v = k[:, :, :rest].clone(), v[:, :, :rest].clone()
            return
        if n_body:
            self.key_store.pop_pages(self.key_store.n_pages, self.dtype)
            self.value_store.pop_pages(self.value_store.n_pages, self.dtype)
        self.sink_k, self.sink_v = self.sink_k[:, :, :keep].clone(), self.sink_v[:, :, :keep].clone()
        self.tail_k, self.tail_v = _empty_like_tokens(self.tail_k), _empty_like_tokens(self.tail_v)

    def _map_batch(self, fn) -> None:
        if not self.is_initialized:
            return
        if self.static is not None:
            self.static.release()
        self.sink_k, self.sink_v = fn(self.sink_k), fn(self.sink_v)
        self.tail_k, self.tail_v = fn(self.tail_k), fn(self.tail_v)
        self.room_k = self.room_v = None  # the mapped tail is a tensor of its own
        if self.ragged is not None:
            self.ragged = self.ragged.map_batch(fn)
        self.key_store.map_batch(fn)
        self.value_store.map_batch(fn)
        if self.sparse is not None:
            self.sparse.map_batch(fn)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._map_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._map_batch(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._map_batch(lambda t: t[indices.to(t.device) if isinstance(indices, torch.Tensor) else indices])

    def offload(self):
        self._map_batch(lambda t: t.to("cpu", non_blocking=True))

    def prefetch(self):
        if self.is_initialized and self.tail_k.device != self.device:
            self._map_batch(lambda t: t.to(self.device, non_blocking=True))

    # -- accounting ------------------------------------------------------------------------
    def memory(self) -> LayerMemory:
        if not self.is_initialized:
            return LayerMemory.empty(self.layer_idx)
        parts = [(t, Role.PAYLOAD if not self.compressed else "window") for t in
                 (self.sink_k, self.sink_v, self.tail_k, self.tail_v, self.room_k, self.room_v)]
        for store in (self.key_store, self.value_store):
            parts += [(t, role) for _, t, role in store.tensors()]
        if self.ragged is not None:
            k, v, counts, offsets = self.ragged.tensors()
            parts += [(k, Role.PAYLOAD), (v, Role.PAYLOAD), (counts, Role.METADATA), (offsets, Role.METADATA)]
        if self.sparse is not None:
            parts += [(t, Role.METADATA) for t in self.sparse.tensors()]
        b, h = self.tail_k.shape[:2]
        elems_per_token = b * h * (self.tail_k.shape[-1] + self.tail_v.shape[-1])
        held = self.held_tokens
        if self.ragged is not None:  # per-kv-head budgets: what a head holds on average, not the largest head
            held = round(float(self.ragged.mean_count())) + self.tail_k.shape[2]
        return layer_memory_from_tensors(
            self.layer_idx, parts, tokens_held=held, tokens_seen=self.cumulative_length,
            elements_per_token=elems_per_token, dtype=self.dtype,
        )

    def _free_slot_bytes(self) -> int:
        """Bytes of the free slots after the tail in the buffers it is a view of (0 without such buffers)."""
        free = 0
        for tail, room in ((self.tail_k, self.room_k), (self.tail_v, self.room_v)):
            if room is not None and tail.data_ptr() == room.data_ptr():
                free += (room.shape[2] - tail.shape[2]) * room[:, :, :1].numel() * room.element_size()
        return free

    def bytes_read_last_step(self) -> int:
        """Bytes the last decode step reads through the fused kernel: the exact windows (sinks, tail) and the
        sparsity metadata (Quest scores every page summary) in full, and the packed body in proportion to
        the body tokens its selection read (whole pages); everything when nothing was selected. (The
        drop-in path decodes the whole body, whatever the selection.)"""
        if not self.is_initialized:
            return 0
        m = self.memory()
        sparse_bytes = storage_bytes(self.sparse.tensors()) if self.sparse is not None else 0
        read = body_tokens_read(self.sparse) if self.sparse is not None else None
        if self.compressed:
            window, n_body = m.window_bytes, self.key_store.n_tokens
            body = m.payload_bytes + m.metadata_bytes - sparse_bytes
        else:  # the free slots of the buffer appended into (kvcompress.layout.grow) are held, not read
            window, body, n_body = 0, m.payload_bytes - self._free_slot_bytes(), self.held_tokens
        share = 1.0 if read is None or n_body == 0 else min(read / n_body, 1.0)
        return int(window + sparse_bytes + body * share)


class CompressedSlidingLayer(DynamicSlidingWindowLayer):
    """A sliding-window layer: transformers' bounded layer (at most W - 1 tokens kept), with accounting."""

    def __init__(self, sliding_window: int, layer_idx: int = 0, **kwargs):
        super().__init__(sliding_window=sliding_window, **kwargs)
        self.layer_idx = layer_idx

    def reset(self) -> None:
        # Dropped, not zeroed: before 5.24 transformers zeroes them in place, and the next update would then
        # append to W - 1 zero tokens.
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        k, v = super().update(key_states, value_states, *args, **kwargs)
        # transformers keeps the window as a view of the whole prompt's states; after a prompt longer than
        # the window that pins every prompt token. Copy the window out so only W - 1 tokens stay held.
        for name in ("keys", "values"):
            t = getattr(self, name)
            if t.numel() and t.untyped_storage().nbytes() > 2 * t.numel() * t.element_size():
                setattr(self, name, t.clone())
        return k, v

    @property
    def held_tokens(self) -> int:
        return 0 if not self.is_initialized or self.keys.numel() == 0 else self.keys.shape[-2]

    def bytes_read_last_step(self) -> int:
        return self.memory().held_bytes

    def memory(self) -> LayerMemory:
        if not self.is_initialized or self.keys.numel() == 0:
            return LayerMemory.empty(self.layer_idx)
        b, h = self.keys.shape[:2]
        return layer_memory_from_tensors(
            self.layer_idx, [(self.keys, "window"), (self.values, "window")],
            tokens_held=self.held_tokens, tokens_seen=self.held_tokens,
            elements_per_token=b * h * (self.keys.shape[-1] + self.values.shape[-1]), dtype=self.keys.dtype,
        )


def resolve_config(model_config, kv_config) -> KVCompressConfig:
    """A KVCompressConfig from a config, a preset name, a path to a saved config, or None ("none")."""
    layout = ModelLayout.from_model_config(model_config)
    if kv_config is None:
        kv_config = "none"
    if isinstance(kv_config, str):
        if kv_config.endswith(".safetensors"):
            kv_config = KVCompressConfig.load(kv_config)
        else:
            return KVCompressConfig.from_preset(kv_config, layout)
    if not isinstance(kv_config, KVCompressConfig):
        raise ConfigError(
            f"kv_config must be a KVCompressConfig, a preset name or a .safetensors path, not {type(kv_config).__name__}"
        )
    kv_config.check_model(layout)
    return kv_config


class CompressedCache(Cache):
    """A transformers Cache of compressed layers, built from the model config and a kvcompress config.

    Args:
        model_config: the model's `PretrainedConfig` (its layer types, kv heads and head dims are read).
        kv_config: a `KVCompressConfig`, a preset name ("none", "fp8", "nuq4", ...), a path to a saved
            config, or None for "none" (token-identical to `DynamicCache`).
    """

    def __init__(self, model_config, kv_config: KVCompressConfig | str | None = None):
        self.kv_config = resolve_config(model_config, kv_config)
        self.layout = self.kv_config.layout
        layers = []
        for i, policy in enumerate(self.kv_config.layers):
            if self.layout.is_sliding(i):
                if not policy.is_lossless:
                    raise ConfigError(
                        f"layer {i} is a sliding-window layer (bounded to {self.layout.sliding_window} tokens); "
                        "kvcompress keeps those exact. Set its policy to 'none'."
                    )
                layers.append(CompressedSlidingLayer(sliding_window=self.layout.sliding_window, layer_idx=i))
            else:
                layers.append(CompressedLayer(policy, layer_idx=i))
                layers[-1].mla_latent = self.layout.attention == "mla"
        super().__init__(layers=layers)
        attach_sparsity(self)

    def tokens_read_last_step(self) -> float:
        """Tokens read per kv head by the last step's attention, averaged over the full-attention layers."""
        return tokens_read(self)

    def bytes_read_last_step(self) -> int:
        """Bytes of K/V storage (and sparsity metadata) the last decode step read, over all layers; see
        `CompressedLayer.bytes_read_last_step`. Compare with `memory_report()["uncompressed_bytes"]`, what a
        dense cache of the same tokens reads every step."""
        return sum(layer.bytes_read_last_step() for layer in self.layers)

    def memory_report(self) -> dict:
        """Bytes actually held, measured from the tensors, against a plain dynamic cache of the same tokens."""
        from kvcompress.memory import report

        return report([layer.memory() for layer in self.layers])

    def __repr__(self):
        return f"CompressedCache(config={self.kv_config.name!r}, layers={len(self.layers)})"
