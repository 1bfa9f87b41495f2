"""One absorbed MLA decode step over a `CompressedLayer`'s parts, without decoding its cache.

A compressed MLA layer holds the latent as sinks | packed body | tail (kvcompress.cache). On a decode
step of a model under `kvcompress.enable` with the fused backend, `update()` defers (returns only the
new token) and the absorbed attention calls `mla_layer_decode`:

    body (packed pages)  -> the fused MLA kernel (Triton; the torch twin on the torch backend)
    sinks + tail (exact) -> the dense-latent kernel, one split (a few dozen tokens; the twin on torch)
    -> partial outputs merged by their log-sum-exps

so each step reads the packed latent once and never materialises it densely. `decode_allowed` turns the
mask the attention receives into the [B, T] keep-mask the kernels read (any padding, not only left).
For H2O (`return_mass`) both kernels also write every token's logit for every head ([B, H, T] float32:
512 bytes per token at 128 heads, against about 340 bytes per token of nuq4 latent and FP8 RoPE key read,
so the attention mass costs more traffic than the attention), and `token_mass` sums them with the merged
log-sum-exps into the attention each token got, without a second pass over the latent.
"""

from __future__ import annotations

import functools

import torch

from kvcompress.kernels.mla_decode import (
    MlaLatent,
    default_num_splits,
    merge_partials,
    mla_decode_torch,
    mla_decode_triton,
    token_mass,
)


def _pow2(n: int) -> bool:
    return n >= 16 and n & (n - 1) == 0


def latent_dims_supported(latent_dim: int, rope_dim: int) -> bool:
    """The kernel tiles the latent and the RoPE key whole: both powers of two, at least 16."""
    return _pow2(latent_dim) and _pow2(rope_dim)


def mla_fused_supported(layer) -> bool:
    """Whether `mla_layer_decode` can read this compressed MLA layer's body as stored: the latent as
    4-bit channel NUQ (one codebook, no rotation, outliers if any chosen per token) or exact, k_rot as
    dynamic E4M3 or exact. Sparsity: Quest over the packed latent with the body's pages (the kernel reads
    its page list); the evicting policies (H2O, StreamingLLM, SnapKV) over any of these, the kernels writing
    the scores H2O sums into attention mass per token."""
    from kvcompress.quant.fp8 import Fp8Codec
    from kvcompress.quant.identity import IdentityCodec
    from kvcompress.quant.nuq import NuqCodec

    kc, vc = layer.key_store.codec, layer.value_store.codec
    sparse = getattr(layer, "sparse", None)
    if sparse is not None and sparse.policy.keeps_page_summaries:  # Quest: its pages must be the body's pages
        if not isinstance(kc, NuqCodec):
            return False
        if sparse.policy.page_size != kc.page_size or layer.sink_k.shape[2] % kc.page_size:
            return False
    if isinstance(kc, NuqCodec):
        if kc.axis != "channel" or kc.nbits != 4 or kc.rotation_signs is not None or kc.codebook.dim() != 1:
            return False
        if kc.n_outliers and not kc.outliers_per_token:
            return False
    elif not isinstance(kc, IdentityCodec):
        return False
    if isinstance(vc, Fp8Codec):
        if vc.fmt != "e4m3" or vc.static_scale is not None or vc.channel_shift is not None:
            return False
    elif not isinstance(vc, IdentityCodec):
        return False
    return latent_dims_supported(layer.tail_k.shape[-1], layer.tail_v.shape[-1]) and _pow2(kc.page_size)


def decode_allowed(additive: torch.Tensor | None, batch: int, kv_len: int) -> torch.Tensor | None:
    """The additive mask [B|1, 1, 1, T] of a decode step (kvcompress.layout.mla_attention.additive_mask)
    -> keep-mask [B, T] bool, or None when nothing is masked."""
    if additive is None:
        return None
    row = additive[:, 0, -1, -kv_len:]
    return (row > torch.finfo(row.dtype).min / 2).expand(batch, kv_len).contiguous()


