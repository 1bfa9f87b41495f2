"""The fused decode kernel wired into the `kvcompress` attention, end to end on a tiny random Llama.

What these prove:
- with KVCOMPRESS_KERNELS=triton (Triton's interpreter on CPU) decode steps of compressed layers really
  run the fused kernel over packed pages, and greedy generation gives the same tokens as the torch
  path (dense decode + SDPA), with logits equal within float32 rounding;
- the lossless preset through the kvcompress attention is token-identical to the sdpa model;
- a left-padded batch runs the kernel (masked from each row's first real position) with the torch path's
  results; a mask with other holes runs on the torch path;
- Quest's page list and H2O's per-token mass from the kernel match the torch path on a decode step.

Tolerance: both paths read the same quantized bytes in float32; they differ only in summation order
(the kernel's online softmax over splits versus one softmax, and its dequantize-in-registers dot versus
a decode then matmul), i.e. float32 rounding of O(1e-6) relative per layer, so logits agree to 1e-4
absolute on logits of size ~1 (rtol 1e-3 covers larger ones).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvcompress
from kvcompress.cache import CompressedCache
from kvcompress.compat import with_cache
from kvcompress.config import KVCompressConfig, SparsitySpec
from kvcompress.kernels.backend import triton_available

from conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter on CPU)")

PROMPT, NEW = 21, 6  # odd prompt length: partly filled pages at every step
ATOL, RTOL = 1e-4, 1e-3  # float32 rounding only (see the module docstring)


@pytest.fixture(scope="module")
def model():
    """Tiny Llama: 2 layers, head dim 64, 4 query / 2 kv heads (GQA 2), float32."""
    m = make_tiny_model("llama", hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                        intermediate_size=256, num_hidden_layers=2)
    m.set_attn_implementation("sdpa")
    return m


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, 256, (2, PROMPT), generator=g)


def tiny_pages(model, preset: str, sparsity: SparsitySpec | None = None, sinks: int | None = None):
    """The preset with pages of 8 tokens and a residual of 2, so decode reads many packed pages."""
    cfg = KVCompressConfig.from_preset(preset, model.config)
    layers = []
    for p in cfg.layers:
        p = replace(p, page_size=8, residual=2 if sparsity is None else 0)
        if sinks is not None:
            p = replace(p, sinks=sinks)
        if sparsity is not None:
            p = replace(p, sparsity=sparsity)
        layers.append(p)
    return KVCompressConfig(layout=cfg.layout, layers=layers, name=f"{preset}-p8")


class KernelSpy:
    """Counts fused kernel launches and how many of them read a packed body."""

    def __init__(self, monkeypatch):
        import kvcompress.kernels.decode_attention_triton as mod

        self.calls = self.with_body = 0
        original = mod.decode_attention_triton

        def spy(q, parts, *args, **kwargs):
            self.calls += 1
            self.with_body += parts.key is not None
            return original(q, parts, *args, **kwargs)

        monkeypatch.setattr(mod, "decode_attention_triton", spy)


def generate(model, prompt, kv_config, backend_env, monkeypatch, attention_mask=None, mode=torch.no_grad):
    monkeypatch.setenv("KVCOMPRESS_KERNELS", backend_env)
    cache = CompressedCache(model.config, kv_config)
    with mode(), kvcompress.enabled(model):
        out = model.generate(
            prompt, attention_mask=attention_mask, max_new_tokens=NEW, do_sample=False,
            return_dict_in_generate=True, output_logits=True, **with_cache(cache),
        )
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("preset", ["fp8", "int4", "nuq4"])
def test_fused_generation_matches_torch(model, prompt, preset, monkeypatch):
    cfg = tiny_pages(model, preset)
    ref_tokens, ref_logits = generate(model, prompt, cfg, "torch", monkeypatch)
    spy = KernelSpy(monkeypatch)
    tokens, logits = generate(model, prompt, cfg, "triton", monkeypatch)
    decode_steps = NEW - 1  # the first new token comes from the prefill
    assert spy.calls == decode_steps * model.config.num_hidden_layers, "every decode step must run the kernel"
    assert spy.with_body == spy.calls, "the kernel must read packed pages, not only the exact tail"
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("preset", ["nuq3", "nuq4-vrot"])
def test_fused_generation_under_inference_mode(model, prompt, preset, monkeypatch):
    """Under torch.inference_mode() (how `kvcompress eval` runs) every tensor the cache makes, the value
    rotation's signs included, is an inference tensor: the fused path still runs every decode step and gives
    the torch path's tokens and logits (no_grad)."""
    cfg = tiny_pages(model, preset)
    ref_tokens, ref_logits = generate(model, prompt, cfg, "torch", monkeypatch)
    spy = KernelSpy(monkeypatch)
    tokens, logits = generate(model, prompt, cfg, "triton", monkeypatch, mode=torch.inference_mode)
    assert spy.calls == (NEW - 1) * model.config.num_hidden_layers
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


