"""kvcompress: shrink the KV cache of transformer LLMs (layout, quantization, sparsity, kernels, calibration).

`import kvcompress` needs neither CUDA nor Triton.
"""

from kvcompress.cache import CompressedCache
from kvcompress.config import ConfigError, KVCompressConfig, LayerPolicy, QuantSpec, SparsitySpec
from kvcompress.graph import DecodeGraph, graph_generate
from kvcompress.integration import disable, enable, enabled
from kvcompress.layout.arch import ModelLayout
from kvcompress.models import load_model
from kvcompress.presets import preset_names

__version__ = "0.1.0"

__all__ = [
    "CompressedCache",
    "ConfigError",
    "DecodeGraph",
    "KVCompressConfig",
    "LayerPolicy",
    "ModelLayout",
    "QuantSpec",
    "SparsitySpec",
    "disable",
    "enable",
    "enabled",
    "graph_generate",
    "load_model",
    "preset_names",
    "__version__",
]
