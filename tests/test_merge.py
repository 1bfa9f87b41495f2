"""H2O with merged evictions (kvcompress.sparse.merge).

What these prove: the log-size bias makes a merged token attend exactly like the identical tokens it
stands for; merging conserves the tokens seen (sizes add up to the context) while memory stays bounded;
configs that cannot merge (quantized storage, other policies) are refused with the fix named.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from conftest import make_tiny_model

import kvcompress
from kvcompress import CompressedCache, KVCompressConfig, LayerPolicy, ModelLayout, QuantSpec, SparsitySpec
from kvcompress.compat import with_cache
from kvcompress.config import ConfigError
from kvcompress.sparse.h2o import H2OPolicy
from kvcompress.sparse.merge import merge_compact
from kvcompress.sparse.state import SparseState


def _attend(q, k, v, bias):
    """q [B, H, D], k/v [B, H, N, D], bias [B, H, N] -> [B, H, D]."""
    w = torch.softmax(torch.einsum("bhd,bhnd->bhn", q, k) + bias, dim=-1)
    return torch.einsum("bhn,bhnd->bhd", w, v)


def test_merged_duplicates_attend_like_the_tokens_they_stand_for():
    """Every token twice: keeping one of each pair and merging its twin into it (log size 2) gives the
    attention over all of them, for any query; three copies of one token then weigh three."""
    torch.manual_seed(0)
    b, h, n, d = 2, 3, 8, 16
    k0, v0 = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    k, v = k0.repeat_interleave(2, dim=2), v0.repeat_interleave(2, dim=2)  # [B, H, 2n, D]: pairs
    layer = SimpleNamespace(tail_k=k.clone(), tail_v=v.clone(), held_tokens=2 * n)
    state = SparseState(H2OPolicy(budget=n), 0)
    priority = torch.arange(2 * n).remainder(2).float().neg().expand(b, h, 2 * n)  # the first of each pair
    valid = torch.ones(b, h, 2 * n, dtype=torch.bool)
    merge_compact(layer, state, priority, torch.zeros_like(valid), valid, n)
    torch.testing.assert_close(layer.tail_k, k0)
    torch.testing.assert_close(layer.tail_v, v0)
    torch.testing.assert_close(state.log_size.exp(), torch.full((b, h, n), 2.0))
    q = torch.randn(b, h, d)
    torch.testing.assert_close(_attend(q, layer.tail_k, layer.tail_v, state.log_size),
                               _attend(q, k, v, torch.zeros(b, h, 2 * n)))
    # merging again: a third copy of token 0 joins its group, sizes add
    layer.tail_k = torch.cat([layer.tail_k, k0[:, :, :1]], 2)
    layer.tail_v = torch.cat([layer.tail_v, v0[:, :, :1]], 2)
    layer.held_tokens = n + 1
    valid = torch.ones(b, h, n + 1, dtype=torch.bool)
    first = torch.arange(n + 1).float().neg().expand(b, h, n + 1)  # keep the first n, evict the newest copy
    merge_compact(layer, state, first, valid & False, valid, n)
    assert state.log_size.exp()[..., 0].allclose(torch.tensor(3.0))


def test_merged_means_are_weighted_by_the_attention_each_token_received():
    """Two tokens per head, one kept: its new key and value are the means of the pair weighted by H2O's
    accumulated scores (3 : 1 here, not 1 : 1 by size), its size counts both tokens and the scores add up;
    a padded slot is neither kept nor weighed."""
    torch.manual_seed(3)
    b, h, d = 1, 2, 8
    k, v = torch.randn(b, h, 3, d), torch.randn(b, h, 3, d)
    layer = SimpleNamespace(tail_k=k.clone(), tail_v=v.clone(), held_tokens=3)
    state = SparseState(H2OPolicy(budget=1, merge=True), 0)
    state.scores = torch.tensor([3.0, 1.0, 0.0]).expand(b, h, 3).clone()
    valid = torch.tensor([True, True, False]).expand(b, h, 3)
    merge_compact(layer, state, state.scores, torch.zeros_like(valid), valid, 1)
    torch.testing.assert_close(layer.tail_k[:, :, 0], (3 * k[:, :, 0] + k[:, :, 1]) / 4, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(layer.tail_v[:, :, 0], (3 * v[:, :, 0] + v[:, :, 1]) / 4, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state.log_size.exp()[:, :, 0], torch.full((b, h), 2.0))
    torch.testing.assert_close(state.scores[:, :, 0], torch.full((b, h), 4.0))


def test_merge_conserves_the_tokens_seen_and_stays_bounded():
    model = make_tiny_model("llama", num_hidden_layers=2)
    budget, page, prompt, steps = 24, 8, 40, 120
    layout = ModelLayout.from_model_config(model.config)
    spec = SparsitySpec("h2o", budget=budget, page_size=page, sinks=4, merge=True)
    cfg = KVCompressConfig(layout, [LayerPolicy(sparsity=spec)] * layout.num_layers)
    cache = CompressedCache(model.config, cfg)
    gen = torch.Generator().manual_seed(2)
    held = []
    with torch.inference_mode(), kvcompress.enabled(model):
        model(torch.randint(3, 256, (2, prompt), generator=gen), **with_cache(cache))
        for _ in range(steps):
            model(torch.randint(3, 256, (2, 1), generator=gen), **with_cache(cache))
            held.append(max(layer.held_tokens for layer in cache.layers))
    assert max(held) <= budget + page
    for layer in cache.layers:
        sizes = layer.sparse.log_size.exp()
        # every token seen is counted once: the merged ones and those appended since the last compaction
        since = layer.held_tokens - sizes.shape[2]
        torch.testing.assert_close(sizes.sum(-1) + since, torch.full(sizes.shape[:2], float(prompt + steps)))
        assert (sizes >= 1 - 1e-5).all()


def test_configs_that_cannot_merge_are_refused():
    with pytest.raises(ConfigError, match="merge applies to H2O"):
        SparsitySpec("streaming", budget=64, merge=True)
    with pytest.raises(ConfigError, match="full-precision keys and values"):
        LayerPolicy(key=QuantSpec("nuq", bits=4, axis="page"),
                    sparsity=SparsitySpec("h2o", budget=64, merge=True))


def test_torch_attention_adds_the_log_sizes():
    """The sparse layers' torch attention adds each held token's log size to its logit; tokens appended after
    the last merge count one."""
    from kvcompress.sparse.attention import attend_torch
    from kvcompress.sparse.state import StepInputs

    torch.manual_seed(1)
    b, h, g, n, d = 2, 2, 3, 10, 16
    k, v = torch.randn(b, h, n, d), torch.randn(b, h, n, d)
    q = torch.randn(b, h * g, 1, d)
    sizes = torch.randint(1, 5, (b, h, n - 2)).float()  # the newest 2 tokens came after the merge
    step = StepInputs(keys=k, values=v, q_len=1, mask=torch.ones(b, h, 1, n, dtype=torch.bool))
    layer = SimpleNamespace(sparse=SimpleNamespace(step=step, log_size=sizes.log()))
    out, _ = attend_torch(q, layer, 0.25)
    bias = torch.cat([sizes, torch.ones(b, h, 2)], -1).log()
    qg = q.reshape(b, h, g, d)
    w = torch.softmax(torch.einsum("bhgd,bhnd->bhgn", qg, k) * 0.25 + bias[:, :, None], -1)
    torch.testing.assert_close(out.reshape(b, h, g, d), torch.einsum("bhgn,bhnd->bhgd", w, v))


def test_merge_preset_saves_and_loads(tmp_path):
    model = make_tiny_model("llama", num_hidden_layers=2)
    cfg = KVCompressConfig.from_preset("h2o-merge-50", model.config)
    cfg.save(tmp_path / "m.safetensors")
    back = KVCompressConfig.load(tmp_path / "m.safetensors")
    assert all(p.sparsity.merge and p.sparsity.sinks == 4 and p.sparsity.ratio == 0.5 for p in back.layers)
