"""Evaluation of KV caches: perplexity through the cache, KL divergence from the uncompressed cache,
passkey retrieval, memory, decode time.

    from kvcompress.evaluation import evaluate, perplexity, passkey_accuracy
    rows = evaluate(model, tokenizer, presets=["fp8", "nuq4"], context=2048)
"""

from kvcompress.evaluation.divergence import ReferenceLogprobs
from kvcompress.evaluation.passkey import PasskeyResult, passkey_accuracy, passkey_prompt
from kvcompress.evaluation.perplexity import (
    PerplexityResult,
    TextTooShortError,
    context_ids,
    context_windows,
    default_eval_text,
    perplexity,
)
from kvcompress.evaluation.runner import add_deltas, evaluate

__all__ = [
    "PasskeyResult",
    "PerplexityResult",
    "ReferenceLogprobs",
    "TextTooShortError",
    "add_deltas",
    "context_ids",
    "context_windows",
    "default_eval_text",
    "evaluate",
    "passkey_accuracy",
    "passkey_prompt",
    "perplexity",
]
