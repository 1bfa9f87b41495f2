"""Fused MLA decode attention over the packed latent: every query head against one shared latent head.

One decode step of absorbed multi-head latent attention (DeepSeek-V2/V3; arXiv:2405.04434):

    scores[b, h, t] = (q_latent[b, h] . kv_nope[b, t] + q_rope[b, h] . k_rot[b, t]) * scaling
    o_latent[b, h]  = softmax_t(scores[b, h]) @ kv_nope[b]          [B, H, R]

The latent is read as the cache stores it: either dense (bf16/fp16/fp32) or packed NUQ codes
(4 bits, per-channel mean/scale frozen at the first page, a codebook, and per page a fixed number
of exact outliers), with k_rot dense or FP8 (E4M3, one fp16 scale per token). The Triton kernel
dequantizes each page in registers and never writes the dense latent; it splits the tokens over
programs (flash-decoding) and returns per-split partial outputs and log-sum-exps, merged by
`merge_partials`. Outliers are applied as exact corrections: the score gets q[c] * (x - x_dense)
and the output p[t] * (x - x_dense), both as small one-hot matmuls per page.

`mla_decode_torch` is the twin (and CPU path) of `mla_decode_triton`, with the same signature.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.quant.pack import unpack

LOG2E = 1.4426950408889634  # 1/ln(2): the kernels' softmax runs in base 2
SCORES_WITH_PAGES = ("scores are written over a whole latent; a page list reads part of it "
                     "(Quest needs no scores)")


@dataclass
class MlaLatent:
    """The cached latent of one layer, as stored (one shared head, so no head dim).

    kv: dense [B, T, R] latent, or packed NUQ codes [B, T, R * bits / 8] uint8 when `codebook` is set.
    codebook [L] float32, channel_mean / channel_scale [B, R] float32 (u * scale + mean).
    outlier_idx [B, T / P, K] int16|int32 (position t_in_page * R + c, ascending), outlier_val [B, T / P, K];
    outliers_per_token: when the outliers were chosen per token, their count per token (K = P * that,
    listed token by token: what the Triton kernel reads); 0 when chosen per page (the twin reads both).
    k_rot: dense [B, T, Dr], or FP8 E4M3 codes [B, T, Dr] uint8 with k_rot_scale [B, T] when given.
    """

    kv: torch.Tensor
    k_rot: torch.Tensor
    latent_dim: int
    page_size: int = 64
    codebook: torch.Tensor | None = None
    nbits: int = 4
    channel_mean: torch.Tensor | None = None
    channel_scale: torch.Tensor | None = None
    outlier_idx: torch.Tensor | None = None
    outlier_val: torch.Tensor | None = None
    k_rot_scale: torch.Tensor | None = None
    outliers_per_token: int = 0

    def __post_init__(self):
        b, t = self.kv.shape[:2]
        if self.k_rot.shape[:2] != (b, t):
            raise ValueError(f"kv {tuple(self.kv.shape)} and k_rot {tuple(self.k_rot.shape)} disagree on [B, T]")
        if self.is_packed:
            if self.nbits != 4:
                raise ValueError(f"the MLA kernels read 4-bit NUQ codes, got {self.nbits} bits")
            if self.channel_mean is None or self.channel_scale is None:
                raise ValueError("packed latent needs channel_mean and channel_scale [B, R] (nuq axis='channel')")
            if t % self.page_size:
                raise ValueError(f"packed latent holds whole pages of {self.page_size}, got {t} tokens")
        if (self.outlier_idx is None) != (self.outlier_val is None):
            raise ValueError("outlier_idx and outlier_val come together")
        if self.outliers_per_token and self.num_outliers != self.outliers_per_token * self.page_size:
            raise ValueError(f"{self.num_outliers} outliers per page is not {self.outliers_per_token} per token "
                             f"x {self.page_size} tokens")

    @property
    def is_packed(self) -> bool:
        return self.codebook is not None

    @property
    def num_tokens(self) -> int:
        return self.kv.shape[1]

    @property
    def num_outliers(self) -> int:
        return 0 if self.outlier_idx is None else self.outlier_idx.shape[-1]

    @classmethod
    def from_stores(cls, key_store, value_store, dtype: torch.dtype = torch.bfloat16, reserved: bool = False) -> "MlaLatent":
        """The body of a CompressedLayer holding an MLA latent: key store = NUQ channel-axis kv_nope
        (or identity), value store = FP8 or identity k_rot. Store fields are [B, 1, ...]. Streams the
        kernel does not read packed are decoded to `dtype` (an identity stream is only cast).
        reserved: the stores' whole reserved buffers (a decode graph; the filled length is on the device)."""
        kc, vc = key_store.codec, value_store.codec
        kd, vd = (key_store.buffers, value_store.buffers) if reserved else (key_store.data, value_store.data)
        fields = dict(latent_dim=kc.head_dim, page_size=kc.page_size)
        if "scale" in vd and getattr(vc, "fmt", None) == "e4m3" and getattr(vc, "channel_shift", None) is None:
            fields.update(k_rot=vd["codes"][:, 0], k_rot_scale=vd["scale"][:, 0, :, 0])
        else:
            fields.update(k_rot=vc.decode(vd, value_store.row, dtype)[:, 0])
        if hasattr(kc, "codebook"):
            if kc.axis != "channel" or kc.rotation_signs is not None or kc.codebook.dim() != 1:
                raise ValueError("the MLA kernels read NUQ latents with axis='channel', one codebook, no rotation")
            mean, scale = kc._channel_stats(key_store.row, kd["codes"].device)
            b = kd["codes"].shape[0]
            fields.update(
                kv=kd["codes"][:, 0], codebook=kc.codebook, nbits=kc.nbits,
                channel_mean=mean.reshape(-1, kc.head_dim).expand(b, -1).contiguous(),
                channel_scale=scale.reshape(-1, kc.head_dim).expand(b, -1).contiguous(),
            )
            if "outlier_idx" in kd:
                fields.update(outlier_idx=kd["outlier_idx"][:, 0], outlier_val=kd["outlier_val"][:, 0],
                              outliers_per_token=kc.outliers_per_token)
        else:
            fields.update(kv=kc.decode(kd, key_store.row, dtype)[:, 0])
        return cls(**fields)


