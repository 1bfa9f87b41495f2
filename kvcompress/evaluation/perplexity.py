"""Perplexity measured the way a cache is used: prefill half a text, then decode the rest token by token.

The numbers of `kvcompress eval` and the calibration search come from here. Every prediction that
counts is made by a forward pass reading the cache under test, so a lossy cache shows in the loss, and,
against a recording of the uncompressed run, in the KL divergence of each prediction (divergence.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from importlib.resources import files
from typing import Callable

import torch

from kvcompress.evaluation.divergence import ReferenceLogprobs, kl_and_top1
from kvcompress.evaluation.timing import StepTimer


class TextTooShortError(ValueError):
    """The evaluation text has fewer tokens than the context asked for."""


def default_eval_text() -> str:
    """The evaluation prose shipped in kvcompress/data/eval.txt (never used for calibration)."""
    return files("kvcompress.data").joinpath("eval.txt").read_text(encoding="utf-8")


def context_ids(tokenizer, context: int, text: str | None = None) -> torch.Tensor:
    """The first `context` token ids of `text` (default: the shipped eval text), [1, context].

    Raises TextTooShortError naming how many tokens the text has.
    """
    if context < 4:
        raise ValueError(f"context must be at least 4 tokens, got {context}")
    text = default_eval_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < context:
        raise TextTooShortError(
            f"the evaluation text has only {ids.shape[1]} tokens, fewer than --context {context}; "
            "pass a longer --text FILE or a smaller --context"
        )
    return ids[:, :context]


def context_windows(tokenizer, context: int, windows: int, text: str | None = None) -> list[torch.Tensor]:
    """`windows` disjoint consecutive windows of `context` tokens from the start of `text` (default: the
    shipped eval text), each [1, context]. Raises TextTooShortError naming how many fit."""
    if windows < 1:
        raise ValueError(f"windows must be at least 1, got {windows}")
    if windows == 1:
        return [context_ids(tokenizer, context, text)]
    if context < 4:
        raise ValueError(f"context must be at least 4 tokens, got {context}")
    text = default_eval_text() if text is None else text
    ids = tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] < context * windows:
        raise TextTooShortError(
            f"the evaluation text has only {ids.shape[1]} tokens: {ids.shape[1] // context} window(s) of --context "
            f"{context} fit, not --windows {windows}; pass a longer --text FILE, fewer windows or a smaller context"
        )
    return [ids[:, i * context:(i + 1) * context] for i in range(windows)]


@dataclass
class PerplexityResult:
    """nll: mean negative log-likelihood (nats) of the n_tokens decoded-half predictions; ppl = exp(nll)."""

    nll: float
    ppl: float
    n_tokens: int
    seconds_per_step: float  # median wall time of one decode step
    memory: dict | None = None  # the cache's memory report at the end, when it has one
    tokens_read: int | None = None  # tokens the last decode step attended to, when the cache says
    bytes_read: int | None = None  # K/V bytes the last decode step read, when the cache says
    cache: object = field(default=None, repr=False)  # the cache as it stands at the end
    kl: float | None = None  # mean KL(reference || this cache) over the scored positions, nats (given a reference)
    top1: float | None = None  # share of scored positions whose most likely token is the reference's


@torch.inference_mode()
def perplexity(
    model,
    tokenizer,
    cache_factory: Callable[[], object],
    ids: torch.Tensor | str,
    *,
    on_step: Callable[[], None] | None = None,
    record: ReferenceLogprobs | None = None,
    reference: ReferenceLogprobs | None = None,
) -> PerplexityResult:
    """Perplexity of the second half of `ids` decoded through a fresh cache.

    Args:
        model: a causal LM (its forward takes the cache through `kvcompress.compat.with_cache`).
        tokenizer: used only when `ids` is a string.
        cache_factory: zero-argument callable returning a fresh `transformers.Cache`
            (e.g. `lambda: CompressedCache(model.config, "nuq4")`).
        ids: token ids [1, N] (N >= 4), or a text to tokenize whole.
        on_step: called after each decode step (progress bars).
        record: receives the top-k log-probabilities of every scored position (the reference run).
        reference: a recording of the same `ids` through the uncompressed cache: the result then carries the
            mean KL divergence from it and the top-1 agreement with it (kvcompress.evaluation.divergence).

    Protocol: the first P = N // 2 tokens go through the cache in one prefill forward; then tokens
    P .. N-2 are fed one at a time (teacher forcing) through the same cache. Only the predictions of
    tokens P .. N-1 (the decoded half, N - P of them) count: the first comes from the prefill's last
    position, which already attends to what the cache returned, and the rest from decode steps that read
    the cache, so every counted prediction saw the compressed cache. The prefill's own earlier
    next-token losses are not counted.
    """
    from kvcompress.compat import with_cache

    if isinstance(ids, str):
        ids = tokenizer(ids, return_tensors="pt", add_special_tokens=False).input_ids
    if ids.dim() != 2 or ids.shape[0] != 1 or ids.shape[1] < 4:
        raise ValueError(f"ids must be [1, N] with N >= 4, got {tuple(ids.shape)}")
    ids = ids.to(model.device)
    n = ids.shape[1]
    prefill = n // 2
    cache = cache_factory()

    if reference is not None and len(reference) != n - prefill:
        raise ValueError(f"the reference holds {len(reference)} scored positions, these ids score "
                         f"{n - prefill}: record it on the same ids")
    divergence = _Divergence(record, reference)
    out = model(ids[:, :prefill], **with_cache(cache), logits_to_keep=1)
    nll = _token_nll(out.logits[:, -1], ids[:, prefill])
    divergence.add(out.logits[0, -1])
    timer = StepTimer(ids.device)
    for t in range(prefill, n - 1):
        with timer:
            out = model(ids[:, t : t + 1], **with_cache(cache))
        nll += _token_nll(out.logits[:, -1], ids[:, t + 1])
        divergence.add(out.logits[0, -1])
        if on_step is not None:
            on_step()
    n_tokens = n - prefill
    mean = nll / n_tokens
    memory = cache.memory_report() if hasattr(cache, "memory_report") else None
    read = cache.tokens_read_last_step() if hasattr(cache, "tokens_read_last_step") else None
    read_bytes = cache.bytes_read_last_step() if hasattr(cache, "bytes_read_last_step") else None
    return PerplexityResult(
        nll=mean, ppl=math.exp(mean), n_tokens=n_tokens, seconds_per_step=timer.median_s,
        memory=memory, tokens_read=read, bytes_read=read_bytes, cache=cache, kl=divergence.mean_kl,
        top1=divergence.top1_share,
    )


class _Divergence:
    """Records the reference's scored positions, or compares each with the reference's, in order."""

    def __init__(self, record: ReferenceLogprobs | None, reference: ReferenceLogprobs | None):
        self.record, self.reference = record, reference
        self.kl, self.same, self.n = 0.0, 0, 0

    def add(self, logits: torch.Tensor) -> None:
        """logits [V] of the next scored position."""
        if self.record is not None:
            self.record.record(logits)
        if self.reference is not None:
            kl, same = kl_and_top1(logits, self.reference.token_ids[self.n], self.reference.logprobs[self.n])
            self.kl, self.same = self.kl + kl, self.same + same
        self.n += 1

    @property
    def mean_kl(self) -> float | None:
        return self.kl / self.n if self.reference is not None and self.n else None

    @property
    def top1_share(self) -> float | None:
        return self.same / self.n if self.reference is not None and self.n else None


def _token_nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    """logits [1, V], target [1] -> -log p(target) in float64 nats."""
    return float(torch.nn.functional.cross_entropy(logits.double(), target, reduction="sum"))
