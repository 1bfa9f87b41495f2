"""What one token's cache entry is for a given architecture, read from the HF model config.

Used by the cache, `estimate`, calibration and the config fingerprint instead of scattered
model-type checks. Three kinds of layer exist:

- ``full``: GQA/MHA attention, one entry of ``kv_heads x key_dim`` and ``kv_heads x value_dim``
  per token, stored per kv head (never after ``repeat_kv``).
- ``sliding``: the same entry, but the layer keeps at most ``sliding_window`` tokens.
- MLA (``attention == "mla"``): transformers >= 5.17 caches the latent, ``kv_nope``
  [B, 1, T, kv_lora_rank] in the key slot and the rotated ``k_rot`` [B, 1, T, qk_rope_head_dim]
  in the value slot, so one "kv head" of widths 512 and 64 at DeepSeek-V3 sizes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum


class LayerKind(str, Enum):
    FULL = "full_attention"
    SLIDING = "sliding_attention"


_SLIDING_TYPES = {"sliding_attention", "chunked_attention", "hybrid_sliding", "reference_sliding_attention"}
_MLA_MODEL_TYPES = {"deepseek_v2", "deepseek_v3", "kimi_k2", "longcat_flash"}


@dataclass(frozen=True)
class ModelLayout:
    """The cache-relevant shape of a model: the fingerprint a kvcompress config is made for."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    key_head_dim: int
    value_head_dim: int
    layer_types: tuple[str, ...]
    attention: str = "gqa"  # "gqa" or "mla"
    sliding_window: int | None = None
    num_query_heads: int = 0
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    # -- construction ---------------------------------------------------------------------
    @classmethod
    def from_model_config(cls, config) -> "ModelLayout":
        """Read the layout from a transformers ``PretrainedConfig`` (or anything with its attributes)."""
        if hasattr(config, "get_text_config"):
            config = config.get_text_config(decoder=True)
        model_type = getattr(config, "model_type", "unknown")
        n_layers = int(config.num_hidden_layers)
        n_q = int(getattr(config, "num_attention_heads", 0) or 0)
        n_kv = getattr(config, "num_key_value_heads", None) or n_q
        sliding_window = getattr(config, "sliding_window", None)
        layer_types = getattr(config, "layer_types", None)
        if layer_types is None:
            layer_types = ["sliding_attention" if sliding_window else "full_attention"] * n_layers
        kinds = tuple(
            LayerKind.SLIDING.value if t in _SLIDING_TYPES else LayerKind.FULL.value for t in layer_types
        )
        if model_type in _MLA_MODEL_TYPES and getattr(config, "kv_lora_rank", None):
            return cls(
                model_type=model_type,
                num_layers=n_layers,
                num_kv_heads=1,
                key_head_dim=int(config.kv_lora_rank),
                value_head_dim=int(config.qk_rope_head_dim),
                layer_types=kinds,
                attention="mla",
                sliding_window=None,
                num_query_heads=n_q,
                extra={
                    "qk_nope_head_dim": int(config.qk_nope_head_dim),
                    "v_head_dim": int(config.v_head_dim),
                },
            )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_q
        return cls(
            model_type=model_type,
            num_layers=n_layers,
            num_kv_heads=int(n_kv),
            key_head_dim=int(head_dim),
            value_head_dim=int(getattr(config, "v_head_dim", None) or head_dim),
            layer_types=kinds,
            attention="gqa",
            sliding_window=int(sliding_window) if sliding_window and LayerKind.SLIDING.value in kinds else None,
            num_query_heads=n_q,
        )

    # -- queries ----------------------------------------------------------------------------
    def is_sliding(self, layer_idx: int) -> bool:
        return self.layer_types[layer_idx] == LayerKind.SLIDING.value

    def values_per_token(self, layer_idx: int) -> int:
        """Cached values per token in one layer (keys + values over all kv heads)."""
        return self.num_kv_heads * (self.key_head_dim + self.value_head_dim)

    def decompressed_values_per_token(self) -> int:
        """What a per-head K/V cache would hold per token and layer (for MLA: the expanded heads)."""
        if self.attention == "mla":
            qk = self.extra["qk_nope_head_dim"] + self.value_head_dim
            return self.num_query_heads * (qk + self.extra["v_head_dim"])
        return self.values_per_token(0)

    def fingerprint(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        d["layer_types"] = list(self.layer_types)
        return d

    @classmethod
    def from_fingerprint(cls, d: dict) -> "ModelLayout":
        d = dict(d)
        d["layer_types"] = tuple(d["layer_types"])
        return cls(**d)

    def mismatch(self, other: "ModelLayout") -> list[str]:
        """Names of the fingerprint fields that differ, with both values."""
        a, b = self.fingerprint(), other.fingerprint()
        out = []
        for key in a:
            if a[key] != b.get(key):
                va, vb = a[key], b.get(key)
                if key == "layer_types":
                    va, vb = f"{len(va)} layers {sorted(set(va))}", f"{len(vb)} layers {sorted(set(vb))}"
                out.append(f"{key}: config has {vb!r}, model has {va!r}")
        return out
