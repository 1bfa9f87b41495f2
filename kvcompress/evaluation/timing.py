"""Wall-clock timing of decode steps (synchronising the accelerator so a step's time is its own)."""

from __future__ import annotations

import statistics
import time

import torch


def synchronize(device: torch.device) -> None:
    """Wait for queued accelerator work, so the clock measures finished steps."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class StepTimer:
    """Collects the duration of each timed block: `with timer: step()`; `timer.median_s`."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: list[float] = []
        self._start = 0.0

    def __enter__(self) -> "StepTimer":
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - self._start)

    @property
    def median_s(self) -> float:
        """Median seconds per timed block (robust to the first, warm-up steps); nan if none."""
        return statistics.median(self.seconds) if self.seconds else float("nan")


@torch.inference_mode()
def time_decode(model, cache_factory, ids: torch.Tensor, steps: int = 32) -> float:
    """Median seconds of one decode step at the context `ids` gives.

    ids: [1, N] token ids; the first N - steps go in as one prefill, the last `steps` one at a time.
    Used when the decode steps of a perplexity run were timed under contention (several runs in parallel).
    """
    from kvcompress.compat import with_cache

    if not 0 < steps < ids.shape[1]:
        raise ValueError(f"steps must be in 1..{ids.shape[1] - 1}, got {steps}")
    ids = ids.to(model.device)
    cache = cache_factory()
    prefill = ids.shape[1] - steps
    model(ids[:, :prefill], **with_cache(cache), logits_to_keep=1)
    timer = StepTimer(ids.device)
    for t in range(prefill, ids.shape[1]):
        with timer:
            model(ids[:, t : t + 1], **with_cache(cache))
    return timer.median_s
