"""The codec's torch page encode replayed from a CUDA graph (the append path for codecs without a Triton
encoder: NUQ with its per-page outlier top-k, FP8 with static scales or shifts).

Why: a NUQ page encode is some 76 small kernels (rotation, outlier top-k, page ranges, nearest level,
packing). On the GPU they take about 0.2 ms, but launching them takes the host 1.5 ms per page and
stream. Every layer fills its page at the same decode step, so a captured decode loop
(kvcompress.graph) starves the GPU while the host launches them. Replaying the same kernels from one
graph per page shape keeps the device work and drops the launches.

`GraphedEncoder(codec)(x, row)` returns what `codec.encode(x, row)` returns, bit for bit. Only one-page
encodes (x holds P tokens: what a decode step's flush encodes, K and V each) are graphed; a prefill's many
pages run eagerly, as does a codec's first encode (its one-time checks read results back to the host).
The first one-page encode captures a graph; later ones replay it. The returned tensors are the graph's own
outputs: they stay valid until the next call for the same shape, so the caller copies them (PagedStore
does, into its pages). Graphs share one memory pool per device: replays run one after another on one
stream and every graph keeps its outputs referenced, so no graph's scratch overlaps another's outputs.
Captured with `CUDAGraph.capture_begin` on a side stream rather than `torch.cuda.graph`, which runs a
garbage collection and empties the allocator's cache at every capture: a model has two stores per layer.

Used only on CUDA, outside another capture; `KVCOMPRESS_ENCODE_GRAPHS=0` turns it off. Shapes:
x [B, H, n * P, D] in the model dtype -> the codec's fields.
"""

from __future__ import annotations

import os

import torch

from kvcompress.quant.base import Codec

MAX_SHAPES = 4  # one-page shapes graphed per encoder (one per batch size a decode loop runs at)
_POOLS: dict[int, tuple] = {}  # per device: (the graphs' shared memory pool, the graph that keeps it alive)
_SIDE: dict[int, torch.cuda.Stream] = {}  # the capture stream per device


def graphs_enabled(x: torch.Tensor) -> bool:
    """Whether a page encode of x may go through a graph: CUDA, not inside a capture, not switched off."""
    if not x.is_cuda or os.environ.get("KVCOMPRESS_ENCODE_GRAPHS", "1") == "0":
        return False
    return not torch.cuda.is_current_stream_capturing()


class _Entry:
    def __init__(self):
        self.graph: torch.cuda.CUDAGraph | None = None
        self.x: torch.Tensor | None = None
        self.out: dict[str, torch.Tensor] | None = None


class GraphedEncoder:
    def __init__(self, codec: Codec):
        self.codec = codec
        self.entries: dict[tuple, _Entry] = {}
        self.encoded = False  # the codec's first encode (with its one-time checks) has run

    def _key(self, x: torch.Tensor, row: dict[str, torch.Tensor]) -> tuple:
        # the graph reads the codec's tensors and the row statistics by address: a moved or replaced one
        # (CompressedLayer.to, a new calibration) must not replay a stale graph
        held = list(self.codec.shared_tensors().values()) + list(row.values())
        return (tuple(x.shape), x.dtype, x.device.index, tuple(t.data_ptr() for t in held))

    def __call__(self, x: torch.Tensor, row: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.encoded or x.shape[2] != self.codec.page_size:
            self.encoded = True
            return self.codec.encode(x, row)
        key = self._key(x, row)
        entry = self.entries.get(key)
        if entry is None:
            if len(self.entries) >= MAX_SHAPES:
                self.entries.pop(next(iter(self.entries)))
            entry = self.entries[key] = self._capture(x, row)
        entry.x.copy_(x)
        entry.graph.replay()
        return entry.out

    def _capture(self, x: torch.Tensor, row: dict[str, torch.Tensor]) -> _Entry:
        entry = _Entry()
        entry.x = x.clone()
        here = torch.cuda.current_stream(x.device)
        side = _SIDE.get(x.device.index) or _SIDE.setdefault(x.device.index, torch.cuda.Stream(x.device))
        side.wait_stream(here)
        pool, _ = _POOLS.get(x.device.index) or (torch.cuda.graph_pool_handle(), None)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.stream(side):
            self.codec.encode(entry.x, row)  # warm-up on the capture's stream, as torch advises
            try:
                graph.capture_begin(pool=pool)
                try:
                    entry.out = self.codec.encode(entry.x, row)
                finally:
                    graph.capture_end()
            except RuntimeError as e:
                raise RuntimeError(
                    f"capturing the page encode of {type(self.codec).__name__} in a CUDA graph failed ({e}); "
                    "set KVCOMPRESS_ENCODE_GRAPHS=0 to encode pages eagerly"
                ) from e
        here.wait_stream(side)
        # the pool's first graph is held here for good: once every graph of a pool is gone, torch frees the
        # pool and a capture into its handle fails (an internal assert of the caching allocator)
        _POOLS.setdefault(x.device.index, (pool, graph))
        entry.graph = graph
        return entry
