"""What a decode-attention kernel reads of one layer: the packed body of each stream plus the exact parts.

A `CompressedLayer` holds, per stream (keys, values), in token order:
``sinks`` [B, H, S, D] (model dtype) | ``body`` (a PagedStore: packed fields of N = n_pages * P tokens)
| ``tail`` [B, H, T, D] (model dtype). `AttentionParts` is that, detached from the cache object, so the
kernels know nothing of transformers. `body_lengths` [B] (optional) marks how many body tokens of each
batch row are valid (a batch of different lengths); tokens past it are never attended.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvcompress.quant.base import Codec, FieldKind
from kvcompress.quant.identity import IdentityCodec


@dataclass
class PackedStream:
    """One stream's packed body: the codec, its TOKEN/PAGE fields and its ROW statistics."""

    codec: Codec
    data: dict[str, torch.Tensor]
    row: dict[str, torch.Tensor]
    n_tokens: int

    def __post_init__(self):
        if self.n_tokens % self.codec.page_size:
            raise ValueError(f"a packed body holds whole pages of {self.codec.page_size}, got {self.n_tokens} tokens")

    @property
    def page_size(self) -> int:
        return self.codec.page_size

    @property
    def n_pages(self) -> int:
        return self.n_tokens // self.codec.page_size

    def decode(self, dtype: torch.dtype) -> torch.Tensor:
        """All body tokens, [B, H, N, D] in `dtype`."""
        return self.codec.decode(self.data, self.row, dtype)

    def decode_pages(self, page_list: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """The tokens of the listed pages only, page_list [B, H, n_sel] (entries < 0 read page 0):
        -> [B, H, n_sel * P, D] in `dtype`. Fields are gathered page by page, then decoded once."""
        p = self.page_size
        pages = page_list.long().clamp_min(0)  # [B, H, n_sel]
        tokens = (pages[..., None] * p + torch.arange(p, device=pages.device)).flatten(2)  # [B, H, n_sel*P]
        kinds = self.codec.fields()
        picked = {}
        for name, t in self.data.items():
            idx = tokens if kinds[name][0] == FieldKind.TOKEN else pages
            idx = idx.reshape(*idx.shape, *([1] * (t.dim() - 3))).expand(*idx.shape, *t.shape[3:])
            picked[name] = torch.gather(t, 2, idx)
        return self.codec.decode(picked, self.row, dtype)


@dataclass
class AttentionParts:
    """The K/V of one layer as the fused decode kernels read it.

    key, value: the packed bodies (None when the body is empty);
    sink_k, sink_v: [B, H, S, D]; tail_k, tail_v: [B, H, T, D] (model dtype);
    body_lengths: [B] int, valid body tokens per batch row (None: all N);
    row_starts: [B] int, the first held position (sinks | body | tail order) each row attends to: the
    positions before it are left padding (None: no padding);
    tail_lengths: [1] int64 on the device, how many tail tokens are valid (None: all T). A captured decode
    step (kvcompress.decode_graph) reads a tail buffer of fixed size whose length only the device knows.
    body_offsets: [B, H] int, a body packed by (row, kv head) with counts of their own (H2O's per-head budgets,
    kvcompress.sparse.ragged): where each head's tokens start in it; body_lengths is then [B, H], the counts,
    and the body's data has row and head strides 0 (`ragged_parts`). n_body is the largest count.
    """

    key: PackedStream | None
    value: PackedStream | None
    sink_k: torch.Tensor
    sink_v: torch.Tensor
    tail_k: torch.Tensor
    tail_v: torch.Tensor
    body_lengths: torch.Tensor | None = None
    row_starts: torch.Tensor | None = None
    tail_lengths: torch.Tensor | None = None
    body_offsets: torch.Tensor | None = None

    def __post_init__(self):
        if (self.key is None) != (self.value is None):
            raise ValueError("keys and values must both have a packed body or both have none")
        if self.key is not None and self.key.n_tokens != self.value.n_tokens:
            raise ValueError(f"key body holds {self.key.n_tokens} tokens, value body {self.value.n_tokens}")
        if self.key is not None and self.key.page_size != self.value.page_size:
            raise ValueError("keys and values must share one page size")

    @property
    def n_body(self) -> int:
        return 0 if self.key is None else self.key.n_tokens

    @property
    def n_sinks(self) -> int:
        return self.sink_k.shape[2]

    @property
    def n_tail(self) -> int:
        return self.tail_k.shape[2]

    @property
    def n_positions(self) -> int:
        """Token positions of the layer in order sinks | body | tail (the H2O probability vector's length)."""
        return self.n_sinks + self.n_body + self.n_tail

    @property
    def batch(self) -> int:
        return self.tail_k.shape[0]

    @property
    def kv_heads(self) -> int:
        return self.tail_k.shape[1]


def layer_parts(layer, body_lengths: torch.Tensor | None = None,
                row_starts: torch.Tensor | None = None) -> AttentionParts:
    """The AttentionParts of an initialised `kvcompress.cache.CompressedLayer` (no copies)."""
    if not getattr(layer, "is_initialized", False):
        raise ValueError("the layer holds no tokens yet: call update() / append() first")
    if getattr(layer, "static", None) is not None:  # a decode graph's layer: fixed buffers, lengths on the device
        return layer.static.parts(row_starts)
    if not layer.compressed:
        if getattr(layer, "ragged", None) is not None:
            return ragged_parts(layer.ragged, layer.tail_k, layer.tail_v, row_starts)
        return dense_parts(layer.tail_k, layer.tail_v, row_starts)
    ks, vs = layer.key_store, layer.value_store
    key = value = None
    if ks.n_tokens:
        key = PackedStream(ks.codec, ks.data, ks.row, ks.n_tokens)
        value = PackedStream(vs.codec, vs.data, vs.row, vs.n_tokens)
    return AttentionParts(key, value, layer.sink_k, layer.sink_v, layer.tail_k, layer.tail_v, body_lengths,
                          row_starts)


DENSE_PAGE = 16  # tokens per page of a full-precision layer's body view


def dense_parts(k: torch.Tensor, v: torch.Tensor, row_starts: torch.Tensor | None = None) -> AttentionParts:
    """Full-precision held tokens k [B, H, n, Dk], v [B, H, n, Dv] as the kernels read them: the whole pages of
    DENSE_PAGE tokens as a body of the identity codec (views of k and v, nothing copied), which the kernel's
    splits share out, the rest (under a page) as the tail, which the last split reads."""
    n = k.shape[2] // DENSE_PAGE * DENSE_PAGE
    key = value = None
    if n:
        key, value = (_identity_body(x[:, :, :n], DENSE_PAGE, n) for x in (k, v))
    return AttentionParts(key, value, k[:, :, :0], v[:, :, :0], k[:, :, n:], v[:, :, n:], None, row_starts)


def ragged_parts(ragged, tail_k: torch.Tensor, tail_v: torch.Tensor, row_starts: torch.Tensor | None = None
                 ) -> AttentionParts:
    """An H2O layer with per-kv-head budgets (kvcompress.sparse.ragged.RaggedHeads: keys [M, Dk], values
    [M, Dv], counts [B, H], packed by row then head) and its tail [B, H, n, D]: the packed tokens as a body
    read in place (expanded to [B, H, M, D] with strides 0, each head from its own offset), the tail as the
    tail. Positions run over the padded view (each head's width slots, then the tail), as the layer's
    SparseState keeps them."""
    b, h, width = ragged.shape
    key = value = None
    if width:
        key, value = (_identity_body(x[None, None].expand(b, h, *x.shape), 1, width)
                      for x in (ragged.keys, ragged.values))
    return AttentionParts(key, value, tail_k[:, :, :0], tail_v[:, :, :0], tail_k, tail_v, ragged.counts,
                          row_starts, body_offsets=ragged.offsets)


def _identity_body(x: torch.Tensor, page: int, n_tokens: int) -> PackedStream:
    """x [B, H, N, D] in the model dtype as a packed body of `n_tokens` tokens in pages of `page`."""
    codec = IdentityCodec(page_size=page, head_dim=x.shape[-1], num_heads=x.shape[1], dtype=x.dtype)
    return PackedStream(codec, {"data": x}, {}, n_tokens)
