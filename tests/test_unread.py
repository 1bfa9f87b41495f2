"""Quest's skipped pages as one token each (SparsitySpec.unread_means, kvcompress.sparse.unread).

What these tests prove:
- where every key of a page is the same, the stand-ins are exact: a Quest step that reads a few pages gives
  the attention over every token, which plain Quest (skipping the pages) does not;
- each page keeps the mean of its values, across prefill chunks and decode steps, and the memory report
  counts those means as held metadata (and bytes read per step);
- a budget covering the context, a padded batch and the other Quest cases: tests/test_sparse.py's SPECS;
- the option is refused where it means nothing (other policies) or is not built (MLA layers, where the
  quest-25 preset goes without it), and the fused kernel, which reads no page means, leaves such a layer
  to the torch attention.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model

from kvcompress import CompressedCache, ConfigError, KVCompressConfig, LayerPolicy, ModelLayout, SparsitySpec
from kvcompress.sparse.attention import attend_torch
from kvcompress.sparse.state import clear_pending
from kvcompress.sparse.step import begin_sparse_step


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", num_hidden_layers=2)


def quest_cache(model, unread_means: bool, budget: int = 12, page: int = 4, **policy) -> CompressedCache:
    layout = ModelLayout.from_model_config(model.config)
    spec = SparsitySpec("quest", budget=budget, page_size=page, unread_means=unread_means)
    return CompressedCache(model.config, KVCompressConfig(
        layout=layout, layers=[LayerPolicy(sparsity=spec, **policy) for _ in range(layout.num_layers)]))


def decode_step(layer, keys, values, query, scaling=0.125):
    """Append keys / values [B, H, t, D] (prefill, then the last token as a decode step) and attend the
    decode step's query [B, Hq, 1, D] on the torch backend -> (output [B, Hq, 1, D], the step's index)."""
    try:
        layer.update(keys[:, :, :-1], values[:, :, :-1])
        clear_pending()
        k, _ = layer.update(keys[:, :, -1:], values[:, :, -1:])
        begin_sparse_step(layer, query, k, None, scaling, deferred=False)
        index = layer.sparse.step.index
        out, _ = attend_torch(query, layer, scaling)
    finally:
        clear_pending()
    return out, index


def dense_attention(query, keys, values, scaling=0.125):
    """query [B, Hq, 1, D] over every token of keys / values [B, H, t, D] (GQA groups of Hq / H)."""
    g = query.shape[1] // keys.shape[1]
    k, v = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
    return torch.softmax(query @ k.transpose(-1, -2) * scaling, -1) @ v


def test_pages_of_one_key_are_attended_exactly(model):
    """Keys equal within each page of 4 (bfloat16 values, so the page's key box is that key) and values
    whose page means bfloat16 holds exactly: a page's stand-in (key at the box centre, mean value, + log 4)
    carries exactly its 4 tokens' share of the attention, so reading 3 of 10 pages gives the dense result."""
    cache = quest_cache(model, unread_means=True)
    layer = cache.layers[0]
    gen = torch.Generator().manual_seed(0)
    b, h, d, t = 1, model.config.num_key_value_heads, model.config.head_dim, 40
    page_keys = torch.randn(b, h, t // 4, d, generator=gen).bfloat16().float() * 2
    keys = page_keys.repeat_interleave(4, 2)
    values = torch.randint(-8, 8, (b, h, t, d), generator=gen).float() / 4  # page sums / 4: multiples of 1/16
    query = torch.randn(b, model.config.num_attention_heads, 1, d, generator=gen)
    out, index = decode_step(layer, keys, values, query)
    assert index is not None and index.shape[-1] == 12  # 3 pages of 4 read, 7 stand in
    torch.testing.assert_close(out, dense_attention(query, keys, values), atol=1e-5, rtol=1e-5)
    skipped, _ = decode_step(quest_cache(model, unread_means=False).layers[0], keys, values, query)
    assert (skipped - out).abs().max() > 1e-2  # without the stand-ins the skipped pages' mass is lost


def test_pages_keep_their_mean_values_and_the_report_counts_them(model):
    """page_means [B, H, pages, Dv]: each complete page's mean value in bfloat16, whatever chunks its tokens
    came in; the partial page's values wait. The memory report holds them as metadata."""
    gen = torch.Generator().manual_seed(1)
    b, h, d = 2, model.config.num_key_value_heads, model.config.head_dim
    keys, values = torch.randn(b, h, 23, d, generator=gen), torch.randn(b, h, 23, d, generator=gen)
    with_means, without = quest_cache(model, True).layers[0], quest_cache(model, False).layers[0]
    for layer in (with_means, without):
        for lo, hi in ((0, 10), (10, 11), (11, 17), (17, 23)):
            layer.update(keys[:, :, lo:hi], values[:, :, lo:hi])
            clear_pending()
    means = with_means.sparse.page_means
    assert means.dtype == torch.bfloat16 and means.shape == (b, h, 5, d)
    expect = values[:, :, :20].reshape(b, h, 5, 4, d).mean(3)
    torch.testing.assert_close(means.float(), expect, atol=0, rtol=2 ** -8)
    assert with_means.sparse.pending_values.shape[2] == 3 and without.sparse.page_means is None
    extra = with_means.memory().metadata_bytes - without.memory().metadata_bytes
    assert extra == means.numel() * 2 + with_means.sparse.pending_values.numel() * 4


def test_unread_means_are_refused_where_they_mean_nothing():
    with pytest.raises(ConfigError, match="unread_means"):
        SparsitySpec("h2o", ratio=0.5, unread_means=True)
    deepseek = make_tiny_model("deepseek_v3", kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16,
                               v_head_dim=16, num_hidden_layers=1)
    layout = ModelLayout.from_model_config(deepseek.config)
    spec = SparsitySpec("quest", budget=16, page_size=8, unread_means=True)
    cfg = KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=spec)])
    with pytest.raises(ConfigError, match="MLA"):
        CompressedCache(deepseek.config, cfg)
    # the quest-25 preset on an MLA model: Quest there skips its unread pages
    policies = [layer.sparse.policy for layer in CompressedCache(deepseek.config, "quest-25").layers]
    assert policies and not any(p.unread_means for p in policies)
    assert all(layer.sparse.policy.unread_means for layer in CompressedCache(make_tiny_model("llama").config,
                                                                             "quest-25").layers)


