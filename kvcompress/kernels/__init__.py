"""Decode-attention kernels: each Triton kernel beside a pure-torch twin of the same signature.

Nothing here imports Triton at module import time; kernels are built on first use.
"""
