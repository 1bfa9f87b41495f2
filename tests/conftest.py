"""Shared fixtures: the real SmolLM2-135M (loaded once per test session) and tiny random models.

    def test_x(smollm2):            model, tokenizer = smollm2
    def test_y(tiny_model):         model = tiny_model("qwen3", num_hidden_layers=3)

Tiny models are float32, in eval mode, seeded, with hidden size 64 and GQA (4 query / 2 kv heads),
built from the architecture's own config class so their caches have the real layout.
"""

from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter. It must be chosen before anything imports
# Triton (transformers does, at import), so it is set here, ahead of every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

TINY_VOCAB = 256

# Every arch gets hidden 64, 2 layers, 4 q / 2 kv heads unless its entry or the caller overrides them.
_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)

TINY_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(head_dim=32)),
    # sliding_window 8 is far shorter than the test sequences, so the window is actually hit.
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(sliding_window=8)),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        dict(
            head_dim=16,
            num_hidden_layers=4,
            sliding_window=8,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        ),
    ),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    # MLA: the cache holds the latent (key slot kv_lora_rank wide, value slot qk_rope_head_dim wide).
    "deepseek_v3": (
        "DeepseekV3Config",
        "DeepseekV3ForCausalLM",
        dict(
            num_key_value_heads=4,
            kv_lora_rank=32,
            q_lora_rank=None,
            qk_rope_head_dim=8,
            qk_nope_head_dim=16,
            v_head_dim=16,
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
        ),
    ),
}


def make_tiny_model(arch: str, seed: int = 0, **overrides):
    """A randomly initialised `arch` causal LM (eval, float32); `overrides` go to its config."""
    import transformers

    config_name, model_name, extra = TINY_ARCHS[arch]
    kwargs = {**_COMMON, **extra, **overrides}
    config = getattr(transformers, config_name)(**kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    # generate() would otherwise warn about / fall back on missing generation settings
    model.generation_config.pad_token_id = config.pad_token_id
    return model


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one torch thread for the module avoids oversubscribing a shared CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of the embedded SmolLM2-135M-Instruct, loaded once; tokenizer pads on the left."""
    import kvcompress

    model, tokenizer = kvcompress.load_model("smollm2-135m")
    model.eval()
    tokenizer.padding_side = "left"
    return model, tokenizer


@pytest.fixture
def tiny_model():
    """Factory: tiny_model(arch, seed=0, **config_overrides) -> a tiny random model; arch in TINY_ARCHS."""
    return make_tiny_model
