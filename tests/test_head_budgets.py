"""H2O budgets per kv head (SparsitySpec.head_shares), held packed (kvcompress.sparse.ragged), and their
calibration (kvcompress.calib.head_budgets).

What these tests prove:
- equal shares give exactly plain H2O (the packed path keeps the same tokens as the padded one);
- each head keeps its recent window, the first sinks and its top tokens by accumulated attention, up to its
  own budget, and the layer holds the sum of the heads' tokens (not the largest head's count for every head);
- over hundreds of decode steps every head stays within its budget plus a page, and the bytes stay flat;
- beam reordering moves each row's packed tokens with it;
- a config refuses shares where they cannot hold (another method, merge, quantized storage, a head count
  the model does not have) and round-trips them through its file;
- the replayed eviction costs (attention mass missed, expected KL) are zero for a head that reads only its
  newest token and fall with the budget for a diffuse one; the KL is zero where the evicted values change
  nothing or the output does not matter (a zero Fisher) and scales with the Fisher; the allocation meets the mean ratio and the floor; `calibrate -p h2o-25` writes shares
  that generate, and asking for head budgets where there is no full-precision H2O layer is an error.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from test_sparse import decode_steps, greedy, sparse_config

import kvcompress
from kvcompress import CompressedCache, ConfigError, KVCompressConfig, LayerPolicy, QuantSpec, SparsitySpec
from kvcompress.cache import CompressedLayer
from kvcompress.calib.head_budgets import allocate_ratios, replay_costs, sparse_h2o_layers
from kvcompress.calib.held import held_tokens, sparsity_state_bytes
from kvcompress.calib.inspect import describe_sparsity
from kvcompress.compat import with_cache
from kvcompress.sparse.h2o import H2OPolicy
from kvcompress.sparse.ragged import evict_heads
from kvcompress.sparse.state import SparseState

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", num_hidden_layers=3)  # 2 kv heads


def h2o(budget=16, shares=(), **kw):
    return SparsitySpec("h2o", budget=budget, page_size=8, head_shares=list(shares), **kw)


@pytest.mark.compat  # generate() through the cache API
def test_equal_shares_are_plain_h2o(model):
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(0))
    with kvcompress.enabled(model):
        ref_logits, ref_tokens = greedy(model, CompressedCache(model.config, sparse_config(model, h2o())), ids, 30)
        cache = CompressedCache(model.config, sparse_config(model, h2o(shares=(1.0, 1.0))))
        logits, tokens = greedy(model, cache, ids, 30)
    assert cache.layers[0].ragged is not None  # the packed path ran
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


def test_each_head_keeps_its_own_budget_packed():
    spec = h2o(budget=8, shares=(0.5, 1.5), sinks=1)
    layer = CompressedLayer(LayerPolicy(sparsity=spec), layer_idx=0)
    k, v = torch.randn(1, 2, 20, 4), torch.randn(1, 2, 20, 3)
    layer.update(k, v)
    state = layer.sparse = SparseState(H2OPolicy.from_spec(spec), 0)
    scores = torch.rand(1, 2, 20, generator=torch.Generator().manual_seed(1))
    state.scores = scores.clone()
    valid = torch.ones(1, 2, 20, dtype=torch.bool)
    budgets = torch.tensor([[4, 12]])
    pos = torch.arange(20)
    forced = torch.stack([(pos >= 20 - 2) | (pos < 1), (pos >= 20 - 6) | (pos < 1)])[None]
    evict_heads(layer, state, scores, forced, valid, budgets, slack=0)
    assert layer.ragged.counts.tolist() == [[4, 12]]
    assert layer.ragged.keys.shape == (16, 4)  # 4 + 12 tokens held, not 2 x 12
    keys, values = layer.dense()
    for h, n in enumerate((4, 12)):
        free = scores[0, h].masked_fill(forced[0, h], -1.0)
        expected = sorted(set(pos[forced[0, h]].tolist()) | set(free.topk(n - int(forced[0, h].sum())).indices.tolist()))
        assert state.pos[0, h, :n].tolist() == expected
        assert torch.equal(keys[0, h, :n], k[0, h, expected])
        assert torch.equal(values[0, h, :n], v[0, h, expected])
        assert (state.pos[0, h, n:] == -1).all() and (keys[0, h, n:] == 0).all()  # dead, masked slots
    assert layer.held_tokens == 12 and layer.tail_k.shape[2] == 0


def test_heads_stay_within_their_budgets_and_bytes_stay_flat(model):
    budget, page, shares = 32, 8, (0.5, 1.5)
    cache = CompressedCache(model.config, sparse_config(model, h2o(budget=budget, shares=shares)))
    nbytes = []
    with torch.inference_mode(), kvcompress.enabled(model):
        for _ in decode_steps(model, cache, 300):
            for layer in cache.layers:
                live = (layer.sparse.pos >= 0).sum(-1)[0] if layer.sparse.pos is not None else None
                if live is not None:
                    assert live[0] <= 16 + page and live[1] <= 48 + page, live.tolist()
            nbytes.append(cache.memory_report()["held_bytes"])
    layer = cache.layers[0]
    counts = layer.ragged.counts
    # each head compacted to its own budget when it went over it plus the page (last at 16 / 48 + <= 8 steps)
    assert 16 <= counts[0, 0] <= 16 + page and 48 <= counts[0, 1] <= 48 + page
    # the packed K/V hold the heads' own counts, not the largest for both
    assert layer.ragged.keys.numel() == int(counts.sum()) * layer.tail_k.shape[-1]
    assert max(nbytes[100:]) <= max(nbytes[20:100])


@pytest.mark.compat  # the cache API's reorder_cache
def test_beam_reorder_moves_packed_rows(model):
    ids = torch.randint(3, 256, (2, 40), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(model.config, sparse_config(model, h2o(shares=(0.5, 1.5))))
    with torch.inference_mode(), kvcompress.enabled(model):
        model(ids, **with_cache(cache))
        for _ in range(12):
            model(ids[:, :1], **with_cache(cache))
    layer = cache.layers[1]
    before_k, _ = layer.dense()
    counts = layer.ragged.counts.clone()
    cache.reorder_cache(torch.tensor([1, 0]))
    after_k, _ = layer.dense()
    assert torch.equal(layer.ragged.counts, counts.flip(0))
    assert torch.equal(after_k, before_k.flip(0))


def test_config_refuses_shares_that_cannot_hold(model, tmp_path):
    with pytest.raises(ConfigError, match="head_shares apply to H2O"):
        SparsitySpec("quest", budget=16, head_shares=[1.0, 1.0])
    with pytest.raises(ConfigError, match="merge"):
        SparsitySpec("h2o", budget=16, merge=True, head_shares=[1.0, 1.0])
    with pytest.raises(ConfigError, match="positive"):
        h2o(shares=(0.0, 2.0))
    with pytest.raises(ConfigError, match="full-precision"):
        LayerPolicy(key=QuantSpec("fp8"), value=QuantSpec("fp8"), sparsity=h2o(shares=(1.0, 1.0)))
    with pytest.raises(ConfigError, match="one share per kv head"):
        sparse_config(model, h2o(shares=(1.0, 1.0, 1.0)))
    cfg = sparse_config(model, h2o(shares=(0.4, 1.6)))
    cfg.save(tmp_path / "c.safetensors")
    back = KVCompressConfig.load(tmp_path / "c.safetensors")
    assert back.layers[2].sparsity.head_shares == [0.4, 1.6]
    assert describe_sparsity(back.layers[0].sparsity, 0) == "h2o 16 tok (kv heads x 0.40/1.60)"


def test_estimate_counts_the_heads_own_budgets():
    even, shared = LayerPolicy(sparsity=h2o(budget=100)), LayerPolicy(sparsity=h2o(budget=100, shares=(0.5, 1.5)))
    assert held_tokens(even, 0, 1000) == 108  # budget + a page
    assert held_tokens(shared, 0, 1000) == (58 + 158) // 2  # the heads' mean
    # positions and scores padded to the largest head (158), plus a count and an offset per head
    assert sparsity_state_bytes(shared, 0, 1000, 2, 64) == 2 * 158 * 8 + 2 * 16


def test_replayed_cost_of_a_local_and_a_diffuse_head():
    t = 64
    local = torch.eye(t)  # every query reads only its own token
    diffuse = torch.ones(t, t).tril()
    diffuse = diffuse / diffuse.sum(-1, keepdim=True)
    ratios = torch.tensor([0.1, 0.25, 0.5, 1.0])
    values = torch.randn(2, t, 4, generator=torch.Generator().manual_seed(0))
    cost = replay_costs(torch.stack([local, diffuse])[:, None], ratios, torch.zeros(2, dtype=torch.long),
                        torch.zeros(2, dtype=torch.long), values, torch.ones(2, 1, t, 4))
    for c in (cost.mass, cost.kl):
        assert torch.allclose(c[0], torch.zeros(4), atol=1e-12)
        assert (c[1, :-1] > 1e-6).all() and abs(float(c[1, -1])) < 1e-12 and (c[1].diff() < 0).all()
    # uniform attention over t tokens with b kept: it misses about 1 - b / t of it
    assert abs(float(cost.mass[1, 1]) - 0.75) < 0.05


def test_replayed_kl_weighs_what_the_evicted_values_change_and_what_the_output_matters():
    """The same diffuse attention costs nothing where every token carries the same value or where the
    model's output does not depend on the head's (a zero Fisher), and the cost scales with the Fisher."""
    t, d = 48, 4
    diffuse = torch.ones(t, t).tril()
    attn = (diffuse / diffuse.sum(-1, keepdim=True))[None, None].expand(3, 2, t, t)  # 3 heads, groups of 2
    varied = torch.randn(t, d, generator=torch.Generator().manual_seed(1))
    values = torch.stack([varied[:1].expand(t, d), varied, varied])  # head 0: one value for every token
    fisher = torch.ones(3, 2, t, d)
    fisher[1] = 0.0  # head 1's output does not matter
    fisher[2, 1] = 3.0  # head 2's second query head matters 3x: (1 + 3) / (1 + 1) = 2x the cost of F = 1
    zeros = torch.zeros(3, dtype=torch.long)
    cost = replay_costs(attn, torch.tensor([0.25, 0.5]), zeros, zeros, values, fisher)
    plain = replay_costs(attn[2:], torch.tensor([0.25, 0.5]), zeros[:1], zeros[:1], values[2:], torch.ones(1, 2, t, d))
    assert torch.allclose(cost.kl[0], torch.zeros(2), atol=1e-9) and torch.equal(cost.kl[1], torch.zeros(2))
    assert (plain.kl > 0).all()
    torch.testing.assert_close(cost.kl[2], 2 * plain.kl[0])
    assert torch.equal(cost.mass[0], cost.mass[2])  # the mass sees none of this


def test_allocation_meets_the_mean_and_the_floor():
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([0.02, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0])
    steep = torch.rand(3, 4, 1, generator=gen) * 2  # [L, H, 1]: how much each head loses by eviction
    cost = steep * (1 - grid) ** 2
    base = torch.tensor([0.25, 0.25, 0.5])
    r = allocate_ratios(cost, base, floor=0.4, ratios=tuple(grid.tolist()))
    assert abs(float(r.mean()) - float(base.mean())) < 0.01
    assert (r >= 0.4 * base[:, None] - 1e-6).all()
    # the head that loses most keeps most
    assert r.flatten().argmax() == steep.flatten().argmax()


def test_calibrate_h2o_preset_writes_shares_that_generate(model, tmp_path):
    from click.testing import CliRunner

    from kvcompress.calib.calibrate import CalibrationSettings, calibrate
    from kvcompress.cli import main

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [3 + (ord(c) % 200) for c in text]}

    text = "".join(chr(97 + (i * 7919) % 26) + (" " if i % 5 == 0 else "") for i in range(600))
    settings = CalibrationSettings(preset="h2o-25", samples=2, seq_len=64, batch_size=2, head_windows=2)
    cfg = calibrate(model, Tok(), text, settings, progress=False)
    layers = sparse_h2o_layers(cfg)
    assert layers == [0, 1, 2]
    ratios = torch.tensor([[x * 0.25 for x in cfg.layers[i].sparsity.head_shares] for i in layers])
    assert ratios.shape == (3, 2) and abs(float(ratios.mean()) - 0.25) < 0.01
    assert cfg.notes["head_budgets"]["expected_kl"]["allocated"] <= cfg.notes["head_budgets"]["expected_kl"]["even"]
    cfg.save(tmp_path / "h.safetensors")
    shown = CliRunner().invoke(main, ["inspect", str(tmp_path / "h.safetensors")], env={"COLUMNS": "200"})
    assert shown.exit_code == 0, shown.output
    kl = cfg.notes["head_budgets"]["expected_kl"]
    assert f"expected KL (nats/position) {kl['even']:.4g} -> {kl['allocated']:.4g}" in shown.output
    ids = torch.randint(3, 256, (1, 48), generator=torch.Generator().manual_seed(0))
    with kvcompress.enabled(model):
        _, tokens = greedy(model, CompressedCache(model.config, str(tmp_path / "h.safetensors")), ids, 20)
    assert tokens.shape[1] == 21
    with pytest.raises(ConfigError, match="need full-precision H2O layers.*nuq4 has none"):
        calibrate(model, Tok(), text, CalibrationSettings(preset="nuq4", samples=2, seq_len=64, head_budgets=True),
                  progress=False)
