"""CompressedCache with no compression is exact: token-identical to DynamicCache, with equal logits.

Checked through `generate` (greedy, beam search, assisted decoding, which rolls the cache back with
`crop`) on the real SmolLM2-135M and on tiny random models of every supported layout: GQA (Llama,
Qwen2, Qwen3 with a wide head, Phi3), sliding windows shorter than the sequence (Mistral; Gemma3 mixing
sliding and full layers) and MLA (DeepSeek-V3, whose cache holds the latent). Tests marked `compat`
also run against transformers 5.17 in CI (scripts/test.sh).
"""

from __future__ import annotations

import pytest
import torch
from conftest import TINY_ARCHS, make_tiny_model
from transformers import DynamicCache

from kvcompress import CompressedCache
from kvcompress.cache import CompressedLayer, CompressedSlidingLayer
from kvcompress.compat import with_cache

PROMPTS = [
    "The capital of France is",
    "Write one sentence about the sea, the wind and the long grey ships that",
    "Q: What is 12 times 7?\nA:",
]


def _generate(model, cache, **kwargs):
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(
            do_sample=False, return_dict_in_generate=True, output_logits=True, **with_cache(cache, **kwargs)
        )


def assert_same_generation(model, make_compressed, **kwargs):
    """Run `generate` with DynamicCache and with CompressedCache; tokens and logits must be bit-identical."""
    reference_cache, compressed_cache = DynamicCache(config=model.config), make_compressed()
    ref = _generate(model, reference_cache, **kwargs)
    out = _generate(model, compressed_cache, **kwargs)
    assert torch.equal(out.sequences, ref.sequences), "generated tokens differ from DynamicCache"
    assert len(out.logits) == len(ref.logits)
    for step, (a, b) in enumerate(zip(out.logits, ref.logits)):
        diff = (a - b).abs().max().item()
        assert torch.equal(a, b), f"logits differ from DynamicCache at step {step} (max abs diff {diff})"
    return reference_cache, compressed_cache


def assert_same_states(reference: DynamicCache, compressed: CompressedCache):
    """Layer by layer, the states held are the same tensors' values with the same lengths."""
    assert len(compressed.layers) == len(reference.layers)
    for i, (r, c) in enumerate(zip(reference.layers, compressed.layers)):
        assert torch.equal(c.keys, r.keys), f"layer {i}: keys differ"
        assert torch.equal(c.values, r.values), f"layer {i}: values differ"
        assert c.get_seq_length() == r.get_seq_length(), f"layer {i}: seq length differs"
        assert c.get_mask_sizes(1) == r.get_mask_sizes(1), f"layer {i}: mask sizes differ"


@pytest.mark.compat
@pytest.mark.slow
def test_smollm2_greedy_batch_is_token_identical(smollm2):
    """3 prompts of different lengths, left-padded, 32 new tokens, on the real weights."""
    model, tokenizer = smollm2
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (inputs["attention_mask"] == 0).any(), "the batch must actually be padded"
    ref, comp = assert_same_generation(
        model, lambda: CompressedCache(model.config, "none"), **inputs, max_new_tokens=32, min_new_tokens=32
    )
    assert all(isinstance(layer, CompressedLayer) and not layer.compressed for layer in comp.layers)
    assert_same_states(ref, comp)


@pytest.mark.slow
def test_smollm2_none_config_object_and_none_argument_are_the_same(smollm2):
    """`CompressedCache(cfg)` (None) and a KVCompressConfig built from the "none" preset are lossless too."""
    from kvcompress import KVCompressConfig

    model, tokenizer = smollm2
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt")
    cfg = KVCompressConfig.from_preset("none", model.config)
    assert_same_generation(model, lambda: CompressedCache(model.config, cfg), **inputs, max_new_tokens=8)
    assert_same_generation(model, lambda: CompressedCache(model.config), **inputs, max_new_tokens=8)


@pytest.mark.compat
@pytest.mark.parametrize("arch", sorted(TINY_ARCHS))
def test_tiny_greedy_is_token_identical(arch):
    """Batch of 2 (one row left-padded), 20-token prompt + 16 new tokens (35 cached): past every
    sliding window (8)."""
    model = make_tiny_model(arch)
    torch.manual_seed(1)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 20))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, :5] = 0
    ref, comp = assert_same_generation(
        model,
        lambda: CompressedCache(model.config, "none"),
        input_ids=input_ids,
        attention_mask=attention_mask,
        max_new_tokens=16,
        min_new_tokens=16,
    )
    assert_same_states(ref, comp)
    layout = comp.layout
    for i, layer in enumerate(comp.layers):
        if layout.is_sliding(i):
            assert isinstance(layer, CompressedSlidingLayer)
            assert layer.get_seq_length() > layout.sliding_window, "the sliding window must be hit"
            assert layer.held_tokens == layout.sliding_window - 1
        else:
            assert isinstance(layer, CompressedLayer) and layer.held_tokens == 35
    if arch in ("mistral", "gemma3"):
        assert any(layout.is_sliding(i) for i in range(layout.num_layers))
    if arch == "gemma3":
        assert not all(layout.is_sliding(i) for i in range(layout.num_layers))
    if arch == "deepseek_v3":
        # MLA: one latent "head"; key slot = kv_lora_rank, value slot = qk_rope_head_dim
        assert layout.attention == "mla"
        assert comp.layers[0].keys.shape[1:] == (1, 35, model.config.kv_lora_rank)
        assert comp.layers[0].values.shape[1:] == (1, 35, model.config.qk_rope_head_dim)


