"""Each layer's sensitivity: how much the model's output moves when only that layer's keys (or only its
values) are stored with a candidate quantizer.

The probe (queries, keys and values of the first calibration window) is pushed through a
CompressedLayer exactly as the cache would store it, and each query of the probe's second half (the
decoded half of `kvcompress eval`) attends as it would while decoding (decode_attention): the sinks and
the tail the cache held at its step exact, older tokens as stored. Masking matters: with every older
token read as stored, the per-layer losses did not rank SmolLM2's end-to-end KL (Spearman 0.09 over 60
layer-streams); decode-masked they do (0.80, and 0.91 Fisher-weighted; `benchmarks/layer_sensitivity.py`,
BENCHMARKS.md "Layer sensitivities in the model's unit").

The loss is the Fisher-weighted squared error of the attention output, 1/2 sum F (out^ - out)^2 per
scored position (calib/fisher.py): the expected KL divergence it adds to the next-token distribution, in
nats, so losses of different layers add. Without a Fisher (not measured) it is the relative squared error
||out^ - out||^2 / ||out||^2 of the scored positions; where no queries match the cache (MLA latents), the
relative squared error of the stream itself.
"""

from __future__ import annotations

import torch

from kvcompress.cache import CompressedLayer
from kvcompress.calib.candidates import MIXED_PAGE_SIZE, MIXED_RESIDUAL, MIXED_SINKS, LayerFits
from kvcompress.calib.collect import LayerStats
from kvcompress.config import LayerPolicy, QuantSpec


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
    """q [B, Hq, T, D], k [B, H, T, D], v [B, H, T, Dv] -> [B, Hq, T, Dv] (GQA: Hq a multiple of H)."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling
    t = q.shape[2]
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    return torch.matmul(logits.masked_fill(~causal, float("-inf")).softmax(-1), v)


def stored(policy: LayerPolicy, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V [1, H, T, D] as a CompressedLayer with `policy` holds them after one prefill."""
    layer = CompressedLayer(policy)
    layer.update(k, v)
    return layer.dense()


def relative_error(approx: torch.Tensor, exact: torch.Tensor) -> float:
    return float((approx - exact).pow(2).sum() / exact.pow(2).sum().clamp_min(1e-30))


def stored_from(policy: LayerPolicy, n: torch.Tensor) -> torch.Tensor:
    """n [...] tokens held (a query's position + 1) -> the first token index past the encoded pages: the
    cache keeps tokens < sinks and >= this exact (the tail: the partly filled page and the residual window;
    CompressedLayer._flush encodes whole pages once the tail holds residual + page_size tokens)."""
    body = (n - policy.sinks - policy.residual).clamp_min(0) // policy.page_size * policy.page_size
    return policy.sinks + body


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_hat: torch.Tensor,
                     v_hat: torch.Tensor, scaling: float, policy: LayerPolicy) -> torch.Tensor:
    """Causal attention in which query i reads what a cache with `policy` returns at its decode step: key /
    value j as stored (k_hat, v_hat) where sinks <= j < stored_from(i + 1), exact otherwise.
    q [B, Hq, T, D], k / k_hat [B, H, T, D], v / v_hat [B, H, T, Dv] -> [B, Hq, T, Dv]."""
    group = q.shape[1] // k.shape[1]
    k, v, k_hat, v_hat = (x.repeat_interleave(group, 1) for x in (k, v, k_hat, v_hat))
    t = q.shape[2]
    i = torch.arange(t, device=q.device)[:, None]
    j = torch.arange(t, device=q.device)[None, :]
    lossy = (j >= policy.sinks) & (j < stored_from(policy, i + 1))
    logits = torch.where(lossy, q @ k_hat.transpose(-1, -2), q @ k.transpose(-1, -2)) * scaling
    p = logits.masked_fill(j > i, float("-inf")).softmax(-1)
    return (p * ~lossy) @ v + (p * lossy) @ v_hat


def scored(t: int) -> int:
    """The first probe position whose output counts: the second half, as `kvcompress eval` decodes it."""
    return t // 2


def output_loss(stats: LayerStats, approx: torch.Tensor, exact: torch.Tensor, start: int) -> float:
    """The loss of attention outputs approx / exact [1, Hq, n, Dv] of probe positions start .. start + n:
    1/2 sum F (approx - exact)^2 per position with the probe's Fisher, else their relative squared error."""
    if stats.probe_fisher is None:
        return relative_error(approx, exact)
    f = stats.probe_fisher[:, :, start:start + approx.shape[2]].to(approx.device)
    return float(0.5 * (f * (approx.float() - exact.float()).pow(2)).sum() / approx.shape[2])


def stream_sensitivity(fits: LayerFits, stream: str, choice: str) -> float:
    """Loss of the layer with only `stream` ("key" / "value") stored as `choice` (the other exact)."""
    spec, tensors = fits.choice(choice, stream)
    return spec_sensitivity(fits, stream, spec, tensors)


def spec_sensitivity(fits: LayerFits, stream: str, spec: QuantSpec, tensors: dict,
                     like: LayerPolicy | None = None) -> float:
    """Loss of the layer with only `stream` stored as `spec` with its calibrated `tensors` ("value.codebook",
    ...), the other stream exact, in the page layout of `like` (default: the mixed configs' layout)."""
    s = fits.stats
    exact = QuantSpec()
    policy = LayerPolicy(
        key=spec if stream == "key" else exact,
        value=spec if stream == "value" else exact,
        page_size=like.page_size if like is not None else MIXED_PAGE_SIZE,
        sinks=like.sinks if like is not None else MIXED_SINKS,
        residual=like.residual if like is not None else MIXED_RESIDUAL,
        tensors=tensors,
    )
    k_hat, v_hat = stored(policy, s.probe_k, s.probe_v)
    if s.probe_q is None:
        return relative_error(k_hat, s.probe_k) if stream == "key" else relative_error(v_hat, s.probe_v)
    start = scored(s.probe_q.shape[2])
    ref = causal_attention(s.probe_q, s.probe_k, s.probe_v, s.scaling)[:, :, start:]
    got = decode_attention(s.probe_q, s.probe_k, s.probe_v, k_hat.float(), v_hat.float(), s.scaling, policy)
    return output_loss(s, got[:, :, start:], ref, start)


def layer_sensitivity(fits: LayerFits, key_choices, value_choices) -> dict[str, dict[str, float]]:
    """{"key": {choice: loss}, "value": {choice: loss}} for one layer."""
    return {stream: {c: stream_sensitivity(fits, stream, c) for c in choices}
            for stream, choices in (("key", key_choices), ("value", value_choices))}
