"""Attention of absorbed MLA queries over what a sparse MLA layer keeps (torch).

An MLA layer caches one latent "kv head" per token: kv_nope [B, 1, T, R] in the key slot and the rotated
RoPE key k_rot [B, 1, T, Dr] in the value slot (kvcompress.layout.arch). Its sparsity policy therefore
decides per token for every query head at once: the per-kv-head machinery of kvcompress.sparse with one
kv head whose group is all the query heads. A token's score is q_latent . kv_nope + q_rope . k_rot, the
output is the weighted latent, and the mass H2O and SnapKV read is summed over all the heads. Quest's page
summaries span the whole R + Dr wide key (`CompressedLayer.update` hands both parts to the state), so a
page is scored on the same logits the attention computes.
"""

from __future__ import annotations

import torch

from kvcompress.sparse.state import gather_step

# float32 scores [B, H, queries, held] held at once by MLA attention in torch (256 MB; here and in
# kvcompress.layout.mla_attention.absorbed_attention): a long prefill at 128 heads runs in blocks of queries
SCORE_ELEMENTS = 1 << 26


def attend_mla_torch(q_latent: torch.Tensor, q_rope: torch.Tensor, layer, scaling: float):
    """q_latent [B, H, q, R], q_rope [B, H, q, Dr] over `layer.sparse.step` (held kv_nope as its keys, k_rot
    as its values, mask [B, 1, q, held], optional selection index [B, 1, n]) -> (o_latent [B, H, q, R]
    float32, mass [B, 1, held] or None). A query that may attend nothing gets zeros."""
    step = layer.sparse.step
    kv, kr, mask = gather_step(step)  # [B, 1, n, R], [B, 1, n, Dr], [B, 1, q, n]
    b, h, q, _ = q_latent.shape
    kv, kr = kv[:, 0].float(), kr[:, 0].float()
    n = kv.shape[1]
    block = max(1, SCORE_ELEMENTS // max(1, b * h * n))
    first_mass = q - step.mass_queries
    outs, mass = [], None
    for lo in range(0, q, block):
        hi = min(lo + block, q)
        scores = torch.einsum("bhsr,bnr->bhsn", q_latent[:, :, lo:hi].float(), kv)
        scores += torch.einsum("bhsd,bnd->bhsn", q_rope[:, :, lo:hi].float(), kr)
        scores *= scaling
        allowed = mask[:, :, lo:hi]  # [B, 1, s, n]: the same tokens for every head
        scores = scores.masked_fill(~allowed, torch.finfo(torch.float32).min)
        w = torch.softmax(scores, dim=-1) * allowed
        outs.append(torch.einsum("bhsn,bnr->bhsr", w, kv))
        if step.mass_queries and hi > first_mass:
            part = w[:, :, max(first_mass - lo, 0):].sum((1, 2))[:, None]  # [B, 1, n]
            mass = part if mass is None else mass + part
    out = torch.cat(outs, dim=2)
    if mass is not None and step.index is not None:  # against every held token (unread ones, -1 slots: none)
        mass = mass.new_zeros(b, 1, step.keys.shape[2]).scatter_add(2, step.index.clamp_min(0), mass)
    return out, mass
