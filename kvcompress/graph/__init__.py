"""Captured decode: a CompressedCache's decode steps replayed from one CUDA graph (decode_graph), and a
decoding method for `model.generate(custom_generate=graph_generate)` built on it (generate)."""

from kvcompress.graph.decode_graph import DecodeGraph
from kvcompress.graph.generate import graph_generate

__all__ = ["DecodeGraph", "graph_generate"]
