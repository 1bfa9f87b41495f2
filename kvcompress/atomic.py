"""Atomic file writes: everything kvcompress writes goes to a temporary file beside the target and is
renamed into place, so an interrupted run never leaves a half-written file."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from typing import Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = ".tmp") -> Iterator[str]:
    """Yield a temporary path beside `path`; on success rename it onto `path`, on any error delete it."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".kvcompress-", suffix=suffix, dir=folder)
    os.close(fd)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_json(path: str | os.PathLike, doc) -> None:
    """Write `doc` as indented JSON, atomically."""
    with atomic_path(path, ".json") as tmp:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=2)
            f.write("\n")


def write_safetensors(path: str | os.PathLike, tensors: dict, metadata: dict | None = None) -> None:
    """Write a safetensors file (contiguous CPU copies of `tensors`, so entries that share memory, e.g. one
    tensor under two names, are written separately), atomically."""
    from safetensors.torch import save_file

    with atomic_path(path, ".safetensors") as tmp:
        save_file({k: v.detach().to("cpu", copy=True).contiguous() for k, v in tensors.items()}, tmp, metadata=metadata)