# Kernel launch per latent kind, the fastest in `benchmarks/mla_decode.py --sweep-only` on the H200 at
# DeepSeek-V3 sizes, 32K x 8 (BENCHMARKS.md, issue 8): 64 heads per program read the latent half as often as
# 32 and fill the 64-row tensor-core tile; a second pipeline stage speeds up the dense latent (its tiles load
# straight into shared memory), while the packed latent keeps one (its tiles are built in registers). With
# outliers, 128 heads per program (16 warps) build and patch each tile once instead of twice: 1.45 ms
# against 1.90 ms at 64 heads; without outliers 128 heads lose (0.92 ms against 0.55 ms).
LAUNCH = {
    "packed": {"block_h": 64, "num_warps": 8, "num_stages": 1},
    "packed_outliers": {"block_h": 128, "num_warps": 16, "num_stages": 1},
    "dense": {"block_h": 64, "num_warps": 8, "num_stages": 2},
}


@functools.lru_cache(maxsize=None)
def _sm_count(device: torch.device) -> int:
    """Multiprocessors of `device` (asked once per device: `launch_for` runs at every decode step)."""
    if device.type != "cuda":
        return 132
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_for(latent: MlaLatent, heads: int, batch: int, device: torch.device, tokens: int | None = None) -> dict:
    """The kernel launch for `latent` (LAUNCH by kind) with its split count for `tokens` read (default:
    all of them); fewer heads per program (and warps in proportion) when the model has fewer heads than a
    block."""
    kind = "dense" if not latent.is_packed else "packed_outliers" if latent.num_outliers else "packed"
    launch = dict(LAUNCH[kind])
    block_h = max(16, min(launch["block_h"], 1 << max(heads - 1, 1).bit_length()))
    launch["num_warps"] = max(4, launch["num_warps"] * block_h // launch["block_h"])
    launch["block_h"] = block_h
    tokens = latent.num_tokens if tokens is None else tokens
    launch["num_splits"] = default_num_splits(batch, heads, tokens, block_h, _sm_count(device), latent.page_size)
    return launch


def mla_attend(q_latent, q_rope, latent: MlaLatent, scaling: float, allowed, backend: str, launch=None,
               pages=None, scores=None):
    """Partial outputs [B, H, S, R] and lse [B, H, S] of the fused kernel (or its twin) over `latent`, or over
    its listed pages [B, n] only; scores [B, H, T]: filled with the logits (`mla_decode_torch`)."""
    b, h, _ = q_latent.shape
    if backend == "triton":
        tokens = pages.shape[1] * latent.page_size if pages is not None else None
        launch = dict(launch or launch_for(latent, h, b, q_latent.device, tokens))
        splits = launch.pop("num_splits")
        if scores is not None:  # storing the score tile takes the shared memory of a second pipeline stage,
            # or of a 128-head block (H200: 245,760 bytes asked of 232,448 with outliers, pages of 64)
            block_h = min(launch["block_h"], 64)
            launch.update(num_stages=1, num_warps=max(4, launch["num_warps"] * block_h // launch["block_h"]),
                          block_h=block_h)
        return mla_decode_triton(q_latent, q_rope, latent, scaling, splits, allowed, pages=pages,
                                 scores=scores, **launch)
    return mla_decode_torch(q_latent, q_rope, latent, scaling, 1, allowed, pages, scores)


def mla_layer_decode(
    layer,
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    scaling: float,
    allowed: torch.Tensor | None,
    backend: str = "triton",
    pages: torch.Tensor | None = None,
    return_mass: bool = False,
):
    """q_latent [B, H, R], q_rope [B, H, Dr] over a deferred layer (new token already in its tail),
    allowed [B, held] bool or None, pages [B, n]: the body pages to read (Quest; None: all) -> o_latent
    [B, H, R] float32; with return_mass, (o_latent, mass [B, 1, held]): the attention each held token got,
    summed over the heads (H2O), from the logits the kernels wrote in the same pass."""
    static = getattr(layer, "static", None)
    if static is not None:
        return _static_decode(layer, static, q_latent, q_rope, scaling)
    b, h, _ = q_latent.shape
    n_sink, n_body = layer.sink_k.shape[2], layer.key_store.n_tokens
    n_exact = n_sink + layer.tail_k.shape[2]
    # the kernels (and the twin) write every token's score when there is no page list: nothing to fill first
    scores = [q_latent.new_empty((b, h, n), dtype=torch.float32) if return_mass else None for n in (n_body, n_exact)]
    outs, lses = [], []
    if n_body:
        body = MlaLatent.from_stores(layer.key_store, layer.value_store, q_latent.dtype)
        keep = allowed[:, n_sink: n_sink + n_body].contiguous() if allowed is not None else None
        out, lse = mla_attend(q_latent, q_rope, body, scaling, keep, backend, pages=pages, scores=scores[0])
        outs.append(out)
        lses.append(lse)
    keep = None
    if allowed is not None:
        keep = torch.cat([allowed[:, :n_sink], allowed[:, n_sink + n_body:]], 1)
    out, lse = _attend_exact(layer, layer.tail_k, layer.tail_v, q_latent, q_rope, scaling, keep, backend,
                             scores[1])
    outs.append(out)
    lses.append(lse)
    lse = torch.cat(lses, 2)
    o_latent = merge_partials(torch.cat(outs, 2), lse)
    if not return_mass:
        return o_latent
    body_scores, exact = scores
    held = torch.cat([exact[..., :n_sink], body_scores, exact[..., n_sink:]], -1)  # sinks | body | tail
    return o_latent, token_mass(held, lse)[:, None]


def _attend_exact(layer, tail_k, tail_v, q_latent, q_rope, scaling: float, keep, backend: str, scores=None):
    """The exact sinks and tail [B, 1, n, R] / [B, 1, n, Dr]: a few dozen tokens, one program per head block
    and no split on the Triton backend, the twin on torch -> partial output [B, H, 1, R], lse [B, H, 1]."""
    exact = MlaLatent(
        kv=torch.cat([layer.sink_k, tail_k], 2)[:, 0].to(q_latent.dtype),
        k_rot=torch.cat([layer.sink_v, tail_v], 2)[:, 0].to(q_rope.dtype),
        latent_dim=q_latent.shape[-1],
    )
    if backend != "triton":
        return mla_decode_torch(q_latent, q_rope, exact, scaling, 1, keep, scores=scores)
    launch = dict(launch_for(exact, q_latent.shape[1], q_latent.shape[0], q_latent.device), num_splits=1)
    return mla_attend(q_latent, q_rope, exact, scaling, keep, backend, launch, scores=scores)


def _static_decode(layer, static, q_latent, q_rope, scaling: float) -> torch.Tensor:
    """A decode-graph step (kvcompress.graph.StaticLayer): the body in its reserved buffers, read up to each
    row's filled length on the device, and the sinks with the whole fixed tail buffer, masked by the tail's
    length on the device. Nothing is read on the host, so the step can be captured and replayed; the masks
    also carry the left padding (the row starts the decode graph read once)."""
    from kvcompress.kernels.attention_backend import current_row_starts

    b, h, _ = q_latent.shape
    dev, n_sink = q_latent.device, layer.sink_k.shape[2]
    body = MlaLatent.from_stores(layer.key_store, layer.value_store, q_latent.dtype, reserved=True)
    cap, slots = body.num_tokens, static.tail_k.shape[2]
    body_idx, tail_idx = torch.arange(cap, device=dev), torch.arange(slots, device=dev)
    keep_body = body_idx[None] < static.body_len[:, None]  # [B, cap]
    keep_tail = (tail_idx < static.tail_n).expand(b, slots)  # [B, R + P]
    keep_sink = torch.ones(b, n_sink, dtype=torch.bool, device=dev)
    starts = current_row_starts()
    if starts is not None:
        first = starts.to(dev, torch.long)[:, None]
        keep_sink = keep_sink & (torch.arange(n_sink, device=dev)[None] >= first)
        keep_body = keep_body & (body_idx[None] + n_sink >= first)
        keep_tail = keep_tail & (n_sink + static.body_len[:, None].long() + tail_idx[None] >= first)
    launch = launch_for(body, h, b, dev)  # splits over the whole reservation (those past the length read nothing)
    splits = launch.pop("num_splits")
    out_b, lse_b = mla_decode_triton(q_latent, q_rope, body, scaling, splits, keep_body, lengths=static.body_len,
                                     **launch)
    out_e, lse_e = _attend_exact(layer, static.tail_k, static.tail_v, q_latent, q_rope, scaling,
                                 torch.cat([keep_sink, keep_tail], 1), "triton")
    return merge_partials(torch.cat([out_b, out_e], 2), torch.cat([lse_b, lse_e], 2))
