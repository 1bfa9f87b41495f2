"""Passkey retrieval: can the model still find a 5-digit number hidden deep in a long cached context?

The classic test (Mohtashami & Jaggi 2023, "Landmark Attention", https://arxiv.org/abs/2305.16300):
a key hidden at some depth of L tokens of filler, recovered by greedy decoding through the cache.
Beside hit or miss, each trial scores the answer's log-probability (" " + the key, teacher-forced after
the prompt): a small model sits at its retrieval edge, where hits flip with any perturbation, while the
log-probability moves continuously and separates caches on fewer trials.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch

INSTRUCTION = (
    "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there.\n\n"
)
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
QUESTION = "\n\nWhat is the pass key? The pass key is"
ANSWER_PREFIX = "The pass key is"

Template = Literal["plain", "chat"]


@dataclass
class PasskeyTrial:
    length: int  # prompt tokens
    depth: float  # where the needle sits, as a fraction of the filler
    seed: int
    key: int
    output: str
    found: bool
    answer_logprob: float  # log p(" " + key | prompt) through the cache, nats (0 = certain)


@dataclass
class PasskeyResult:
    accuracy: float  # fraction of trials whose key digits appear in the greedy output
    trials: list[PasskeyTrial] = field(default_factory=list)

    @property
    def mean_answer_logprob(self) -> float:
        """Mean over trials of the answer's log-probability (nats); nan without trials."""
        return sum(t.answer_logprob for t in self.trials) / len(self.trials) if self.trials else float("nan")


def passkey_key(length: int, depth: float, seed: int) -> int:
    """The 5-digit key of one trial: deterministic in (length, depth, seed) across runs and machines."""
    return random.Random(f"passkey-{seed}-{length}-{depth:.3f}").randint(10000, 99999)


def passkey_prompt(tokenizer, length: int, depth: float, key: int, template: Template = "plain") -> torch.Tensor:
    """Token ids [1, ~length] of instruction | filler | needle at `depth` | filler | question.

    Filler is whole repetitions of a neutral sentence group, as many as fit in `length` tokens
    (the prompt is at most `length` tokens, a few short where a repetition does not fit).
    template: "plain" (the text as is) or "chat" (the text as the user turn, the answer
    prefix "The pass key is" as the start of the assistant turn).
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")

    def count(text: str) -> int:
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    needle = NEEDLE.format(key=key)
    empty = _render(tokenizer, INSTRUCTION + needle + QUESTION, template)
    per_filler = count(FILLER * 8) / 8
    n_filler = max(int((length - count(empty)) / per_filler), 1)
    while n_filler > 1 and count(_render(tokenizer, _body(n_filler, depth, needle), template)) > length:
        n_filler -= 1
    text = _render(tokenizer, _body(n_filler, depth, needle), template)
    return tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids


def _body(n_filler: int, depth: float, needle: str) -> str:
    before = round(n_filler * depth)
    return INSTRUCTION + FILLER * before + needle + FILLER * (n_filler - before) + QUESTION


def _render(tokenizer, body: str, template: Template) -> str:
    if template == "plain":
        return body
    if template == "chat":
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("template='chat' needs a tokenizer with a chat template; use template='plain'")
        question = body[: -len(ANSWER_PREFIX)].rstrip()
        turn = tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return turn + ANSWER_PREFIX
    raise ValueError(f"template must be 'plain' or 'chat', got {template!r}")


def answer_ids(tokenizer, key: int) -> list[int]:
    """Token ids of the answer that follows the prompt's "The pass key is": " " + the key."""
    return tokenizer(f" {key}", add_special_tokens=False).input_ids


@torch.inference_mode()
def greedy_continue(model, cache, ids: torch.Tensor, max_new_tokens: int, logprobs: list | None = None) -> list[int]:
    """Greedy decode through `cache`: prefill ids [1, N], then `max_new_tokens` steps. Returns new ids.

    logprobs: when given, receives the log-softmax [V] (float32) each new token was chosen from.
    """
    from kvcompress.compat import with_cache

    out = model(ids, **with_cache(cache), logits_to_keep=1)
    new = []
    for step in range(max_new_tokens):
        logits = out.logits[0, -1]  # [V]
        if logprobs is not None:
            logprobs.append(torch.log_softmax(logits.float(), -1))
        nxt = logits.argmax(-1).view(1, 1)
        new.append(int(nxt))
        if step + 1 < max_new_tokens:
            out = model(nxt, **with_cache(cache))
    return new


@torch.inference_mode()
def teacher_forced_logprob(model, cache, ids: torch.Tensor, answer: list[int]) -> float:
    """log p(answer | ids) through `cache`: prefill ids [1, N], then feed the answer one token at a time
    (as decoding would), summing the log-probability of each answer token. Nats."""
    from kvcompress.compat import with_cache

    out = model(ids, **with_cache(cache), logits_to_keep=1)
    total = 0.0
    for i, tok in enumerate(answer):
        total += float(torch.log_softmax(out.logits[0, -1].float(), -1)[tok])
        if i + 1 < len(answer):
            out = model(ids.new_tensor([[tok]]), **with_cache(cache))
    return total


def _trial_logprob(new: list[int], logprobs: list, answer: list[int]) -> float | None:
    """The answer's log-probability read off a greedy run whose first tokens are the answer (the same
    tokens fed, so the same numbers a teacher-forced run gives); None when greedy left the answer."""
    if new[: len(answer)] != answer:
        return None
    return sum(float(lp[tok]) for lp, tok in zip(logprobs, answer))


def passkey_accuracy(
    model,
    tokenizer,
    cache_factory: Callable[[], object],
    lengths=(1024, 2048),
    depths=(0.1, 0.5, 0.9),
    seeds=(0,),
    *,
    template: Template = "plain",
    max_new_tokens: int = 8,
    on_trial: Callable[[], None] | None = None,
) -> PasskeyResult:
    """Fraction of (length, depth, seed) trials whose 5-digit key appears in the greedy output, and each
    trial's answer log-probability.

    cache_factory: zero-argument callable returning a fresh cache (one per trial; a trial whose greedy
    output does not begin with the answer scores it through a second fresh cache, prefilled again).
    template: "plain" by default: with the uncompressed cache SmolLM2-135M-Instruct finds 12 of 18
    keys (lengths 1024 / 2048, depths 0.1 / 0.5 / 0.9, 3 seeds) as plain text, 9 of 18 as a chat turn.
    """
    trials = []
    for length in lengths:
        for depth in depths:
            for seed in seeds:
                key = passkey_key(length, depth, seed)
                ids = passkey_prompt(tokenizer, length, depth, key, template).to(model.device)
                answer, logprobs = answer_ids(tokenizer, key), []
                new = greedy_continue(model, cache_factory(), ids, max_new_tokens, logprobs)
                output = tokenizer.decode(new, skip_special_tokens=True)
                logprob = _trial_logprob(new, logprobs, answer)
                if logprob is None:
                    logprob = teacher_forced_logprob(model, cache_factory(), ids, answer)
                trials.append(PasskeyTrial(length, depth, seed, key, output, str(key) in output, logprob))
                if on_trial is not None:
                    on_trial()
    accuracy = sum(t.found for t in trials) / len(trials) if trials else float("nan")
    return PasskeyResult(accuracy=accuracy, trials=trials)
