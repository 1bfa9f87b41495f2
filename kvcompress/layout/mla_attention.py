"""Absorbed multi-head latent attention (MLA) for DeepSeek-V2/V3 attention modules in transformers.

transformers caches the MLA latent (``kv_nope`` [B, 1, T, R] in the key slot, the rotated ``k_rot``
[B, 1, T, Dr] in the value slot) but re-expands the whole cached latent through ``kv_b_proj`` into
per-head keys and values at every step. Absorbed attention (DeepSeek-V2 paper, arXiv:2405.04434,
section 2.1.2) folds the two halves of ``kv_b_proj`` into the query and the output instead:

    q_latent[h] = W_UK[h]^T q_nope[h]                                  [B, H, S, R]
    scores[h]   = (q_latent[h] . kv_nope + q_rope[h] . k_rot) * scaling  [B, H, S, T]
    o_latent[h] = softmax(scores[h] + mask) @ kv_nope                  [B, H, S, R]
    out[h]      = W_UV[h] o_latent[h]                                   [B, H, S, Dv]

so every query head attends to one shared latent "head" and the cache is never expanded.

`patch_mla(model)` swaps the forward of each DeepSeek-V2/V3 attention instance (never the class)
and returns `undo`, which restores every patched module exactly.

Decode steps on the fused backend (`kvcompress.enable(model)` on CUDA) run the fused MLA kernel
(kvcompress.kernels.mla_decode): over a compressed layer's packed latent where it lies
(kvcompress.kernels.mla_layer; the layer never decodes its cache), or over an exact latent (a
DynamicCache, a lossless layer) as it is. Prefill, and every step on the torch backend, run
`absorbed_attention` in torch. A sparse layer's decode steps take the fused kernel too: Quest's over its
selected body pages, H2O's with the kernel writing the logits its attention mass is summed from.
"""

from __future__ import annotations

import inspect
import sys
import types
from typing import Callable

import torch
from torch import nn

from kvcompress.kernels.attention_backend import fused_active, quest_page_list, take_deferred
from kvcompress.kernels.mla_decode import MlaLatent, merge_partials
from kvcompress.kernels.mla_layer import decode_allowed, latent_dims_supported, mla_attend, mla_layer_decode
from kvcompress.sparse.mla import SCORE_ELEMENTS, attend_mla_torch
from kvcompress.sparse.state import take_pending
from kvcompress.sparse.step import begin_sparse_step, finish_sparse_step

_MLA_CLASSES = ("DeepseekV3Attention", "DeepseekV2Attention")


def is_mla_attention(module: nn.Module) -> bool:
    """True for a DeepSeek-V2/V3 attention module (latent cache + kv_b_proj)."""
    return type(module).__name__ in _MLA_CLASSES and hasattr(module, "kv_b_proj")


def is_mla(model: nn.Module) -> bool:
    """True when the model has at least one attention module `patch_mla` can absorb."""
    return any(is_mla_attention(m) for m in model.modules())


# -- the math, on plain tensors ---------------------------------------------------------------------
def split_kv_b_proj(weight: torch.Tensor, num_heads: int, qk_nope_head_dim: int, v_head_dim: int):
    """kv_b_proj.weight [H * (Dn + Dv), R] -> W_UK [H, Dn, R], W_UV [H, Dv, R] (views)."""
    w = weight.view(num_heads, qk_nope_head_dim + v_head_dim, -1)
    return w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]


def additive_mask(attention_mask, batch: int, q_len: int, kv_len: int, device, dtype) -> torch.Tensor | None:
    """The mask stock attention applies, as an additive float [B|1, 1, S, T] tensor (None: nothing masked).

    attention_mask: what the decoder layer hands the attention: None (causal, queries are the last S
    of the T keys), a 4D bool mask (True = attend, sdpa), a 4D float mask (additive, eager) or a 2D
    [B, T] padding mask (1 = keep, flash attention; causal applied on top). Boolean masks become
    -inf (a query that may attend nothing gets a zero output, as torch's SDPA gives it); float masks
    are kept as they are (finite, so such a query averages uniformly, as eager attention does).
    """
    neg = float("-inf")
    if attention_mask is None or attention_mask.dim() == 2:
        allowed = None
        if q_len > 1:
            q_pos = torch.arange(kv_len - q_len, kv_len, device=device)[:, None]
            allowed = (torch.arange(kv_len, device=device)[None, :] <= q_pos)[None, None]  # [1, 1, S, T]
        if attention_mask is not None:
            pad = attention_mask[:, None, None, -kv_len:].to(device=device, dtype=torch.bool)  # [B, 1, 1, T]
            allowed = pad if allowed is None else allowed & pad
        if allowed is None:
            return None
        return torch.zeros((), device=device, dtype=dtype).masked_fill(~allowed, neg)
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4:
        raise TypeError(
            f"absorbed MLA attention got an attention mask of type {type(attention_mask).__name__}; "
            "load the model with attn_implementation='sdpa' or 'eager'."
        )
    m = attention_mask[:, :, -q_len:, :kv_len].to(device)
    if m.dtype == torch.bool:
        return torch.zeros((), device=device, dtype=dtype).masked_fill(~m, neg)
    return m.to(dtype)


