"""Differences between the transformers 5.x releases kvcompress supports (5.17 to the newest)."""

from __future__ import annotations

import functools

import transformers
from packaging.version import Version


@functools.lru_cache(maxsize=None)
def transformers_version() -> Version:
    return Version(transformers.__version__)


def cache_kwarg() -> str:
    """Name of the cache argument of `forward` / `generate`: 5.24 renamed `past_key_values` to `cache`."""
    return "cache" if transformers_version() >= Version("5.24.0.dev0") else "past_key_values"


def with_cache(cache, **kwargs) -> dict:
    """kwargs for model(...) / model.generate(...) passing `cache` under this release's name."""
    kwargs[cache_kwarg()] = cache
    return kwargs
