"""The in-place version of a tensor, for caches keyed on a tensor that must follow its in-place changes."""

from __future__ import annotations

import torch


def tensor_version(t: torch.Tensor) -> int:
    """t._version, or -1 for an inference tensor (made under `torch.inference_mode()`), which keeps no
    version counter and cannot be changed outside that mode."""
    try:
        return t._version
    except RuntimeError:
        return -1
