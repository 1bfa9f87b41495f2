"""A layer's sensitivity to H2O eviction: how much its attention output changes when it keeps a ratio of the
tokens, measured by running the calibration probe through the cache as decoding would.

The probe's first half is prefilled into a CompressedLayer with the policy under test (the mixed layers'
page layout, H2O keeping `ratio` of the tokens seen) and the second half decoded one token at a time
through the kvcompress attention, so the layer evicts exactly as a cache would; the loss is the relative
squared error of the decoded queries' outputs against exact causal attention,
||out^ - out||^2 / ||out||^2, the measure `sensitivity.py` uses for quantization. The eviction's own share
is what the same run loses beyond the quantization alone (evicting whole quantized pages, as the cache
does), so the allocation can add it to the streams' losses.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import torch

from kvcompress.cache import CompressedLayer
from kvcompress.calib.collect import LayerStats
from kvcompress.calib.sensitivity import causal_attention, output_loss
from kvcompress.config import LayerPolicy, SparsitySpec
from kvcompress.sparse.state import attach_layer_sparsity

SPARSE_PAGE = 16  # H2O's eviction chunk in full-precision layers (the sparse presets' pages)


def h2o_spec(ratio: float, sinks: int) -> SparsitySpec:
    """The H2O the mixed allocation gives a layer keeping `ratio` of its tokens."""
    return SparsitySpec(method="h2o", ratio=ratio, page_size=SPARSE_PAGE, sinks=sinks)


def decoded_outputs(policy: LayerPolicy, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float
                    ) -> torch.Tensor:
    """q [1, Hq, T, D], k / v [1, H, T, D] -> the outputs [1, Hq, T - T // 2, Dv] of the decoded half when
    the first T // 2 tokens are prefilled into a layer with `policy` and the rest decoded one by one."""
    from kvcompress.integration import kvcompress_attention

    layer = CompressedLayer(policy)
    attach_layer_sparsity(layer)
    module = SimpleNamespace(scaling=scaling, _kvcompress_backend=None)
    t, prefill = q.shape[2], q.shape[2] // 2
    outs = []
    with torch.inference_mode():
        ko, vo = layer.update(k[:, :, :prefill], v[:, :, :prefill])
        _attend(kvcompress_attention, module, q[:, :, :prefill], ko, vo, scaling, layer)
        for i in range(prefill, t):
            ko, vo = layer.update(k[:, :, i:i + 1], v[:, :, i:i + 1])
            outs.append(_attend(kvcompress_attention, module, q[:, :, i:i + 1], ko, vo, scaling, layer))
    return torch.cat(outs, 2)


def _attend(fn, module, q, ko, vo, scaling, layer) -> torch.Tensor:
    """The output [1, Hq, q, Dv] of one step: through the kvcompress attention where the layer evicts
    (it scores and compacts there), plain attention over what the layer returned otherwise."""
    if layer.sparse is not None:
        out, _ = fn(module, q, ko, vo, None, scaling=scaling)  # [B, q, Hq, Dv]
        return out.transpose(1, 2).float()
    # the prefill (q and K/V aligned) or one decoded query, which sees every held token (a 1 x 1 mask)
    return causal_attention(q, ko.float(), vo.float(), scaling)


def eviction_sensitivity(policy: LayerPolicy, stats: LayerStats, ratios) -> dict[float, float]:
    """{ratio: the decoded half's loss with H2O keeping `ratio`, less its loss without eviction} for a
    layer stored as `policy`, on the probe of `stats` (ratios >= 1 cost nothing)."""
    q, k, v, scaling = stats.probe_q, stats.probe_k, stats.probe_v, stats.scaling
    t = q.shape[2]
    exact = causal_attention(q, k.float(), v.float(), scaling)[:, :, t // 2:]

    def loss(got, want):  # the decoded half: positions t // 2 on
        return output_loss(stats, got, want, t // 2)

    base = loss(decoded_outputs(replace(policy, sparsity=SparsitySpec()), q, k, v, scaling), exact)
    out = {}
    for r in ratios:
        if r >= 1.0:
            out[r] = 0.0
            continue
        sparse = replace(policy, sparsity=h2o_spec(r, policy.sinks))
        out[r] = max(0.0, loss(decoded_outputs(sparse, q, k, v, scaling), exact) - base)
    return out
