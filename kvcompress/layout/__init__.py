"""Architecture-aware storage: model layouts (GQA, MLA, sliding window) and the paged store."""

from kvcompress.layout.arch import LayerKind, ModelLayout

__all__ = ["LayerKind", "ModelLayout"]
