"""How much each element of each layer's attention output matters to the model's next-token distribution:
the diagonal of the Fisher information of the attention outputs, from one backward pass over the probe.

Why: the mixed allocation adds the losses of 30 layers' streams, so a loss must be in the unit the model
pays, not relative to the layer's own output. A small error d in a layer's attention output moves the
next-token distributions by KL ~ 1/2 d^T F d, and for errors independent across elements (quantization
noise) only the diagonal counts in expectation: E[KL] ~ 1/2 sum_j F_jj E[d_j^2]. On SmolLM2 (float32,
nuq3 in one layer's keys or values at a time, 60 cases, `benchmarks/layer_sensitivity.py`) the relative
error of the layer's attention output ranks the end-to-end KL with Spearman 0.80 (decode-masked,
sensitivity.py), the Fisher-weighted error with 0.91 (BENCHMARKS.md, "Layer sensitivities in the model's
unit").

F_jj = E_{y ~ p}[(d log p(y) / d o_j)^2] is estimated with one label per position drawn from the model's own
distribution (labels from the text would give the empirical Fisher, which is not the KL's curvature).
Gradients are taken only with respect to the attention outputs (torch.autograd.grad), so no weight
gradient is formed or stored.
"""

from __future__ import annotations

import torch

from kvcompress.calib.collect import wrap_attention


def output_fisher(model, ids: torch.Tensor, seed: int = 0) -> dict[int, torch.Tensor]:
    """{layer index: F [1, Hq, T, Dv] float32 on the CPU} for ids [1, T]: the squared gradient, with respect
    to each attention output element, of sum_t log p(y_t | ids[:, :t+1]) with y_t drawn from the model (a
    sum over positions, so 1/2 sum F d^2 / T is the expected KL per position of an output error d)."""
    if ids.dim() != 2 or ids.shape[0] != 1:
        raise ValueError(f"ids must be [1, T], got {tuple(ids.shape)}")
    outputs: dict[int, torch.Tensor] = {}

    def keep(module, query, key, value, out, scaling):
        idx = getattr(module, "layer_idx", None)
        if idx is not None and out.requires_grad:
            outputs[idx] = out

    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(seed)
    with torch.enable_grad(), wrap_attention(model, keep):
        # the embeddings as the graph's leaf: gradients reach every attention output whether or not the
        # weights require them (quantized weights do not)
        embeds = model.get_input_embeddings()(ids.to(device)).detach().requires_grad_(True)
        logits = model(inputs_embeds=embeds, use_cache=False).logits[0].float()
        logp = logits.log_softmax(-1)
        labels = torch.multinomial(logp.detach().exp().cpu(), 1, generator=gen)[:, 0].to(logp.device)
        total = logp.gather(1, labels[:, None]).sum()
        layers = sorted(outputs)
        grads = torch.autograd.grad(total, [outputs[i] for i in layers])
    # attention outputs are [1, T, Hq, Dv]; the probe's outputs (sensitivity.py) are [1, Hq, T, Dv]
    return {i: g.detach().float().pow(2).transpose(1, 2).contiguous().cpu() for i, g in zip(layers, grads)}
