"""Each layer's sensitivity: how much its attention output changes when only that layer's keys (or only
its values) are stored with a candidate quantizer.

The probe (queries, keys and values of the first calibration window) is pushed through a
CompressedLayer exactly as the cache would store it (sinks exact, whole pages encoded, the tail exact);
the loss is the relative squared error of the causal attention output,
||attn(q, K^, V^) - attn(q, K, V)||^2 / ||attn(q, K, V)||^2. Where no queries match the cache (MLA
latents) it falls back to the relative squared error of the stream itself.
"""

from __future__ import annotations

import torch

from kvcompress.cache import CompressedLayer
from kvcompress.calib.candidates import MIXED_PAGE_SIZE, MIXED_SINKS, LayerFits
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


def stream_sensitivity(fits: LayerFits, stream: str, choice: str) -> float:
    """Loss of the layer with only `stream` ("key" / "value") stored as `choice` (the other exact)."""
    spec, tensors = fits.choice(choice, stream)
    return spec_sensitivity(fits, stream, spec, tensors)


def spec_sensitivity(fits: LayerFits, stream: str, spec: QuantSpec, tensors: dict) -> float:
    """Loss of the layer with only `stream` stored as `spec` with its calibrated `tensors` ("value.codebook",
    ...), the other stream exact."""
    s = fits.stats
    exact = QuantSpec()
    policy = LayerPolicy(
        key=spec if stream == "key" else exact,
        value=spec if stream == "value" else exact,
        page_size=MIXED_PAGE_SIZE,
        sinks=MIXED_SINKS,
        tensors=tensors,
    )
    k_hat, v_hat = stored(policy, s.probe_k, s.probe_v)
    if s.probe_q is None:
        return relative_error(k_hat, s.probe_k) if stream == "key" else relative_error(v_hat, s.probe_v)
    ref = causal_attention(s.probe_q, s.probe_k, s.probe_v, s.scaling)
    return relative_error(causal_attention(s.probe_q, k_hat.float(), v_hat.float(), s.scaling), ref)


def layer_sensitivity(fits: LayerFits, choices) -> dict[str, dict[str, float]]:
    """{"key": {choice: loss}, "value": {choice: loss}} for one layer."""
    return {stream: {c: stream_sensitivity(fits, stream, c) for c in choices} for stream in ("key", "value")}