# -- torch twin -------------------------------------------------------------------------------------
def dequantize_latent(latent: MlaLatent, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """MlaLatent -> dense kv_nope [B, T, R] and k_rot [B, T, Dr] in `dtype`."""
    if latent.is_packed:
        codes = unpack(latent.kv, latent.nbits, latent.latent_dim).long()  # [B, T, R]
        kv = latent.codebook.to(codes.device)[codes] * latent.channel_scale[:, None] + latent.channel_mean[:, None]
        if latent.num_outliers:
            b, t, r = kv.shape
            pages = kv.reshape(b, t // latent.page_size, latent.page_size * r)
            pages = pages.scatter(-1, latent.outlier_idx.long(), latent.outlier_val.float())
            kv = pages.reshape(b, t, r)
    else:
        kv = latent.kv
    k_rot = latent.k_rot
    if latent.k_rot_scale is not None:
        k_rot = k_rot.view(torch.float8_e4m3fn).float() * latent.k_rot_scale.float()[..., None]
    return kv.to(dtype), k_rot.to(dtype)


def mla_decode_torch(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: MlaLatent,
    scaling: float,
    num_splits: int = 1,
    allowed: torch.Tensor | None = None,
    pages: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q_latent [B, H, R], q_rope [B, H, Dr] -> partial outputs [B, H, S, R] float32 and lse [B, H, S].

    Split s covers the pages [s * n, (s+1) * n) with n = ceil(pages / S); each partial output is
    normalised within its split and `lse` is that split's log-sum-exp (-inf, output 0, when it is empty
    or every token in it is masked). allowed [B, T] bool (or uint8, nonzero = attend), None = all.
    pages [B, n] int: read only these pages of `page_size` tokens (Quest's selection; -1 reads nothing),
    the splits then dividing the list.
    scores [B, H, T] float32 (no page list): filled with every token's scaled logit in base 2 (times
    log2(e); -inf where masked), from which `token_mass` sums the attention per token (H2O).
    """
    if scores is not None and pages is not None:
        raise ValueError(SCORES_WITH_PAGES)
    kv, k_rot = dequantize_latent(latent, q_latent.dtype)
    if pages is not None:  # the listed pages, in list order: the splits divide the list as the kernel's do
        p = latent.page_size
        tok = (pages.long().clamp_min(0)[..., None] * p + torch.arange(p, device=pages.device)).flatten(1)
        keep = ((pages >= 0)[..., None].expand(-1, -1, p).flatten(1)) & (tok < latent.num_tokens)
        tok = tok.clamp_max(latent.num_tokens - 1)
        if allowed is not None:
            keep &= allowed.bool().gather(1, tok)
        kv = kv.gather(1, tok[..., None].expand(-1, -1, kv.shape[-1]))
        k_rot = k_rot.gather(1, tok[..., None].expand(-1, -1, k_rot.shape[-1]))
        allowed = keep
    # the kernel multiplies the tile as q_latent's dtype holds it
    logits = torch.einsum("bhr,btr->bht", q_latent.float(), kv.float())
    logits += torch.einsum("bhd,btd->bht", q_rope.float(), k_rot.float())
    logits *= scaling
    if allowed is not None:
        logits = logits.masked_fill(~allowed.bool()[:, None, :], float("-inf"))
    if scores is not None:
        scores.copy_(logits * LOG2E)
    bounds = _split_bounds(kv.shape[1], latent.page_size, num_splits)
    outs, lses = [], []
    for lo, hi in bounds:
        if hi <= lo:
            outs.append(q_latent.new_zeros(*q_latent.shape, dtype=torch.float32))
            lses.append(q_latent.new_full(q_latent.shape[:2], float("-inf"), dtype=torch.float32))
            continue
        s = logits[..., lo:hi]
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.clamp_min(torch.finfo(torch.float32).min)[..., None])  # all masked: p = 0
        outs.append(torch.einsum("bht,btr->bhr", p.to(kv.dtype).float(), kv[:, lo:hi].float()))
        lses.append(lse)
    return torch.stack(outs, 2), torch.stack(lses, 2)


def _split_bounds(num_tokens: int, block: int, num_splits: int) -> list[tuple[int, int]]:
    blocks = -(-num_tokens // block)
    per = -(-blocks // num_splits)
    return [(min(s * per * block, num_tokens), min((s + 1) * per * block, num_tokens)) for s in range(num_splits)]


def token_mass(scores: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Attention per token summed over the heads, [B, T], from the base-2 logits [B, H, T] the kernels write
    (`scores`) and the log-sum-exps [B, H, S] of every partial over the same query (all the tokens scored)."""
    total = torch.logsumexp(lse, dim=-1)  # [B, H]
    total = torch.where(torch.isfinite(total), total, torch.zeros_like(total))  # a head with nothing: mass 0
    return torch.exp2(scores - (total * LOG2E)[..., None]).sum(1)


def merge_partials(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """Partial outputs [B, H, S, R] with their log-sum-exps [B, H, S] -> the full output [B, H, R]."""
    w = torch.softmax(lse, dim=-1)  # empty splits (-inf) get weight 0
    return torch.einsum("bhs,bhsr->bhr", w, out)  # one batched product, no [B, H, S, R] temporary


# -- Triton (kvcompress.kernels.mla_decode_triton, imported on first use) ---------------------------
def mla_decode_triton(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    latent: MlaLatent,
    scaling: float,
    num_splits: int = 1,
    allowed: torch.Tensor | None = None,
    pages: torch.Tensor | None = None,
    scores: torch.Tensor | None = None,
    **launch,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `mla_decode_torch` (a page list for packed latents only); `launch`: block_h,
    num_warps, num_stages, and `lengths` [B] int32 on the device (tokens of each row's latent a decode
    graph has filled: no tile past it is read)."""
    from kvcompress.kernels.backend import triton_available

    if not triton_available():
        raise ImportError("the fused MLA decode kernel needs Triton: pip install triton")
    from kvcompress.kernels import mla_decode_triton as impl

    return impl.mla_decode_triton(q_latent, q_rope, latent, scaling, num_splits, allowed, pages=pages,
                                  scores=scores, **launch)


def mla_decode(q_latent, q_rope, latent: MlaLatent, scaling: float, num_splits: int = 1, **launch) -> torch.Tensor:
    """Weighted latent o_latent [B, H, R] (float32): Triton on CUDA, the torch twin elsewhere."""
    from kvcompress.kernels.backend import select_backend

    if select_backend(q_latent.device) == "triton":
        out, lse = mla_decode_triton(q_latent, q_rope, latent, scaling, num_splits, **launch)
    else:
        out, lse = mla_decode_torch(q_latent, q_rope, latent, scaling, num_splits)
    return merge_partials(out, lse)


def default_num_splits(batch: int, heads: int, num_tokens: int, block_h: int = 16, sms: int = 132, tile: int = 64) -> int:
    """Splits along the sequence so that the programs fill one wave of `sms` multiprocessors (the MLA kernels
    hold one program per multiprocessor) without starting a second, partial one: at DeepSeek-V3 sizes 8
    splits (128 programs) ran 10-22 % faster than 17 (272 programs, three waves; BENCHMARKS.md, issue 8).
    At least 4 tiles of `tile` tokens per split."""
    programs = batch * math.ceil(heads / block_h)
    return max(1, min(sms // programs, num_tokens // (4 * tile)))
