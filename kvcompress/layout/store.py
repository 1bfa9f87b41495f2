"""The paged store of one stream (keys or values) of one layer.

Pages of P tokens per kv head, each page encoded at once by the stream's Codec. Fields:
TOKEN tensors [B, H, N, ...] (the codes), PAGE tensors [B, H, N/P, ...] (page scales, outliers,
Quest summaries), ROW tensors [B, H, 1, ...] (frozen statistics). A page's slots are contiguous,
so page p of every (batch row, kv head) covers tokens [p*P, (p+1)*P): the fused kernels address a
page by its index and the drop-in path decodes all pages at once. Memory grows a page at a time
(a new allocation, the old one freed), so slack never exceeds one page, unless room was reserved
(`reserve`): then pages are written in place into buffers of fixed address and `data` holds views of
their filled part (a captured decode step, kvcompress.graph, reads the buffers by pointer). Memory is
measured by storage, so a reservation is charged in full.
"""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from kvcompress.kernels.page_encode import encode_pages
from kvcompress.kernels.page_encode_graph import GraphedEncoder
from kvcompress.quant.base import Codec, FieldKind, Role


class PagedStore:
    def __init__(self, codec: Codec):
        self.codec = codec
        self.kinds = codec.fields()
        self.data: dict[str, torch.Tensor] = {}
        self.row: dict[str, torch.Tensor] = {}
        self.buffers: dict[str, torch.Tensor] = {}  # reserved room (fixed addresses), empty when none
        self.capacity = 0  # tokens the buffers hold
        self.n_tokens = 0
        self.graphed = GraphedEncoder(codec)  # torch encodes replayed from CUDA graphs (GPU only)

    @property
    def page_size(self) -> int:
        return self.codec.page_size

    @property
    def n_pages(self) -> int:
        return self.n_tokens // self.page_size

    def prepare(self, x: torch.Tensor) -> None:
        """Freeze ROW statistics from the tokens available now, x: [B, H, N, D] (once)."""
        if not self.row:
            self.row = self.codec.prepare(x)

    def append(self, x: torch.Tensor) -> None:
        """Encode whole pages x: [B, H, n*P, D] and append them."""
        if x.shape[2] == 0:
            return
        self.prepare(x)
        # the selected backend's encoder: one Triton launch on CUDA for FP8 / KIVI pages (bit-exact with
        # the codec's own encode, which every other case and the CPU use; on CUDA replayed from a graph)
        new, fresh = encode_pages(self.codec, x, self.row, graphed=self.graphed)
        lo, hi = self.n_tokens, self.n_tokens + x.shape[2]
        if self.buffers and hi <= self.capacity:  # in place, at fixed addresses
            for name, t in new.items():
                a, b = self._index(name, lo, lo // self.page_size), self._index(name, hi, hi // self.page_size)
                self.buffers[name][:, :, a:b].copy_(t)
                self.data[name] = self.buffers[name][:, :, :b]
        else:
            self._drop_reservation()
            for name, t in new.items():
                old = self.data.get(name)
                # a graph's outputs are overwritten by its next replay: never hold them
                self.data[name] = (t if fresh else t.clone()) if old is None else torch.cat([old, t], dim=2)
        self.n_tokens = hi

    def reserve(self, n_pages: int) -> None:
        """Room for n_pages pages in buffers of fixed address (existing pages copied in; at least one page
        must be stored, so the fields' shapes are known). Appends then write in place until they are full."""
        if self.n_tokens == 0:
            raise ValueError("reserve() needs at least one stored page (the fields' shapes come from it)")
        n_pages = max(n_pages, self.n_pages)
        if self.buffers and n_pages * self.page_size <= self.capacity:
            return
        p = self.page_size
        buffers = {}
        for name, t in self.data.items():
            room = self._index(name, n_pages * p, n_pages)
            buf = t.new_zeros((*t.shape[:2], room, *t.shape[3:]))
            buf[:, :, : t.shape[2]].copy_(t)
            buffers[name] = buf
            self.data[name] = buf[:, :, : t.shape[2]]
        self.buffers, self.capacity = buffers, n_pages * p

    def keep_pages(self, pages: torch.Tensor) -> None:
        """Keep only pages [B, H, n] of each (batch row, kv head), sorted (an H2O eviction); TOKEN and PAGE fields
        are gathered as they are, never re-encoded. With reserved room the kept pages move to the front of the
        buffers, which stay where they are (a decode graph reads them by address)."""
        from kvcompress.sparse.base import gather_tokens  # here: the sparse package imports the layout

        p, n = self.page_size, pages.shape[-1]
        for name, t in self.data.items():
            kind = self.kinds[name][0]
            if kind not in (FieldKind.TOKEN, FieldKind.PAGE):
                continue
            paged = t.reshape(t.shape[:2] + (t.shape[2] // p, p) + t.shape[3:]) if kind == FieldKind.TOKEN else t
            kept = gather_tokens(paged, pages)
            kept = kept.reshape(kept.shape[:2] + (-1,) + t.shape[3:])
            if self.buffers:
                self.buffers[name][:, :, : kept.shape[2]].copy_(kept)
                kept = self.buffers[name][:, :, : kept.shape[2]]
            self.data[name] = kept
        self.n_tokens = n * p
        if self.n_tokens == 0 and not self.buffers:
            self.data = {}

    def _drop_reservation(self) -> None:
        self.buffers, self.capacity = {}, 0

    def decode(self, dtype: torch.dtype) -> torch.Tensor | None:
        """All stored tokens, [B, H, N, D] in `dtype` (None when empty)."""
        if self.n_tokens == 0:
            return None
        return self.codec.decode(self.data, self.row, dtype)

    def decode_pages(self, first: int, end: int, dtype: torch.dtype) -> torch.Tensor:
        """Pages [first, end) decoded, [B, H, (end - first) * P, D] in `dtype` (nothing else is decoded)."""
        assert 0 <= first < end <= self.n_pages
        p = self.page_size
        part = {name: t[:, :, self._index(name, first * p, first):self._index(name, end * p, end)]
                for name, t in self.data.items()}
        return self.codec.decode(part, self.row, dtype)

    def pop_pages(self, n_pages: int, dtype: torch.dtype) -> torch.Tensor:
        """Remove the newest n_pages pages and return their tokens decoded, [B, H, n*P, D]."""
        assert 0 < n_pages <= self.n_pages
        keep_tok, keep_page = self.n_tokens - n_pages * self.page_size, self.n_pages - n_pages
        out = self.decode_pages(keep_page, self.n_pages, dtype)
        self.data = {
            name: t[:, :, : self._index(name, keep_tok, keep_page)].clone() for name, t in self.data.items()
        }
        self.n_tokens = keep_tok
        self._drop_reservation()
        if self.n_tokens == 0:
            self.data = {}
        return out

    def _index(self, name: str, tokens: int, pages: int) -> int:
        return tokens if self.kinds[name][0] == FieldKind.TOKEN else pages

    def map_batch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Apply a batch-dim operation (index_select, repeat_interleave, ...) to every tensor."""
        self.data = {k: fn(v) for k, v in self.data.items()}
        self.row = {k: fn(v) for k, v in self.row.items()}
        self._drop_reservation()

    def to(self, device) -> None:
        self.map_batch(lambda t: t.to(device, non_blocking=True))

    def tensors(self) -> Iterator[tuple[str, torch.Tensor, Role]]:
        """Every tensor held, with its role for the memory report (shared codebooks included)."""
        for name, t in self.data.items():
            yield name, t, self.kinds[name][1]
        for name, t in self.row.items():
            yield name, t, Role.METADATA
        for name, t in self.codec.shared_tensors().items():
            yield "shared." + name, t, Role.METADATA