@pytest.mark.compat
@pytest.mark.slow
def test_smollm2_beam_search_is_token_identical(smollm2):
    """num_beams=3 expands the batch and calls reorder_cache every step."""
    model, tokenizer = smollm2
    inputs = tokenizer(PROMPTS[:2], return_tensors="pt", padding=True)
    assert_same_generation(
        model, lambda: CompressedCache(model.config, "none"), **inputs, num_beams=3, max_new_tokens=12
    )


@pytest.mark.compat
@pytest.mark.parametrize("arch", ["gemma3", "deepseek_v3"])
def test_tiny_beam_search_is_token_identical(arch):
    """Beam search through sliding layers (past the window) and through the MLA latent cache."""
    model = make_tiny_model(arch)
    torch.manual_seed(2)
    input_ids = torch.randint(3, model.config.vocab_size, (2, 12))
    assert_same_generation(
        model,
        lambda: CompressedCache(model.config, "none"),
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        num_beams=3,
        max_new_tokens=10,
        min_new_tokens=10,
    )


def _count_crops(cache):
    """Wrap cache.crop to count calls that actually remove tokens."""
    calls = []
    crop = cache.crop

    def counting_crop(n):
        calls.append(n)
        return crop(n)

    cache.crop = counting_crop
    return calls


def _assisted_generate(model, assistant, cache, input_ids, max_new_tokens):
    torch.manual_seed(0)
    with torch.no_grad():
        return model.generate(
            input_ids=input_ids,
            attention_mask=torch.ones_like(input_ids),
            assistant_model=assistant,
            do_sample=False,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            **with_cache(cache),
        )


@pytest.mark.compat
@pytest.mark.slow
def test_smollm2_assisted_decoding_is_token_identical(smollm2):
    """A tiny random assistant with SmolLM2's vocabulary proposes drafts that are mostly rejected,
    so the target's cache is cropped over and over."""
    model, tokenizer = smollm2
    assistant = make_tiny_model("llama", vocab_size=model.config.vocab_size, num_hidden_layers=1)
    input_ids = tokenizer(PROMPTS[:1], return_tensors="pt")["input_ids"]
    ref = _assisted_generate(model, assistant, DynamicCache(config=model.config), input_ids, 16)
    cache = CompressedCache(model.config, "none")
    crops = _count_crops(cache)
    out = _assisted_generate(model, assistant, cache, input_ids, 16)
    assert torch.equal(out, ref), f"assisted decoding differs: {out.tolist()} != {ref.tolist()}"
    assert any(n < 0 for n in crops), f"assisted decoding never cropped the cache (crop calls: {crops})"
    assert cache.get_seq_length() == out.shape[1] - 1


@pytest.mark.compat
@pytest.mark.parametrize("arch", ["mistral", "qwen3"])
def test_tiny_assisted_decoding_is_token_identical(arch):
    """Assisted decoding through sliding layers past the window (which must record the past to crop)."""
    model = make_tiny_model(arch, num_hidden_layers=2)
    assistant = make_tiny_model(arch, seed=1, num_hidden_layers=1)
    torch.manual_seed(3)
    input_ids = torch.randint(3, model.config.vocab_size, (1, 10))
    ref = _assisted_generate(model, assistant, DynamicCache(config=model.config), input_ids, 14)
    cache = CompressedCache(model.config, "none")
    crops = _count_crops(cache)
    out = _assisted_generate(model, assistant, cache, input_ids, 14)
    assert torch.equal(out, ref), f"assisted decoding differs: {out.tolist()} != {ref.tolist()}"
    assert any(n < 0 for n in crops), f"assisted decoding never cropped the cache (crop calls: {crops})"


@pytest.mark.compat
def test_transformers_version_is_the_one_this_run_intended():
    """scripts/test.sh sets KVC_EXPECT_TRANSFORMERS=5.17 for its compat run: a run that silently picked up
    another transformers (a wrong PYTHONPATH) would prove nothing about 5.17."""
    import os

    import transformers

    expected = os.environ.get("KVC_EXPECT_TRANSFORMERS")
    if not expected:
        pytest.skip("KVC_EXPECT_TRANSFORMERS not set: any supported transformers will do")
    assert transformers.__version__.startswith(expected), (
        f"this run meant transformers {expected} but imported {transformers.__version__} "
        f"from {transformers.__file__}"
    )