def test_lossless_through_kvcompress_equals_sdpa(model, prompt, monkeypatch):
    from transformers import DynamicCache

    with torch.no_grad():
        ref = model.generate(prompt, max_new_tokens=NEW, do_sample=False, **with_cache(DynamicCache()))
    tokens, _ = generate(model, prompt, "none", "triton", monkeypatch)
    assert torch.equal(tokens, ref)


def test_left_padding_runs_the_kernel(model, prompt, monkeypatch):
    """A left-padded batch (row 0: 5 pads, inside the sinks and the first page; row 1: 13 pads, over two
    pages) stays on the fused path, masked by each row's first real position, with the torch path's
    tokens and logits."""
    mask = torch.ones_like(prompt)
    mask[0, :5] = 0
    mask[1, :13] = 0
    cfg = tiny_pages(model, "nuq4")
    ref_tokens, ref_logits = generate(model, prompt, cfg, "torch", monkeypatch, mask)
    spy = KernelSpy(monkeypatch)
    tokens, logits = generate(model, prompt, cfg, "triton", monkeypatch, mask)
    assert spy.calls == (NEW - 1) * model.config.num_hidden_layers
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)


def test_holes_other_than_left_padding_take_the_torch_path(model, prompt, monkeypatch):
    mask = torch.ones_like(prompt)
    mask[0, 7:9] = 0  # a hole inside row 0: not left padding
    cfg = tiny_pages(model, "nuq4")
    ref_tokens, ref_logits = generate(model, prompt, cfg, "torch", monkeypatch, mask)
    spy = KernelSpy(monkeypatch)
    tokens, logits = generate(model, prompt, cfg, "triton", monkeypatch, mask)
    assert spy.calls == 0
    assert torch.equal(tokens, ref_tokens)
    assert torch.equal(logits, ref_logits)


@pytest.mark.parametrize(
    "sparsity",
    [SparsitySpec(method="quest", budget=16, page_size=8), SparsitySpec(method="h2o", budget=64, page_size=8)],
    ids=["quest", "h2o"],
)
def test_sparse_decode_step_matches_torch(model, prompt, sparsity, monkeypatch):
    """One decode step after the same prefill: Quest reads its page list, H2O gets the kernel's mass."""
    cfg = tiny_pages(model, "nuq4", sparsity, sinks=0)

    def step(backend_env):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", backend_env)
        cache = CompressedCache(model.config, cfg)
        with torch.no_grad(), kvcompress.enabled(model):
            model(prompt[:, :-1], **with_cache(cache))
            logits = model(prompt[:, -1:], **with_cache(cache)).logits
        layer = cache.layers[1]
        return logits, layer.sparse.scores, layer.sparse.tokens_read

    ref_logits, ref_scores, ref_read = step("torch")
    spy = KernelSpy(monkeypatch)
    logits, scores, read = step("triton")
    assert spy.calls == model.config.num_hidden_layers and spy.with_body == spy.calls
    torch.testing.assert_close(logits, ref_logits, atol=ATOL, rtol=RTOL)
    assert read == ref_read
    if sparsity.method == "quest":
        assert read < PROMPT, "Quest must read a subset"
    else:
        torch.testing.assert_close(scores, ref_scores, atol=ATOL, rtol=RTOL)
