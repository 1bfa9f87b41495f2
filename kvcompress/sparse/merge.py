"""Merging evicted tokens into the kept ones (H2O with `merge=True`), instead of dropping them.

When H2O compacts a full-precision layer, each evicted token is folded into the kept token of the same
kv head whose key is most similar (cosine). The kept key and value become the means of the tokens merged
into them, each weighted by the attention it has accumulated (H2O's scores), so that a group's key and value
lean to the tokens its queries actually read. The kept token's size (how many tokens it stands for) grows,
and attention adds log(size) to each held token's logit (`attention_bias`): a token that stands for n tokens
with one key gets the softmax weight those n identical keys would get together, so a merged group keeps its
share of the attention instead of losing it (ToMe's proportional attention, arXiv:2210.09461; merging
evicted KV as in D2O, arXiv:2406.13035). H2O's accumulated scores of merged tokens add up.

Memory stays bounded: the held tokens are exactly those plain H2O keeps, plus one float32 size per held
token and kv head (`SparseState.log_size`). Only full-precision storage merges: a quantized page cannot
take a merged value without re-quantizing values that are already lossy.

Measured on SmolLM2-135M, 50 % of the context, 4 sinks kept (BENCHMARKS.md, "H2O merges weighted by
attention"), 4 windows of 1024 tokens of eval.txt: -0.03 % perplexity on average (KL 9.1e-3) with means
weighted by attention, +0.59 % (KL 1.4e-2) with means weighted by size, +1.30 % for dropping. Merging into
the recent window is part of why: barring it lost +1.50 % on the first window (+0.67 % allowed). At 25 % of
the context merging loses more than dropping (+3.8 % against +3.4 % on the first window).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvcompress.sparse.base import gather_tokens, hold_tokens, kept_tokens

SIM_ELEMENTS = 1 << 26  # float32 similarities held at once, [B, H, rows, held]: 256 MB
SCORE_FLOOR = 1e-6  # weight of a token no query has read yet, in attention mass (a query's is 1 per head)


def padded_log_size(state, held: int, like: torch.Tensor) -> torch.Tensor:
    """[B, H, held] log size of each held token: the state's, zeros for tokens appended since."""
    ls = state.log_size
    b, h = like.shape[:2]
    if ls is None:
        return torch.zeros(b, h, held, device=like.device)
    if ls.shape[2] < held:
        ls = torch.cat([ls, ls.new_zeros(b, h, held - ls.shape[2])], dim=2)
    return ls


def attention_bias(layer) -> torch.Tensor | None:
    """The logit bias [B, H, held] of a sparse layer that merged tokens (each token's log size), else None."""
    state = getattr(layer, "sparse", None)
    if getattr(state, "log_size", None) is None:
        return None
    keys = state.step.keys
    return padded_log_size(state, keys.shape[2], keys)


def nearest_kept(keys: torch.Tensor, rows: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """keys [B, H, N, D], rows [B, H, E] token indices, keep [B, H, N] bool -> for each of those tokens, the kept
    token whose key is the most similar (cosine) [B, H, E]; a block of rows at a time (SIM_ELEMENTS)."""
    b, h, n, _ = keys.shape
    unit = F.normalize(keys.float(), dim=-1)
    block = max(1, SIM_ELEMENTS // max(b * h * n, 1))
    out = []
    for lo in range(0, rows.shape[2], block):
        sim = gather_tokens(unit, rows[:, :, lo:lo + block]) @ unit.transpose(-1, -2)  # [B, H, rows, N]
        out.append(sim.masked_fill(~keep[:, :, None, :], -2.0).argmax(-1))
    return torch.cat(out, dim=2)


def mean_weights(state, size: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """[B, H, held] weight of each held token in the merged means: the attention it has accumulated (H2O's
    scores, [B, H, held] at every compaction, which add up over merges), plus a floor so that a token no
    query has read yet still counts a little; its size where there are no scores. Padding weighs nothing."""
    if state.scores is None:
        return size
    return torch.where(valid, state.scores + SCORE_FLOOR, torch.zeros_like(size))


def merge_compact(
    layer, state, priority: torch.Tensor, forced: torch.Tensor, valid: torch.Tensor, n_keep: int
) -> None:
    """`compact` for a full-precision layer, with every evicted real token merged into its nearest kept one.

    priority, forced, valid: [B, H, held] in held order; the kept tokens are those `compact` keeps.
    """
    idx = kept_tokens(layer, priority, forced, valid, n_keep)  # [B, H, n_keep]
    if idx is None:
        return
    (b, h, n_keep), held = idx.shape, layer.held_tokens
    keep = torch.zeros(b, h, held, dtype=torch.bool, device=idx.device).scatter_(2, idx, True)
    k, v = layer.tail_k.float(), layer.tail_v.float()
    log_size = padded_log_size(state, held, valid)
    size = torch.where(valid, log_size.exp(), torch.zeros_like(log_size))  # padding merges into nothing
    # every row evicts held - n_keep tokens; only they look for a kept token, and only for a real one (padding
    # kept to fill a short row's budget takes no merge and stays masked)
    evicted = (~keep).float().topk(held - n_keep, dim=-1).indices  # [B, H, E]
    target = torch.arange(held, device=idx.device).expand(b, h, held).clone()
    target.scatter_(2, evicted, nearest_kept(k, evicted, keep & valid))
    total = torch.zeros_like(size).scatter_add_(2, target, size)  # [B, H, held]: new size of each kept token
    weight = mean_weights(state, size, valid)
    denom = torch.zeros_like(weight).scatter_add_(2, target, weight).clamp_min(1e-30)[..., None]

    def merged(x):
        s = torch.zeros_like(x).scatter_add_(2, target[..., None].expand_as(x), weight[..., None] * x)
        return torch.where(keep[..., None] & (total[..., None] > 0), s / denom, x)

    hold_tokens(layer, gather_tokens(merged(k).to(layer.tail_k.dtype), idx),
                gather_tokens(merged(v).to(layer.tail_v.dtype), idx))
    if state.scores is not None:
        real = state.scores.masked_fill(~valid, 0.0)
        state.scores = torch.zeros_like(state.scores).scatter_add_(2, target, real)
    new_log = torch.where(total > 0, total.clamp_min(1e-30).log(), log_size)
    state.gather(idx, held)
    state.log_size = new_log.gather(2, idx)