def absorbed_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    kv_nope: torch.Tensor,
    k_rot: torch.Tensor,
    scaling: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of every query head over the one shared latent head.

    q_latent [B, H, S, R], q_rope [B, H, S, Dr], kv_nope [B, 1, T, R], k_rot [B, 1, T, Dr],
    mask: additive [B|1, 1|H, S, T] or None. Returns the weighted latent o_latent [B, H, S, R].
    Softmax in float32, as transformers' eager attention.
    """
    b, h, s, r = q_latent.shape
    t = kv_nope.shape[2]
    kv = kv_nope[:, 0].to(q_latent.dtype)  # [B, T, R]
    kr = k_rot[:, 0].to(q_rope.dtype)  # [B, T, Dr]
    # a long prefill runs in blocks of queries, so the [B, H, block, T] scores stay bounded
    block = max(1, SCORE_ELEMENTS // max(1, b * h * t))
    if block < s:
        return torch.cat([
            absorbed_attention(q_latent[:, :, lo: lo + block], q_rope[:, :, lo: lo + block], kv_nope, k_rot, scaling,
                               None if mask is None else mask[:, :, lo: lo + block] if mask.shape[2] > 1 else mask)
            for lo in range(0, s, block)
        ], dim=2)
    # heads and queries share one key: one GEMM per batch row, M = H * S
    scores = torch.bmm(q_latent.reshape(b, h * s, r), kv.transpose(1, 2))  # [B, H*S, T]
    scores = scores.baddbmm_(q_rope.reshape(b, h * s, -1), kr.transpose(1, 2))
    scores = scores.view(b, h, s, t).float() * scaling
    if mask is not None:
        scores = scores + mask.float()
    probs = scores.softmax(-1)
    if mask is not None:
        # a query with every key masked (left padding): zero output instead of NaN
        probs = probs.masked_fill(scores.amax(-1, keepdim=True) == float("-inf"), 0.0)
    probs = probs.to(kv.dtype)
    return torch.bmm(probs.view(b, h * s, t), kv).view(b, h, s, r)


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_nope [B, H, S, Dn], W_UK [H, Dn, R] -> q_latent [B, H, S, R].

    One batched product over the heads, reading W_UK where it lies in kv_b_proj's weight (a strided view
    that cuBLAS takes as it is; einsum could copy it, 16 MB per DeepSeek-V3 layer and step)."""
    b, h, s, d = q_nope.shape
    q = q_nope.permute(1, 0, 2, 3).reshape(h, b * s, d)
    return torch.bmm(q, w_uk.to(q.dtype)).view(h, b, s, -1).permute(1, 0, 2, 3)


