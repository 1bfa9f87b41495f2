"""Full-precision tokens appended in place: a buffer with a few free slots, not a copy of everything per step.

transformers' DynamicLayer concatenates on every step, which copies every token held (read and written
once each). A full-precision layer that evicts (H2O, StreamingLLM) or stops at its prefill selection
(SnapKV) is read through the fused kernel (kvcompress.kernels.attention_backend), so that copy would be
two thirds of its step's memory traffic. Its held tokens are instead the leading view [B, H, n, D] of a
buffer [B, H, n + spare, D]; the next tokens are written into the free slots, and only a buffer that is
full, or that is no longer what the layer holds (an eviction gathered a new tensor), is replaced: one copy
per `spare` steps. `memory_report()` counts the whole buffer (kvcompress.memory.storage_bytes counts a
view's storage). With autograd on, nothing is written in place (a cat, as DynamicLayer does).
"""

from __future__ import annotations

import torch


def append_in_place(held: torch.Tensor, new: torch.Tensor, buffer: torch.Tensor | None, spare: int
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """held [B, H, n, D] (a view of `buffer` or any tensor), new [B, H, q, D] -> (held and new [B, H, n+q, D],
    the buffer it is a view of, or None after a cat)."""
    if torch.is_grad_enabled() and (held.requires_grad or new.requires_grad):
        return torch.cat([held, new], dim=2), None
    n, q = held.shape[2], new.shape[2]
    if buffer is None or not _leads(held, buffer) or n + q > buffer.shape[2]:
        buffer = held.new_empty((*held.shape[:2], n + q + spare, held.shape[-1]))
        buffer[:, :, :n] = held
    buffer[:, :, n:n + q] = new
    return buffer[:, :, :n + q], buffer


def _leads(held: torch.Tensor, buffer: torch.Tensor) -> bool:
    """Whether held is buffer[:, :, :n] (the same first element and strides)."""
    return (held.data_ptr() == buffer.data_ptr() and held.stride() == buffer.stride()
            and held.shape[:2] == buffer.shape[:2] and held.shape[-1] == buffer.shape[-1]
            and held.device == buffer.device and held.dtype == buffer.dtype)
