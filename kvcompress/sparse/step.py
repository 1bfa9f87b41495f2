"""One attention call over a sparse layer, around whichever function computes it.

`begin_sparse_step` fills the step the layer's update left (kvcompress.sparse.state): the mask of the held
tokens, indexed by position so that eviction keeps padding masked, the policy's selection (Quest) and how
many queries' attention mass the policy needs; the attention then runs (the `kvcompress` attention
implementation for GQA layers, the absorbed forward for MLA ones); `finish_sparse_step` accounts what was
read and lets the policy score and evict.
"""

from __future__ import annotations

import torch


def begin_sparse_step(layer, query, key, attention_mask, scaling: float, deferred: bool) -> None:
    """Fill the step of a sparse layer whose update returned `key` [B, H, held, Dk]: the held-token mask
    [B, H, q, held], the policy's selection (Quest; from query [B, Hq, q, D], D the width its page
    summaries have) and how many queries' attention mass it needs."""
    state, step = layer.sparse, layer.sparse.step
    held = layer.held_tokens if deferred else key.shape[2]
    step.deferred = deferred
    if step.deferred and query.shape[2] > 1:
        # a deferred prefill (Quest): the attention reads no mask, the policy only the newest query's row,
        # so the [B, H, q, held] mask is not built
        mask = attention_mask[..., -1:, :] if isinstance(attention_mask, torch.Tensor) else attention_mask
        step.mask = held_mask(mask, state.positions(held, key), 1)
    else:
        step.mask = held_mask(attention_mask, state.positions(held, key), query.shape[2])
    step.scaling = scaling
    step.exact = (layer.sink_k.shape[2], layer.tail_k.shape[2]) if layer.compressed else (0, 0)
    step.index = state.policy.select(state, query, step.mask)
    step.mass_queries = state.policy.mass_queries(query.shape[2])


def finish_sparse_step(layer, mass) -> None:
    """After the attention: account the tokens read, let the policy score and evict, drop the step.
    mass: [B, H, held] attention summed per held token (None when the policy asked for none)."""
    state, step = layer.sparse, layer.sparse.step
    held = step.mask.shape[-1]
    state.read_held, state.read_index = held, step.index
    if layer.ragged is not None:  # per-kv-head budgets: the dead slots past each head's tokens hold nothing
        state.read_held = layer.ragged.mean_count() + layer.tail_k.shape[2]  # read when asked: no sync
    state.read_body = (layer.sink_k.shape[2], layer.key_store.n_tokens) if layer.compressed else (0, held)
    state.policy.after_attention(layer, state, mass, step.mask[:, :, -1, :])
    state.step = None  # drop this step's dense K/V


def held_mask(attention_mask, pos: torch.Tensor, q_len: int) -> torch.Tensor:
    """The mask of the held tokens: pos [B, H, held] positions -> [B, H, q, held] bool, True = attend."""
    b, h, held = pos.shape
    if attention_mask is None:
        seen = int(pos.max()) + 1 if held else q_len
        q_pos = torch.arange(seen - q_len, seen, device=pos.device)
        live = (pos >= 0)[:, :, None, :]
        return ((pos[:, :, None, :] <= q_pos[:, None]) & live).expand(b, h, q_len, held)
    m = attention_mask
    if m.dtype != torch.bool:  # an additive float mask: 0 where allowed
        m = m > torch.finfo(m.dtype).min / 2
    m = m.expand(b, h, q_len, m.shape[-1])
    idx = pos[:, :, None, :].expand(b, h, q_len, held).long()
    return m.gather(3, idx.clamp_min(0)) & (idx >= 0)  # dead slots (position -1) stay masked
