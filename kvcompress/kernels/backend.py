"""Which implementation of the kernels runs: `KVCOMPRESS_KERNELS=torch|triton`, else Triton on CUDA.

The default is "triton" when the tensors live on a CUDA device and Triton imports, "torch" elsewhere.
Forcing "triton" for CPU tensors needs Triton's interpreter (`TRITON_INTERPRET=1`, used by the tests).
"""

from __future__ import annotations

import functools
import os

import torch

BACKENDS = ("torch", "triton")
ENV_VAR = "KVCOMPRESS_KERNELS"


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when `import triton` works (it is never imported by `import kvcompress`)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def select_backend(device: torch.device | str | None = None) -> str:
    """"torch" or "triton" for tensors on `device` (None: the default CUDA device if there is one)."""
    asked = os.environ.get(ENV_VAR, "").strip().lower()
    if asked and asked not in BACKENDS:
        raise ValueError(f"{ENV_VAR}={asked!r} is not a kernel backend; use one of {BACKENDS}")
    on_cuda = torch.device(device).type == "cuda" if device is not None else torch.cuda.is_available()
    if asked == "torch":
        return "torch"
    if asked == "triton":
        if not triton_available():
            raise RuntimeError(f"{ENV_VAR}=triton but Triton is not installed: `pip install triton`")
        if not on_cuda and not interpreting():
            raise RuntimeError(
                f"{ENV_VAR}=triton for CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 "
                f"(slow, for tests), or {ENV_VAR}=torch"
            )
        return "triton"
    return "triton" if on_cuda and triton_available() else "torch"
