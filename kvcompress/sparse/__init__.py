"""Sparsity policies: which tokens a layer keeps (H2O, StreamingLLM, SnapKV) or reads (Quest).

`make_policy(spec, layer_idx)` turns a layer's SparsitySpec into its policy (None: the layer stays
dense). The policies run inside the `kvcompress` attention: `kvcompress.enable(model)`.
"""

from __future__ import annotations

from kvcompress.config import SparsitySpec
from kvcompress.sparse.base import SparsePolicy
from kvcompress.sparse.h2o import H2OPolicy
from kvcompress.sparse.quest import QuestPolicy
from kvcompress.sparse.snapkv import SnapKVPolicy
from kvcompress.sparse.streaming import StreamingPolicy

POLICIES: dict[str, type[SparsePolicy]] = {
    "h2o": H2OPolicy,
    "streaming": StreamingPolicy,
    "snapkv": SnapKVPolicy,
    "quest": QuestPolicy,
}


def make_policy(spec: SparsitySpec, layer_idx: int) -> SparsePolicy | None:
    """The policy of layer `layer_idx`, or None where it stays dense (method "none", or a dense layer)."""
    if spec.method == "none" or layer_idx < spec.dense_layers:
        return None
    return POLICIES[spec.method].from_spec(spec)


__all__ = ["H2OPolicy", "QuestPolicy", "SnapKVPolicy", "SparsePolicy", "StreamingPolicy", "make_policy"]
