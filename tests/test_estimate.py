"""`kvcompress estimate`: KV memory against 2 x tokens x layers x kv heads x head dim x bytes, done right for
GQA, sliding-window layers and MLA latents."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from kvcompress import KVCompressConfig, ModelLayout, QuantSpec, SparsitySpec
from kvcompress.calib.estimate import estimate_memory

CTX, BATCH = 128 * 1024, 8


def _write(tmp_path, config) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config.to_dict()))
    return str(path)


def test_llama_gqa_matches_the_formula(tmp_path):
    from transformers import LlamaConfig

    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8)
    r = estimate_memory(ModelLayout.from_model_config(cfg), None, CTX, BATCH, torch.bfloat16)
    assert r["uncompressed_bytes"] == 2 * CTX * BATCH * 32 * 8 * 128 * 2  # 128 GiB, per kv head (not 32 heads)
    assert r["uncompressed_bytes"] == 128 * 1024**3


def test_sliding_window_layers_are_bounded_by_the_window():
    from transformers import Gemma3TextConfig

    types = ["sliding_attention"] * 5 + ["full_attention"]
    cfg = Gemma3TextConfig(num_hidden_layers=6, num_key_value_heads=4, head_dim=256, sliding_window=1024,
                           layer_types=types)
    r = estimate_memory(ModelLayout.from_model_config(cfg), None, CTX, BATCH, torch.bfloat16)
    per_token = 2 * 4 * 256 * 2 * BATCH
    assert [row["tokens_held"] for row in r["layers"]] == [1024] * 5 + [CTX]
    assert r["uncompressed_bytes"] == per_token * (5 * 1024 + CTX)


def test_deepseek_v3_mla_latent(tmp_path):
    from transformers import DeepseekV3Config

    cfg = DeepseekV3Config()  # 61 layers, kv_lora_rank 512, qk_rope 64, 128 heads, qk_nope 128, v_head_dim 128
    layout = ModelLayout.from_model_config(cfg)
    r = estimate_memory(layout, None, CTX, BATCH, torch.bfloat16)
    assert r["mla"]["decompressed_values_per_token_per_layer"] == 128 * (128 + 64 + 128) == 40960
    assert r["mla"]["latent_values_per_token_per_layer"] == 512 + 64 == 576
    assert r["uncompressed_bytes"] == CTX * BATCH * 61 * 576 * 2
    assert r["mla"]["decompressed_bytes"] == CTX * BATCH * 61 * 40960 * 2
    out = CliRunner().invoke(_main(), ["estimate", _write(tmp_path, cfg), "--context", "128k", "--batch", "8"])
    assert out.exit_code == 0, out.output
    assert "40,960" in out.output and "576" in out.output


def test_preset_bits_come_from_the_codecs():
    layout = ModelLayout("llama", 4, 2, 64, 64, ("full_attention",) * 4)
    r = estimate_memory(layout, KVCompressConfig.from_preset("fp8", layout), 4096, 2, torch.bfloat16)
    # fp8 codes + one fp16 scale per token and head, for the 4016 tokens in pages of 16; the 4 sinks and the
    # 64-token window + 12 tokens of the partly filled page stay in bf16
    assert r["bits_per_element"] == pytest.approx((4016 * (8 + 16 / 64) + 80 * 16) / 4096)
    r = estimate_memory(layout, KVCompressConfig.from_preset("nuq4", layout), 4 + 48 + 48 * 199, 1, torch.bfloat16)
    # keys: 4-bit codes + an FP8 scale and zero per channel per 48-token page + 31 outliers (int16 position +
    # fp16 value) per 48x64 page; values: 4-bit codes + an FP8 scale per token; 4 sinks and the 48-token
    # window (a page waits until 16 newer tokens follow it) in bf16; plus the two float32 codebooks of 16
    # levels, once per layer
    body = 4 + (16 / 48) / 2 + (8 / 64) / 2 + 31 * 32 / (48 * 64) / 2
    tokens = 52 + 48 * 199
    codebooks = 2 * 16 * 32 / (tokens * 2 * (64 + 64))
    assert r["bits_per_element"] == pytest.approx((48 * 199 * body + 52 * 16) / tokens + codebooks, rel=1e-6)


def test_cli_json_with_config_file(tmp_path):
    layout = ModelLayout("llama", 2, 2, 64, 64, ("full_attention",) * 2)
    path = tmp_path / "c.safetensors"
    KVCompressConfig.from_preset("int4", layout).save(path)
    out = CliRunner().invoke(_main(), ["estimate", "--config", str(path), "--context", "32k", "--json"])
    assert out.exit_code == 0, out.output
    doc = json.loads(out.output)
    assert doc["context"] == 32768 and doc["uncompressed_bytes"] == 2 * 32768 * 2 * 2 * 64 * 2
    assert doc["compressed_bytes"] < doc["uncompressed_bytes"] / 3


def _main():
    from kvcompress.cli import main

    return main


SPARSE_CASES = {
    "h2o": (dict(), SparsitySpec("h2o", ratio=0.25, page_size=8)),
    "h2o-nuq4": (dict(key=QuantSpec("nuq", bits=4, axis="channel", outlier_fraction=0.02),
                      value=QuantSpec("nuq", bits=4, axis="token", outlier_fraction=0.02), page_size=8, sinks=4),
                 SparsitySpec("h2o", budget=48, page_size=8)),
    "h2o-merge": (dict(), SparsitySpec("h2o", budget=40, page_size=8, sinks=4, merge=True)),
    "h2o-heads": (dict(), SparsitySpec("h2o", ratio=0.25, page_size=8, sinks=4, head_shares=[0.5, 1.5])),
    "streaming": (dict(), SparsitySpec("streaming", budget=40, sinks=4, page_size=8)),
    "quest": (dict(), SparsitySpec("quest", budget=32, page_size=8, dense_layers=1)),
    "quest-means": (dict(), SparsitySpec("quest", budget=32, page_size=8, dense_layers=1, unread_means=True)),
    "snapkv": (dict(), SparsitySpec("snapkv", ratio=0.3, observation_window=8, pool_kernel=3)),
}


@pytest.mark.parametrize("case", list(SPARSE_CASES))
def test_sparse_estimate_bounds_what_the_cache_holds(case):
    """The estimate of a sparse config is an upper bound of the bytes a real cache holds after every step of
    a generation, and a tight one: within the two pages of slack the policies allow and the page of free slots
    a full-precision layer appends into (SnapKV, which selects only at prefill, after the prefill)."""
    import kvcompress
    from conftest import make_tiny_model
    from kvcompress import CompressedCache, LayerPolicy
    from kvcompress.compat import with_cache

    model = make_tiny_model("llama", num_hidden_layers=3)
    layout = ModelLayout.from_model_config(model.config)
    policy, spec = SPARSE_CASES[case]
    cfg = KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=spec, **policy)] * layout.num_layers)
    cache = CompressedCache(model.config, cfg)
    gen = torch.Generator().manual_seed(1)
    prompt, steps = 120, 0 if case == "snapkv" else 150
    per_token = layout.num_kv_heads * (layout.key_head_dim + layout.value_head_dim) * 4
    slack = (2 if policy else 3) * 8 * per_token * layout.num_layers
    worst = 0.0
    with torch.inference_mode(), kvcompress.enabled(model):
        model(torch.randint(3, 256, (1, prompt), generator=gen), **with_cache(cache))
        for step in range(steps + 1):
            if step:
                model(torch.randint(3, 256, (1, 1), generator=gen), **with_cache(cache))
            held = cache.memory_report()["held_bytes"]
            bound = estimate_memory(layout, cfg, prompt + step, 1, torch.float32)["compressed_bytes"]
            assert held <= bound, f"step {step}: the cache holds {held} bytes, the estimate says at most {bound}"
            worst = max(worst, bound - held)
    assert worst <= slack, f"the estimate overstated the held bytes by {worst}, more than {slack}"
    assert estimate_memory(layout, cfg, prompt + steps, 1, torch.float32)["ratio"] > 1.5 or "quest" in case
