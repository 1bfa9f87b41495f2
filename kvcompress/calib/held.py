"""How many tokens a sparse layer holds after C tokens, and the bytes its sparsity state adds, at most.

What the policies of kvcompress.sparse do, as a bound for planning memory (`kvcompress estimate`, the
calibration's budget), per kv head of one sequence:
- H2O and StreamingLLM compact to their budget (a token count, or a ratio of the tokens seen), then grow
  by up to one page before compacting again: at most budget + one page in full precision; over quantized
  pages, whose eviction keeps whole pages and every page the recent window touches, at most budget + two
  pages (`tests/test_sparse.py::test_h2o_memory_stays_bounded` holds the cache to the same bound).
- A full-precision layer under any policy appends in place into a buffer with one page of free slots
  (kvcompress.layout.grow), which it holds beside its tokens (`room_tokens`).
- SnapKV selects once, at prefill, and then appends without evicting: the context is taken as the prompt,
  so it holds its budget of it (every decoded token adds one more).
- Quest evicts nothing: it holds every token, plus bfloat16 min / max key summaries per page of its own
  and the float32 keys of the page still filling; with `unread_means` also a bfloat16 mean value per page
  and the float32 values of the page still filling.
Layers below `dense_layers` (Quest's dense first layers) hold everything. H2O with `head_shares` holds each
kv head's own budget (ceil(share x budget) + one page), packed (kvcompress.sparse.ragged): the tokens count
as their mean over the heads, rounded up; positions and scores stay padded to the largest head, plus an
int64 count and an int64 offset per kv head.

Beside the tokens, an evicting layer keeps each held token's position (int32) and H2O its accumulated
attention (float32; a merged token also its log size), as the memory report counts them.
"""

from __future__ import annotations

import math

from kvcompress.config import LayerPolicy

POSITION_BYTES = 4  # int32 positions of the held tokens once a layer has evicted (sparse.state)
SCORE_BYTES = 4  # float32 accumulated attention per held token (H2O), and log size per merged token
# int64 tokens kept and where they start, per kv head of a layer with head_shares (sparse.ragged)
COUNT_BYTES = 16


def is_sparse_here(policy: LayerPolicy, layer_idx: int) -> bool:
    s = policy.sparsity
    return s.method != "none" and layer_idx >= s.dense_layers


def token_budget(policy: LayerPolicy, context: int) -> int:
    s = policy.sparsity
    return s.budget if s.budget else max(1, math.ceil(s.ratio * context))


def held_tokens(policy: LayerPolicy, layer_idx: int, context: int) -> int:
    """Tokens held per kv head after `context` tokens, at most (with head_shares: the heads' mean)."""
    per_head = head_held(policy, layer_idx, context)
    return math.ceil(sum(per_head) / len(per_head))


def head_held(policy: LayerPolicy, layer_idx: int, context: int) -> list[int]:
    """Tokens each kv head holds after `context` tokens, at most: one entry for all of them, or one per
    head with head_shares."""
    if not is_sparse_here(policy, layer_idx) or policy.sparsity.method == "quest":
        return [context]
    budget = token_budget(policy, context)
    if policy.sparsity.method == "snapkv":
        return [min(context, budget)]
    quantized = not (policy.key.is_lossless and policy.value.is_lossless)
    slack = 2 * policy.page_size if quantized else policy.sparsity.page_size
    shares = policy.sparsity.head_shares or [1.0]
    return [min(context, max(1, math.ceil(x * budget)) + slack) for x in shares]


def room_tokens(policy: LayerPolicy) -> int:
    """Free slots a layer holds beside its tokens, per kv head: a full-precision layer under a policy (dense
    layers below `dense_layers` included) appends into a buffer with one page of them
    (kvcompress.layout.grow)."""
    lossless = policy.key.is_lossless and policy.value.is_lossless
    return policy.sparsity.page_size if lossless and policy.sparsity.method != "none" else 0


def sparsity_state_bytes(policy: LayerPolicy, layer_idx: int, context: int, num_heads: int, key_dim: int,
                         batch: int = 1, value_dim: int | None = None) -> int:
    """Bytes of the sparsity state (positions, scores, Quest's page summaries) after `context` tokens.
    value_dim (default key_dim): the width of Quest's page means."""
    if not is_sparse_here(policy, layer_idx):
        return 0
    s = policy.sparsity
    rows = batch * num_heads
    if s.method == "quest":
        pages, filling = divmod(context, s.page_size)
        means = (key_dim if value_dim is None else value_dim) if s.unread_means else 0
        per_page = 2 * key_dim + means  # bfloat16: min, max and the mean value
        per_filling = key_dim + means  # float32 keys (and values) of the page still filling
        return rows * (pages * per_page * 2 + filling * per_filling * 4)
    held = max(head_held(policy, layer_idx, context))  # positions and scores: padded to the largest head
    per_token = POSITION_BYTES if held < context else 0
    if s.method == "h2o":
        per_token += SCORE_BYTES * (2 if s.merge else 1)
    counts = rows * COUNT_BYTES if s.head_shares else 0
    return rows * held * per_token + counts
