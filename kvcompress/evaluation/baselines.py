"""transformers' own quantized KV cache (`QuantizedCache`, KIVI-style with quanto or HQQ) as baselines.

Measured by the same protocol as kvcompress caches. Its layers keep a full-precision residual of up to
128 tokens and re-quantize the whole history whenever the residual fills.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Callable

import torch

# backend -> (importable module, pip command)
BACKENDS = {
    "quanto": ("optimum.quanto", "pip install optimum-quanto"),
    "hqq": ("hqq", "pip install hqq"),
}
BITS = (4, 2)


class BaselineUnavailable(RuntimeError):
    """A baseline's backend package is missing or fails to import; the message names the pip command."""


@dataclass(frozen=True)
class BaselineSpec:
    backend: str  # "quanto" | "hqq"
    nbits: int

    def __post_init__(self):
        if self.backend not in BACKENDS:
            raise ValueError(f"unknown baseline backend {self.backend!r}; available: {', '.join(BACKENDS)}")
        if self.nbits not in BITS:
            raise ValueError(f"baseline nbits must be one of {BITS}, got {self.nbits}")

    @property
    def name(self) -> str:
        return f"hf-{self.backend}-int{self.nbits}"


def parse_baselines(text: str | None) -> list[BaselineSpec]:
    """"quanto,hqq" -> int4 and int2 of each; "quanto-int4" -> that one only."""
    specs = []
    for item in (text or "").split(","):
        item = item.strip().lower()
        if not item:
            continue
        backend, _, bits = item.partition("-int")
        for nbits in (int(bits),) if bits else BITS:
            specs.append(BaselineSpec(backend, nbits))
    return specs


def check_backend(backend: str) -> None:
    """Raise BaselineUnavailable (naming the pip command) unless the backend imports."""
    module, pip = BACKENDS[backend]
    try:
        found = importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        found = False
    if not found:
        raise BaselineUnavailable(f"baseline backend {backend!r} needs {module}; install it with: {pip}")
    try:
        importlib.import_module(module)
    except Exception as e:  # a broken install is reported, not hidden
        raise BaselineUnavailable(f"baseline backend {backend!r}: importing {module} failed ({e}); try: {pip}") from e


def baseline_factory(spec: BaselineSpec, model_config) -> Callable[[], object]:
    """A zero-argument callable returning a fresh `QuantizedCache` for `spec`; checks the backend first."""
    from transformers.cache_utils import QuantizedCache

    check_backend(spec.backend)

    def make():
        return QuantizedCache(backend=spec.backend, config=model_config, nbits=spec.nbits)

    try:
        make()
    except (ImportError, ValueError) as e:
        raise BaselineUnavailable(f"{spec.name}: transformers cannot build it ({e})") from e
    return make


def tensors_in(obj, depth: int = 0):
    """Every plain tensor reachable from obj (attributes, dicts, lists, tensor subclasses' inner tensors)."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        flatten = getattr(type(obj), "__tensor_flatten__", None)
        if flatten is not None and type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            names, _ = obj.__tensor_flatten__()
            for n in names:
                yield from tensors_in(getattr(obj, n), depth + 1)
        else:
            yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        for v in vars(obj).values():
            yield from tensors_in(v, depth + 1)


def tensor_memory(cache, model_config, batch_size: int = 1) -> dict | None:
    """Memory report of a transformers cache from the tensors its layers hold (None if none reachable).

    Same keys as `CompressedCache.memory_report()` where they can be known: held bytes (distinct
    storages), bytes of the tokens seen in the model dtype uncompressed, ratio and bits per element.
    """
    from kvcompress.layout.arch import ModelLayout
    from kvcompress.memory import storage_bytes

    layout = ModelLayout.from_model_config(model_config)
    held = uncompressed = elements = tokens_seen = 0
    for i, layer in enumerate(cache.layers):
        if not getattr(layer, "is_initialized", False):
            continue
        tensors = list(tensors_in(vars(layer)))
        if not tensors:
            return None
        held += storage_bytes(tensors)
        seen = int(layer.get_seq_length())
        layer_elements = seen * batch_size * layout.values_per_token(i)
        elements += layer_elements
        dtype = getattr(layer, "dtype", None) or getattr(layer.keys, "dtype", torch.float32)
        uncompressed += layer_elements * torch.empty((), dtype=dtype).element_size()
        tokens_seen = max(tokens_seen, seen)
    if held == 0 or elements == 0:
        return None
    return {
        "held_bytes": held,
        "uncompressed_bytes": uncompressed,
        "compression_ratio": uncompressed / held,
        "bits_per_element": 8.0 * held / elements,
        "tokens_held": tokens_seen,
        "tokens_seen": tokens_seen,
    }
