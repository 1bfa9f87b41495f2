"""Decode-attention kernels: each Triton kernel beside a pure-torch twin of the same signature.

    out, probs = decode_attention(q, parts, scaling, page_list=None, return_probs=False)
    out, probs = layer_decode_attention(compressed_layer, q, scaling)
    pages = quest_select_pages(q, page_min, page_max, k)

`select_backend()` picks "torch" or "triton" (env KVCOMPRESS_KERNELS; default Triton on CUDA).
Nothing here imports Triton at module import time; the *_triton modules are loaded on first use.
"""

from kvcompress.kernels.backend import select_backend
from kvcompress.kernels.decode_attention import (
    decode_attention,
    decode_attention_torch,
    layer_decode_attention,
)
from kvcompress.kernels.parts import AttentionParts, PackedStream, layer_parts
from kvcompress.kernels.quest import quest_page_logits_torch, quest_page_scores, quest_select_pages

__all__ = [
    "AttentionParts",
    "PackedStream",
    "decode_attention",
    "decode_attention_torch",
    "layer_decode_attention",
    "layer_parts",
    "quest_page_logits_torch",
    "quest_page_scores",
    "quest_select_pages",
    "select_backend",
]
