"""Memory accounting from the tensors a cache actually holds.

Bytes are measured from each tensor's storage (deduplicated), so a view that pins a larger
buffer is charged the whole buffer, as the allocator sees it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from kvcompress.quant.base import Role


@dataclass
class LayerMemory:
    layer: int
    payload_bytes: int = 0
    metadata_bytes: int = 0
    window_bytes: int = 0
    tokens_held: int = 0
    tokens_seen: int = 0
    uncompressed_bytes: int = 0
    elements: int = 0  # cached values represented (tokens seen x batch x heads x (Dk + Dv))

    @classmethod
    def empty(cls, layer: int) -> "LayerMemory":
        return cls(layer=layer)

    @property
    def held_bytes(self) -> int:
        return self.payload_bytes + self.metadata_bytes + self.window_bytes


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        s = t.untyped_storage()  # even an empty view pins its whole buffer
        if s.nbytes() == 0:
            continue
        key = (s.data_ptr(), t.device)
        if key not in seen:
            seen.add(key)
            total += s.nbytes()
    return total


def layer_memory_from_tensors(layer, parts, *, tokens_held, tokens_seen, elements_per_token, dtype) -> LayerMemory:
    """parts: (tensor, role) pairs, role in Role.PAYLOAD / Role.METADATA / "window"."""
    by_role = {Role.PAYLOAD: [], Role.METADATA: [], "window": []}
    for t, role in parts:
        by_role[role].append(t)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return LayerMemory(
        layer=layer,
        payload_bytes=storage_bytes(by_role[Role.PAYLOAD]),
        metadata_bytes=storage_bytes(by_role[Role.METADATA]),
        window_bytes=storage_bytes(by_role["window"]),
        tokens_held=tokens_held,
        tokens_seen=tokens_seen,
        uncompressed_bytes=tokens_seen * elements_per_token * itemsize,
        elements=tokens_seen * elements_per_token,
    )


def report(layers: list[LayerMemory]) -> dict:
    held = sum(m.held_bytes for m in layers)
    unc = sum(m.uncompressed_bytes for m in layers)
    elements = sum(m.elements for m in layers)
    return {
        "held_bytes": held,
        "uncompressed_bytes": unc,
        "compression_ratio": (unc / held) if held else 1.0,
        "bits_per_element": (8.0 * held / elements) if elements else 0.0,
        "payload_bytes": sum(m.payload_bytes for m in layers),
        "metadata_bytes": sum(m.metadata_bytes for m in layers),
        "window_bytes": sum(m.window_bytes for m in layers),
        "tokens_held": max((m.tokens_held for m in layers), default=0),
        "tokens_seen": max((m.tokens_seen for m in layers), default=0),
        "layers": [dict(asdict(m), held_bytes=m.held_bytes) for m in layers],
    }
