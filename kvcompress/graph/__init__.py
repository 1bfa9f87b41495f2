"""Captured decode: a CompressedCache's decode steps replayed from one CUDA graph (see decode_graph)."""

from kvcompress.graph.decode_graph import DecodeGraph

__all__ = ["DecodeGraph"]
