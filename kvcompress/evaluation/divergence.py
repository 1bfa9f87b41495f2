"""How far a cache moves the model's next-token distribution: KL divergence from the uncompressed cache's
distribution, and how often the most likely token stays the same (llama.cpp's `--kl-divergence` numbers).

Why beside perplexity: a perplexity change is the mean of per-token log-likelihood changes of both signs,
so a lossy cache can gain on some tokens what it loses on others, and one 2048-token window of SmolLM2
scatters by +-0.6 %. KL(P_ref || P_cache) is >= 0 at every scored position and measures the distortion
itself, so it separates caches of similar perplexity on one window.

The reference keeps, per scored position, the log-probabilities of its TOP_K most likely tokens (float32)
and lumps the rest into one "other" bucket, so it holds 8 KB per position instead of the vocabulary
(SmolLM2: 49152 tokens, 196 KB in float32). The KL of the bucketed distributions is a lower bound of the
full one (the log-sum inequality): on SmolLM2, 256 tokens, 2.5-4 % under it for fp8, int4, nuq4 and int2
alike (tests/test_eval.py), so caches compare as they would on the full vocabulary.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

TOP_K = 1024  # reference tokens kept per position; the lumped rest holds the remaining probability mass


@dataclass
class ReferenceLogprobs:
    """The uncompressed run's top-k log-probabilities, one row per scored position, in scoring order."""

    k: int = TOP_K  # tokens kept per position (the vocabulary size keeps every one: the exact KL)
    token_ids: list[torch.Tensor] = field(default_factory=list)  # each [k] int32
    logprobs: list[torch.Tensor] = field(default_factory=list)  # each [k] float32, descending

    def record(self, logits: torch.Tensor) -> None:
        """logits [V] of one scored position (any float dtype)."""
        lp = torch.log_softmax(logits.double(), -1)
        top = lp.topk(min(self.k, lp.shape[-1]))
        self.token_ids.append(top.indices.to("cpu", torch.int32))
        self.logprobs.append(top.values.to("cpu", torch.float32))

    def __len__(self) -> int:
        return len(self.token_ids)


def kl_and_top1(logits: torch.Tensor, ref_ids: torch.Tensor,
                ref_logprobs: torch.Tensor) -> tuple[float, bool]:
    """KL(P_ref || P) in nats for one position, and whether P's most likely token is the reference's.

    logits [V] of the cache under test; ref_ids / ref_logprobs [k] the reference's top-k (descending)."""
    lq = torch.log_softmax(logits.double(), -1)
    lp = ref_logprobs.double().to(lq.device)
    lq_top = lq[ref_ids.to(lq.device, torch.long)]  # [k]
    kl = float((lp.exp() * (lp - lq_top)).sum())
    p_rest = 1.0 - float(lp.exp().sum())
    q_rest = 1.0 - float(lq_top.exp().sum())
    # the bucket of every token outside the reference's top k; below 1e-6 its mass is the float32 rounding
    # of the stored log-probabilities (a recording of the whole vocabulary), not a tail
    if p_rest > 1e-6:
        kl += p_rest * (math.log(p_rest) - math.log(max(q_rest, 1e-300)))
    return max(kl, 0.0), bool(int(lq.argmax()) == int(ref_ids[0]))