def expand_output(o_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o_latent [B, H, S, R], W_UV [H, Dv, R] -> per-head outputs [B, H, S, Dv] (one batched product over
    the heads, W_UV read transposed where it lies)."""
    b, h, s, r = o_latent.shape
    o = o_latent.permute(1, 0, 2, 3).reshape(h, b * s, r)
    return torch.bmm(o, w_uv.to(o.dtype).transpose(1, 2)).view(h, b, s, -1).permute(1, 0, 2, 3)


# -- per-architecture pieces --------------------------------------------------------------------------
def _rope_fn(attn: nn.Module) -> Callable:
    """(q_rot [B, H, S, Dr], k_rot [B, 1, S, Dr], position_embeddings) -> both rotated, as the stock forward."""
    mod = sys.modules[type(attn).__module__]
    if type(attn).__name__ == "DeepseekV2Attention":
        return lambda q, k, pe: mod.apply_rotary_emb(q, k, pe.to(q.device))
    if getattr(attn.config, "rope_interleave", False):
        return lambda q, k, pe: mod.apply_rotary_pos_emb_interleave(q, k, *pe)
    return lambda q, k, pe: mod.apply_rotary_pos_emb(q, k, *pe)


def _check_absorbable(attn: nn.Module) -> None:
    proj = attn.kv_b_proj
    if type(proj) is not nn.Linear or not proj.weight.dtype.is_floating_point or proj.bias is not None:
        raise TypeError(
            f"layer {attn.layer_idx}: absorbed MLA needs kv_b_proj to be a plain nn.Linear without bias and "
            f"with floating-point weights, got {type(proj).__name__} ({proj.weight.dtype}); "
            "dequantize kv_b_proj (e.g. load the model without weight quantization for attention) first."
        )


def _absorbed_forward(attn: nn.Module, original: Callable) -> Callable:
    """A forward for `attn` with the stock signature (both `cache` and `past_key_values` accepted)."""
    signature = inspect.signature(original)
    rope = _rope_fn(attn)

    def forward(self, *args, **kwargs):
        bound = signature.bind_partial(*args, **kwargs).arguments
        extra = dict(bound.pop("kwargs", {}))
        hidden_states = bound["hidden_states"]
        attention_mask = bound.get("attention_mask")
        position_embeddings = bound.get("position_embeddings")
        cache = bound.get("cache", bound.get("past_key_values", extra.pop("past_key_values", None)))
        extra.pop("cache", None)
        b, s, _ = hidden_states.shape

        if self.q_lora_rank is None:
            q = self.q_proj(hidden_states)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(b, s, -1, self.qk_head_dim).transpose(1, 2)  # [B, H, S, Dn + Dr]
        q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)

        kv_nope, k_rot = torch.split(
            self.kv_a_proj_with_mqa(hidden_states), [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1
        )
        kv_nope = self.kv_a_layernorm(kv_nope).view(b, 1, s, self.kv_lora_rank)  # [B, 1, S, R]
        k_rot = k_rot.view(b, 1, s, self.qk_rope_head_dim)  # [B, 1, S, Dr]
        q_rot, k_rot = rope(q_rot, k_rot, position_embeddings)

        deferred = sparse = None
        if cache is not None:
            kv_nope, k_rot = cache.update(kv_nope, k_rot, self.layer_idx)  # [B, 1, T, R], [B, 1, T, Dr]
            deferred = take_deferred(kv_nope)  # a fused decode step: kv_nope is only the new token
            sparse = take_pending(kv_nope)  # a layer with a sparsity policy (kvcompress.sparse)

        w_uk, w_uv = split_kv_b_proj(self.kv_b_proj.weight, self.num_heads, self.qk_nope_head_dim, self.v_head_dim)
        q_latent = absorb_query(q_nope, w_uk)
        kv_len = deferred.held_tokens if deferred is not None else kv_nope.shape[2]
        # a sparse layer reads the mask by position instead (kvcompress.sparse.step); a layer in a decode
        # graph masks itself from lengths on the device (kvcompress.kernels.mla_layer)
        static = deferred is not None and getattr(deferred, "static", None) is not None
        mask = None if sparse is not None or static else additive_mask(attention_mask, b, s, kv_len, q.device,
                                                                       torch.float32)
        if sparse is not None:  # what the policy keeps and selects (the policy sees the attention)
            query = torch.cat([q_latent, q_rot.to(q_latent.dtype)], -1)  # the width of its page summaries
            begin_sparse_step(sparse, query, kv_nope, attention_mask, self.scaling, deferred is not None)
            if deferred is not None:  # the fused path: Quest's selected body pages, or the mass H2O sums
                step = sparse.sparse.step
                pages = quest_page_list(sparse, step.index)[:, 0].contiguous() if step.index is not None else None
                o = mla_layer_decode(sparse, q_latent[:, :, 0], q_rot[:, :, 0], self.scaling,
                                     step.mask[:, 0, -1, :], pages=pages, return_mass=step.mass_queries > 0)
                o, mass = o if isinstance(o, tuple) else (o, None)
                o_latent = o[:, :, None]
            else:
                o_latent, mass = attend_mla_torch(q_latent, q_rot, sparse, self.scaling)
            finish_sparse_step(sparse, mass)
            o_latent = o_latent.to(q_latent.dtype)
        elif deferred is not None:  # the packed latent, read by the fused kernel where it lies
            allowed = None if static else decode_allowed(mask, b, kv_len)
            o = mla_layer_decode(deferred, q_latent[:, :, 0], q_rot[:, :, 0], self.scaling, allowed)
            o_latent = o.to(q_latent.dtype)[:, :, None]
        elif s == 1 and fused_active() and latent_dims_supported(kv_nope.shape[-1], k_rot.shape[-1]):
            # an exact latent (DynamicCache, lossless layers): the same kernel over it as it is
            latent = MlaLatent(kv=kv_nope[:, 0].contiguous(), k_rot=k_rot[:, 0].contiguous(), latent_dim=kv_nope.shape[-1])
            out, lse = mla_attend(q_latent[:, :, 0].contiguous(), q_rot[:, :, 0].contiguous(), latent, self.scaling,
                                  decode_allowed(mask, b, kv_len), "triton")
            o_latent = merge_partials(out, lse).to(q_latent.dtype)[:, :, None]
        else:
            o_latent = absorbed_attention(q_latent, q_rot, kv_nope, k_rot, self.scaling, mask)
        out = expand_output(o_latent, w_uv)  # [B, H, S, Dv]
        out = out.transpose(1, 2).reshape(b, s, -1).contiguous()
        return self.o_proj(out), None

    return forward


def patch_mla(model: nn.Module) -> Callable[[], None]:
    """Give every DeepSeek-V2/V3 attention instance of `model` the absorbed forward; return `undo`.

    Instance-level only: other models of the same class are untouched. `undo()` restores each
    module's previous instance attribute (or its absence) exactly; calling it twice is harmless.
    """
    patched: list[tuple[nn.Module, bool, object]] = []
    modules = [m for m in model.modules() if is_mla_attention(m)]
    for attn in modules:
        _check_absorbable(attn)
    for attn in modules:
        had_own = "forward" in attn.__dict__
        previous = attn.__dict__.get("forward")
        attn.forward = types.MethodType(_absorbed_forward(attn, attn.forward), attn)
        patched.append((attn, had_own, previous))

    def undo() -> None:
        while patched:
            attn, had_own, previous = patched.pop()
            if had_own:
                attn.forward = previous
            else:
                del attn.forward

    return undo