def test_the_fused_kernel_leaves_unread_means_to_the_torch_attention(model):
    """A Quest layer over nuq4 pages that the fused kernel would serve, except that it reads no page means."""
    from kvcompress.config import QuantSpec
    from kvcompress.kernels.attention_backend import fused_supported

    quant = dict(key=QuantSpec(method="nuq", bits=4, axis="page"),
                 value=QuantSpec(method="nuq", bits=4, axis="token"), page_size=8)
    keys = torch.randn(1, model.config.num_key_value_heads, 33, model.config.head_dim)
    served = {}
    for means in (False, True):
        layer = quest_cache(model, means, budget=16, page=8, **quant).layers[0]
        layer.update(keys, keys.clone())
        clear_pending()
        served[means] = fused_supported(layer)
    assert served == {False: True, True: False}


def test_config_round_trip_keeps_unread_means_and_inspect_shows_them(model, tmp_path):
    from kvcompress.calib.inspect import layer_rows

    cfg = quest_cache(model, True).kv_config
    cfg.save(tmp_path / "q.safetensors")
    loaded = KVCompressConfig.load(tmp_path / "q.safetensors")
    assert all(p.sparsity.unread_means for p in loaded.layers)
    assert layer_rows(loaded)[0]["sparsity"] == "quest 12 tok (pages of 4, unread means)"
    preset = KVCompressConfig.from_preset("quest-25", ModelLayout.from_model_config(model.config))
    assert layer_rows(preset)[1]["sparsity"] == "quest 25% (pages of 4, shared by layers, unread means)"
