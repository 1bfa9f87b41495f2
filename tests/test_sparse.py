"""Sparsity through the kvcompress attention: H2O, StreamingLLM, SnapKV, Quest (kvcompress.sparse).

What these tests prove:
- with a budget covering the context every policy is exactly the uncompressed model (DynamicCache + sdpa);
- H2O keeps the top tokens by accumulated attention (from eager attention weights) plus its recent window;
- Quest's page bounds contain every key of their page; it reads the sinks' page, the newest page and
  the top pages by score, and the score lets a sharp query head of a GQA group get the page it needs;
  with a shared budget the layer's heads read k pages each on average, ranked across heads (a
  concentrated head leaves pages to a diffuse one), and a head's padding slots read nothing;
- a padded batch of 3 gives, row by row, what each row gives alone;
- H2O's memory stays bounded over hundreds of generated tokens, also over quantized pages, whose
  eviction gathers packed pages exactly;
- `enable` is scoped, and a sparse config without it raises an error naming the fix.
"""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model
from transformers import DynamicCache

import kvcompress
from kvcompress import (
    CompressedCache, ConfigError, KVCompressConfig, LayerPolicy, ModelLayout, QuantSpec, SparsitySpec,
)
from kvcompress.compat import with_cache
from kvcompress.sparse.quest import head_logits, page_bounds, page_scores, shared_pages
from kvcompress.sparse.state import StepInputs, bf16_outward


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny tensors: one thread avoids oversubscribing a shared CPU (10x faster on 2 busy cores)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def model():
    return make_tiny_model("llama", num_hidden_layers=3)


def sparse_config(model, spec: SparsitySpec, **policy) -> KVCompressConfig:
    layout = ModelLayout.from_model_config(model.config)
    layers = [LayerPolicy(sparsity=spec, **policy) for _ in range(layout.num_layers)]
    return KVCompressConfig(layout=layout, layers=layers)


def greedy(model, cache, ids, steps, attention_mask=None):
    """Prefill then greedy decode; returns per-step logits [B, steps + 1, V] and tokens [B, steps + 1]."""
    out = model.generate(
        ids, attention_mask=attention_mask, max_new_tokens=steps + 1, do_sample=False, output_logits=True,
        return_dict_in_generate=True, **with_cache(cache),
    )
    return torch.stack(out.logits, 1), out.sequences[:, ids.shape[1]:]


SPECS = {
    "h2o": lambda budget: SparsitySpec("h2o", budget=budget, page_size=8),
    # kv heads at 1x and 1.5x the budget, held packed (kvcompress.sparse.ragged)
    "h2o-heads": lambda budget: SparsitySpec("h2o", budget=budget, page_size=8, head_shares=[1.0, 1.5]),
    "h2o-merge": lambda budget: SparsitySpec("h2o", budget=budget, page_size=8, sinks=4, merge=True),
    "streaming": lambda budget: SparsitySpec("streaming", budget=budget, sinks=4, page_size=8),
    "snapkv": lambda budget: SparsitySpec("snapkv", budget=budget, observation_window=8, pool_kernel=3),
    "quest": lambda budget: SparsitySpec("quest", budget=budget, page_size=8),
    "quest-shared": lambda budget: SparsitySpec("quest", budget=budget, page_size=8, budget_sharing="heads"),
    "quest-layers": lambda budget: SparsitySpec("quest", budget=budget, page_size=8, budget_sharing="layers"),
    "quest-means": lambda budget: SparsitySpec("quest", budget=budget, page_size=8, unread_means=True),
}


@pytest.mark.parametrize("method", sorted(SPECS))
def test_budget_covering_the_context_is_exact(model, method):
    ids = torch.randint(3, 256, (1, 30), generator=torch.Generator().manual_seed(0))
    ref_logits, ref_tokens = greedy(model, DynamicCache(), ids, 20)
    with kvcompress.enabled(model):
        cache = CompressedCache(model.config, sparse_config(model, SPECS[method](64)))
        logits, tokens = greedy(model, cache, ids, 20)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)


def test_h2o_keeps_top_accumulated_attention_plus_recent(model):
    budget, recent, t = 20, 6, 48
    ids = torch.randint(3, 256, (2, t), generator=torch.Generator().manual_seed(1))
    model.set_attn_implementation("eager")
    try:
        attn = model(ids, output_attentions=True).attentions  # per layer [B, Hq, T, T]
    finally:
        model.set_attn_implementation("sdpa")
    spec = SparsitySpec("h2o", budget=budget, recent=recent)
    cache = CompressedCache(model.config, sparse_config(model, spec))
    with kvcompress.enabled(model):
        model(ids, **with_cache(cache))
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    for layer, a in zip(cache.layers, attn):
        b, hq, _, _ = a.shape
        score = a.sum(2).reshape(b, hq // groups, groups, t).sum(2)  # [B, H, T] summed per kv head's group
        heavy = score[..., : t - recent].topk(budget - recent, -1).indices
        window = torch.arange(t - recent, t).expand(b, hq // groups, recent)
        expected = torch.cat([heavy, window], -1).sort(-1).values
        assert torch.equal(layer.sparse.pos, expected), f"layer {layer.layer_idx} kept other tokens"
        assert layer.held_tokens == budget


def test_bf16_outward_rounding_is_the_nearest_bound():
    """Quest's bfloat16 page summaries: the min rounds down and the max up, by at most one bfloat16 step
    (exact values unchanged), across magnitudes, signs, zeros and subnormals."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(20000, generator=gen) * 10.0 ** torch.randint(-8, 8, (20000,), generator=gen).float()
    x = torch.cat([x, torch.tensor([0.0, -0.0, 1.0, -1.5, 1e-40, -1e-40]),
                   torch.randn(500, generator=gen).to(torch.bfloat16).float()])
    for down, toward in ((True, float("inf")), (False, float("-inf"))):
        r = bf16_outward(x, down)
        assert r.dtype == torch.bfloat16
        assert bool((r.float() <= x).all() if down else (r.float() >= x).all()), "not a bound"
        step = torch.nextafter(r, torch.full_like(r, toward)).float()  # one bfloat16 step back toward x
        nearest = ((step > x) if down else (step < x)) | (r.float() == x)
        assert bool(nearest.all()), "not the nearest"


def test_quest_bounds_contain_keys_and_top_pages_are_read(model):
    page, t = 8, 45
    ids = torch.randint(3, 256, (1, t), generator=torch.Generator().manual_seed(2))
    dense = DynamicCache()
    model(ids, **with_cache(dense))
    spec = SparsitySpec("quest", budget=21, page_size=page)
    cache = CompressedCache(model.config, sparse_config(model, spec))
    with kvcompress.enabled(model):
        model(ids, **with_cache(cache))
    for i, layer in enumerate(cache.layers):
        state = layer.sparse
        keys = layer.keys  # [B, H, T, D] after RoPE, full precision (nothing evicted)
        n_pages = t // page
        pages = keys[:, :, : n_pages * page].reshape(1, keys.shape[1], n_pages, page, -1)
        assert state.page_min.shape[2] == n_pages and state.page_min.dtype == torch.bfloat16
        assert bool((pages >= state.page_min[:, :, :, None]).all())
        assert bool((pages <= state.page_max[:, :, :, None]).all())
        # the bound is an upper bound of q.k for every key of the page and every query head of the group
        gen = torch.Generator().manual_seed(i)
        query = torch.randn(1, model.config.num_attention_heads, 1, keys.shape[-1], generator=gen)
        group = query.reshape(1, keys.shape[1], -1, keys.shape[-1])
        bound = page_bounds(group, state.page_min, state.page_max)  # [B, H, pages]
        qk = torch.einsum("bhgd,bhpsd->bhgps", group, pages).amax((2, 4))
        assert bool((qk <= bound + 1e-5).all())
        # a radius scale of 1 is exactly that bound
        torch.testing.assert_close(head_logits(group, state.page_min, state.page_max, 1.0).amax(2), bound)
        # selection: the first page (sinks), the newest (partial) page and the top pages by score
        scaling = keys.shape[-1] ** -0.5
        state.step = StepInputs(keys=keys, values=keys, q_len=1, scaling=scaling)
        mask = torch.ones(1, keys.shape[1], 1, t, dtype=torch.bool)
        idx = state.policy.select(state, query, mask)
        newest = t - n_pages * page  # 5 tokens in the partial page
        k = (21 - newest) // page
        real = torch.ones(1, keys.shape[1], n_pages, dtype=torch.bool)
        score = page_scores(group, state.page_min, state.page_max, real, scaling, state.policy.radius_scale)
        top = score[..., 1:].topk(k - 1, -1).indices + 1
        top = torch.cat([torch.zeros_like(top[..., :1]), top], -1).sort(-1).values
        expected = torch.cat([(top[..., None] * page + torch.arange(page)).flatten(2),
                              torch.arange(t - newest, t).expand(1, keys.shape[1], newest)], -1)
        assert torch.equal(idx, expected)


def test_quest_reads_the_page_a_sharp_head_needs_next_to_a_flat_head():
    """One kv head, two query heads: head 0 has large but flat logits (8.0 .. 7.3 over the pages),
    head 1 puts almost all its attention on page 5 (logit 6 against 0). Ranking pages by the max of
    the raw bounds reads head 0's largest pages and misses page 5, which holds half the group's
    attention mass; the summed per-head softmax reads it."""
    n_pages, d = 8, 2
    query = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])  # [B=1, H=1, G=2, D=2]
    flat = torch.linspace(8.0, 7.3, n_pages)
    sharp = torch.zeros(n_pages)
    sharp[5] = 6.0
    keys = torch.stack([flat, sharp], -1)[None, None]  # [1, 1, pages, D]: one key per page, min = max
    real = torch.ones(1, 1, n_pages, dtype=torch.bool)
    by_raw_bound = page_bounds(query, keys, keys).topk(3, -1).indices
    by_score = page_scores(query, keys, keys, real, scaling=1.0).topk(3, -1).indices
    assert 5 not in by_raw_bound.tolist()[0][0]  # the failure the summed softmax fixes
    assert 5 in by_score.tolist()[0][0]


def test_shared_budget_ranks_pages_across_heads():
    """k = 3 pages per head, 2 heads: head 0's estimated mass sits on page 1, head 1's is spread out. The 6
    pages go to the best estimates of either head (the sinks' pages, inf, always), at most
    max_share * k = 6 to one head; padding slots (-1) come first; pages of score -inf are never read;
    a total per row overrides k * H."""
    inf = float("inf")
    score = torch.tensor([[[inf, 0.9, 0.05, 0.03, 0.01, 0.02],
                           [inf, 0.31, 0.32, 0.33, 0.34, 0.35]]])
    pages, ranked = shared_pages(score, 3)
    assert pages.tolist() == [[[-1, -1, -1, -1, 0, 1], [-1, -1, 0, 3, 4, 5]]]
    assert ranked.shape == (1, 12) and bool((ranked[:, :-1] >= ranked[:, 1:]).all())
    # at most one share (3 pages) per head: head 0 gets its third best page back from head 1
    assert shared_pages(score, 3, max_share=1.0)[0].tolist() == [[[0, 1, 2], [0, 4, 5]]]
    # two rows, 4 and 8 pages in all
    two = torch.cat([score, score])
    assert shared_pages(two, 3, total=torch.tensor([4, 8]))[0].tolist() == [
        [[-1, -1, -1, -1, 0, 1], [-1, -1, -1, -1, 0, 5]], [[-1, -1, -1, -1, 0, 1], [0, 1, 2, 3, 4, 5]]]
    score[0, 0, 2:] = -inf  # pages of padding
    assert shared_pages(score, 3, max_share=1.0)[0].tolist() == [[[-1, 0, 1], [0, 4, 5]]]
    assert shared_pages(score, 0)[0].shape == (1, 2, 0)


def test_layer_allocator_splits_the_step_by_the_previous_estimates():
    """Three layers of k * H = 4 pages: 12 pages a step in all. Before any record the split is even; then
    each layer gets low * 4 = 2 pages and the other 6 go to the highest recorded estimates, at most
    high * 4 = 8 to one layer."""
    from kvcompress.sparse.quest import LayerAllocator

    alloc = LayerAllocator([2, 3, 4], low=0.5, high=2.0)
    assert alloc.pages(2, 4, 1) == 4  # nothing recorded yet
    spread = torch.full((1, 8), 0.4)  # layer 2: flat estimates
    sharp = torch.tensor([[2.0, 0.5, 0.01, 0.01, 0.0, 0.0, 0.0, 0.0]])  # layer 3: two pages hold it
    alloc.record(2, spread)
    alloc.record(3, sharp)
    alloc.record(4, sharp * 0.5)
    split = [int(alloc.pages(i, 4, 1)) for i in (2, 3, 4)]
    assert split == [8, 2, 2] and sum(split) == 12
    alloc.record(2, spread * 0.1)  # the next step: layer 3's third to fifth pages beat layer 2's
    alloc.record(3, torch.tensor([[2.0, 0.5, 0.05, 0.05, 0.05, 0.0, 0.0, 0.0]]))
    alloc.record(4, sharp * 0.5)
    assert [int(alloc.pages(i, 4, 1)) for i in (2, 3, 4)] == [5, 5, 2]
    alloc.reset()
    assert alloc.pages(2, 4, 1) == 4


def test_shared_budget_reads_the_selection_and_counts_it(model):
    """Through the model: each decode step's index holds k whole pages per head on average plus the newest
    page, -1 padding included; attention over it equals attention masked to the selected tokens, and
    tokens_read counts only real slots."""
    import copy

    from kvcompress.sparse.attention import attend_torch

    page, budget, t = 8, 29, 60
    ids = torch.randint(3, 256, (1, t), generator=torch.Generator().manual_seed(11))
    model = copy.deepcopy(model)
    attn = model.model.layers[-1].self_attn
    with torch.no_grad():  # kv head 0 of the last layer gets much wider logits than head 1
        attn.k_proj.weight[: attn.head_dim] *= 30.0
    spec = SparsitySpec("quest", budget=budget, page_size=page, budget_sharing="heads")
    cache = CompressedCache(model.config, sparse_config(model, spec))
    seen = {}
    orig = attend_torch.__globals__["gather_step"]

    def spy(step):
        if step.index is not None and step.q_len == 1:
            seen["step"] = StepInputs(keys=step.keys, values=step.values, q_len=1, mask=step.mask, index=step.index)
        return orig(step)

    attend_torch.__globals__["gather_step"] = spy
    try:
        with kvcompress.enabled(model):
            model(ids[:, :-1], **with_cache(cache))
            model(ids[:, -1:], **with_cache(cache))
    finally:
        attend_torch.__globals__["gather_step"] = orig
    step, layer = seen["step"], cache.layers[-1]
    held, newest = t, t % page or page
    k = (budget - newest) // page
    idx = step.index  # [B, H, n]
    h = idx.shape[1]
    real = idx >= 0
    assert bool((idx[..., -newest:] == torch.arange(held - newest, held)).all())
    assert int(real[..., :-newest].sum()) == k * page * h  # the layer reads k pages per head
    assert bool((idx == 0).any(-1).all())  # every head reads the sinks' page
    assert int(real[0, 0].sum()) != int(real[0, 1].sum())  # the heads read different numbers of pages
    assert layer.sparse.tokens_read == k * page + newest
    # padding slots read nothing: the same attention as a mask over the held tokens
    query = torch.randn(1, model.config.num_attention_heads, 1, step.keys.shape[-1])
    selected = torch.zeros(1, h, held, dtype=torch.bool).scatter(2, idx.clamp_min(0), real)
    fake = lambda s: type("L", (), {"sparse": type("S", (), {"step": s, "policy": layer.sparse.policy})()})()
    out, _ = attend_torch(query, fake(step), 0.125)
    masked = StepInputs(keys=step.keys, values=step.values, q_len=1, mask=step.mask & selected[:, :, None])
    ref, _ = attend_torch(query, fake(masked), 0.125)
    torch.testing.assert_close(out, ref)


def test_layers_sharing_the_budget_read_the_even_total_each_step(model):
    """budget_sharing="layers": after the first decode step the layers read different numbers of pages, but
    the step's mean over layers stays the even share: k pages per head plus the newest page."""
    page, budget, prompt = 8, 29, 52
    spec = SparsitySpec("quest", budget=budget, page_size=page, budget_sharing="layers")
    cache = CompressedCache(model.config, sparse_config(model, spec))
    splits = []
    with kvcompress.enabled(model):
        for i, _ in enumerate(decode_steps(model, cache, 12, prompt)):
            held = prompt + i + 1
            newest = held % page or page
            k = (budget - newest) // page
            assert cache.tokens_read_last_step() == pytest.approx(k * page + newest)
            splits.append([layer.sparse.tokens_read for layer in cache.layers])
    assert any(len(set(s)) > 1 for s in splits[1:])  # the split is not the even one


@pytest.mark.parametrize("method", sorted(SPECS))
def test_padded_batch_rows_match_rows_alone(model, method):
    # padding of 0, 16, 8: whole Quest pages of 8. Quest's pages, like a quantized layer's, sit on the batch's
    # slot grid, so a row equals itself alone where its padding is whole pages; the evicting policies are
    # checked with uneven padding too (test_padded_rows_evict_as_they_would_alone)
    lengths, steps = (40, 24, 32), 12
    gen = torch.Generator().manual_seed(3)
    rows = [torch.randint(3, 256, (1, n), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.cat([torch.nn.functional.pad(r, (width - r.shape[1], 0), value=0) for r in rows])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(r), (width - r.shape[1], 0)) for r in rows])
    cfg = sparse_config(model, SPECS[method](16))
    with kvcompress.enabled(model):
        batch_logits, batch_tokens = greedy(model, CompressedCache(model.config, cfg), ids, steps, mask)
        for i, r in enumerate(rows):
            logits, tokens = greedy(model, CompressedCache(model.config, cfg), r, steps)
            assert torch.equal(batch_tokens[i], tokens[0]), f"row {i} generated other tokens in the batch"
            torch.testing.assert_close(batch_logits[i], logits[0], atol=1e-4, rtol=0)


EVICTING = ["h2o", "h2o-heads", "streaming", "snapkv"]


@pytest.mark.parametrize("budget", ["tokens", "ratio"])
@pytest.mark.parametrize("method", EVICTING)
def test_padded_rows_evict_as_they_would_alone(model, method, budget):
    """Uneven padding (29 and 13 slots), a row shorter than the budget, budgets as a ratio of each row's own
    context: every row generates what it generates alone. A row over its budget evicts to it even while
    a longer row needs the slots (those slots go dead, masked); a row under its budget keeps everything."""
    lengths, steps = (40, 11, 27), 24
    spec = SPECS[method](16)
    if budget == "ratio":
        spec = SparsitySpec(**{**spec.__dict__, "budget": 0, "ratio": 0.5})
    gen = torch.Generator().manual_seed(5)
    rows = [torch.randint(3, 256, (1, n), generator=gen) for n in lengths]
    width = max(lengths)
    ids = torch.cat([torch.nn.functional.pad(r, (width - r.shape[1], 0), value=0) for r in rows])
    mask = torch.cat([torch.nn.functional.pad(torch.ones_like(r), (width - r.shape[1], 0)) for r in rows])
    cfg = sparse_config(model, spec)
    with kvcompress.enabled(model):
        batch = CompressedCache(model.config, cfg)
        batch_logits, batch_tokens = greedy(model, batch, ids, steps, mask)
        held = batch.layers[0].held_tokens
        for i, r in enumerate(rows):
            logits, tokens = greedy(model, CompressedCache(model.config, cfg), r, steps)
            n = tokens.shape[1]  # alone, a row stops at its end-of-sequence token; in the batch it pads after
            assert torch.equal(batch_tokens[i, :n], tokens[0]), f"row {i} generated other tokens in the batch"
            torch.testing.assert_close(batch_logits[i, :n], logits[0], atol=1e-4, rtol=0)
    # the batch holds no more slots than its longest row alone would (+ the page of slack)
    largest = max(spec.head_shares or [1.0])  # the largest head's share of the budget
    assert held <= width + steps if method == "snapkv" else held <= largest * max(16, (width + steps) // 2) + 8 + 1


def decode_steps(model, cache, steps: int, prompt: int = 40):
    """Prefill `prompt` random tokens then feed `steps` random tokens one by one; yields after each step."""
    gen = torch.Generator().manual_seed(4)
    model(torch.randint(3, 256, (1, prompt), generator=gen), **with_cache(cache))
    for _ in range(steps):
        model(torch.randint(3, 256, (1, 1), generator=gen), **with_cache(cache))
        yield


@pytest.mark.parametrize("quantized", [False, True], ids=["full-precision", "nuq4-pages"])
def test_h2o_memory_stays_bounded(model, quantized):
    budget, page = 32, 8
    policy = {}
    if quantized:
        policy = dict(key=QuantSpec("nuq", bits=4, axis="channel", outlier_fraction=0.02),
                      value=QuantSpec("nuq", bits=4, axis="token", outlier_fraction=0.02),
                      page_size=page, sinks=4)
    spec = SparsitySpec("h2o", budget=budget, page_size=page)
    cache = CompressedCache(model.config, sparse_config(model, spec, **policy))
    # quantized: sinks, the tail (< one page, residual 0) and the recent window's pages stay, whole pages go
    limit = budget + page + (page if quantized else 0)
    held, nbytes = [], []
    with torch.inference_mode(), kvcompress.enabled(model):
        for _ in decode_steps(model, cache, 300):
            held.append(max(layer.held_tokens for layer in cache.layers))
            nbytes.append(cache.memory_report()["held_bytes"])
    assert max(held) <= limit, f"a layer held {max(held)} tokens, more than {limit}"
    assert cache.layers[0].get_seq_length() == 340  # positions keep counting what was seen
    # flat: the last 200 steps never hold more bytes than steps 20-100 did
    assert max(nbytes[100:]) <= max(nbytes[20:100])


def test_page_eviction_over_quantized_storage_is_exact(model):
    """Evicting whole packed pages keeps the kept tokens' codes: decode == the same tokens never evicted."""
    quant = dict(key=QuantSpec("int", bits=4, axis="channel"), value=QuantSpec("nuq", bits=4, axis="token",
                 outlier_fraction=0.02), page_size=8, sinks=2)
    ids = torch.randint(3, 256, (2, 60), generator=torch.Generator().manual_seed(5))
    layout = ModelLayout.from_model_config(model.config)
    full_cfg = KVCompressConfig(layout=layout, layers=[LayerPolicy(**quant)] * layout.num_layers)
    full = CompressedCache(model.config, full_cfg)
    spec = SparsitySpec("h2o", budget=24, page_size=8)
    sparse = CompressedCache(model.config, sparse_config(model, spec, **quant))
    model(ids, **with_cache(full))
    with kvcompress.enabled(model):
        model(ids, **with_cache(sparse))
    # layer 0 sees the same inputs in both caches, so its codes (and frozen statistics) are the same
    k_all, v_all = full.layers[0].dense()
    k, v = sparse.layers[0].dense()
    pos = sparse.layers[0].sparse.pos
    assert k.shape[2] < k_all.shape[2]
    assert torch.equal(k, k_all.gather(2, pos[..., None].expand_as(k)))
    assert torch.equal(v, v_all.gather(2, pos[..., None].expand_as(v)))


def test_enable_is_scoped(model):
    assert model.config._attn_implementation == "sdpa"
    with kvcompress.enabled(model):
        assert model.config._attn_implementation == "kvcompress"
    assert model.config._attn_implementation == "sdpa"
    eager = make_tiny_model("llama", attn_implementation="eager")
    kvcompress.enable(eager)
    assert eager.model.layers[0].self_attn.config._attn_implementation == "kvcompress"
    kvcompress.disable(eager)
    assert eager.config._attn_implementation == "eager"


def test_enabled_block_inside_an_earlier_enable_restores_its_backend(model):
    """`with enabled(model, B)` on a model enabled with A leaves A (its backend and its forward hooks)
    on exit, and the model still enabled; `disable` then restores the original attention."""
    attn = model.model.layers[0].self_attn
    kvcompress.enable(model, "torch")
    try:
        torch_fn = attn._kvcompress_backend
        assert model._kvcompress_hooks is None  # "torch": no fused-path hooks
        with kvcompress.enabled(model):  # "fused"
            assert attn._kvcompress_backend is not torch_fn and model._kvcompress_hooks is not None
        assert attn._kvcompress_backend is torch_fn and model._kvcompress_hooks is None
        assert model.config._attn_implementation == "kvcompress"
    finally:
        kvcompress.disable(model)
    assert model.config._attn_implementation == "sdpa"


def test_sparse_config_without_enable_names_the_fix(model):
    ids = torch.randint(3, 256, (1, 12))
    with pytest.raises(ConfigError, match=r"kvcompress\.enable\(model\)"):
        model(ids, **with_cache(CompressedCache(model.config, "h2o-20")))
    # quantization-only configs keep working with any attention implementation
    model(ids, **with_cache(CompressedCache(model.config, "nuq4")))


@pytest.mark.parametrize("preset", ["streaming", "h2o-20", "h2o-merge-50", "snapkv-50", "quest-512",
                                    "nuq4+h2o-20", "nuq4+quest-1024", "pyramid-h2o-20", "quest-25", "h2o-25"])
def test_presets_run_and_report_tokens_read(model, preset):
    cache = CompressedCache(model.config, preset)
    with kvcompress.enabled(model):
        ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(6))
        logits, _ = greedy(model, cache, ids, 4)
    assert torch.isfinite(logits).all()
    assert 0 < cache.tokens_read_last_step() <= 45


def test_smollm2_h2o_budget_covering_context_is_exact(smollm2):
    model, tokenizer = smollm2
    ids = tokenizer("The capital of France is Paris. The capital of Italy is", return_tensors="pt").input_ids
    ref_logits, ref_tokens = greedy(model, DynamicCache(config=model.config), ids, 6)
    cfg = sparse_config(model, SparsitySpec("h2o", budget=256))
    with kvcompress.enabled(model):
        logits, tokens = greedy(model, CompressedCache(model.config, cfg), ids, 6)
    assert torch.equal(tokens, ref_tokens)
    torch.testing.assert_close(logits, ref_logits, atol=1e-4, rtol=0)


def test_bytes_read_per_step_follow_the_selection(model):
    """What `kvcompress eval` reports as KV read per step. A cache without a selection reads all it holds;
    Quest over nuq4 pages reads its exact windows and every page summary, plus only the selected body
    pages: less than it holds, more with a larger budget, everything once the budget covers the context."""
    from kvcompress.memory import storage_bytes

    ids = torch.randint(3, 256, (1, 90), generator=torch.Generator().manual_seed(8))
    quant = dict(key=QuantSpec(method="nuq", bits=4, axis="page"), value=QuantSpec(method="nuq", bits=4, axis="token"),
                 page_size=8, residual=8, sinks=2)
    plain = CompressedCache(model.config, sparse_config(model, SparsitySpec(), **quant))
    greedy(model, plain, ids, 3)
    assert plain.bytes_read_last_step() == plain.memory_report()["held_bytes"]
    read = {}
    for budget in (24, 48, 200):
        cache = CompressedCache(model.config, sparse_config(model, SparsitySpec("quest", budget=budget, page_size=8),
                                                            **quant))
        with kvcompress.enabled(model):
            greedy(model, cache, ids, 3)
        held = cache.memory_report()["held_bytes"]
        read[budget] = cache.bytes_read_last_step()
        floor = sum(layer.memory().window_bytes + storage_bytes(layer.sparse.tensors()) for layer in cache.layers)
        if budget < 94:
            assert floor < read[budget] < held
        else:
            assert read[budget] == held
    assert read[24] < read[48]


def test_quest_page_list_skips_padding_pages():
    """The fused kernel's page list for a budget-sharing selection: padding pages (-1) list -1, which the
    kernels skip, like the exact tail (the kernel reads it whole), which ends every selection."""
    from types import SimpleNamespace

    from kvcompress.kernels.attention_backend import quest_page_list

    layer = SimpleNamespace(key_store=SimpleNamespace(page_size=4, n_pages=4), held_tokens=22,
                            sink_k=torch.zeros(1, 1, 0, 8), tail_k=torch.zeros(1, 1, 6, 8))
    index = torch.tensor([[[-1] * 4 + [0, 1, 2, 3] + [12, 13, 14, 15] + list(range(16, 22))]])  # + the tail
    assert quest_page_list(layer, index).tolist() == [[[-1, 0, 3, -1]]]


def test_nuq4_quest_preset_is_served_by_the_fused_kernel(model):
    """nuq4+quest-1024's Quest pages are its packed body pages (no separate sinks), which is what the fused
    decode kernel needs to read only the selected pages; the first two layers stay dense."""
    from kvcompress.kernels.attention_backend import fused_supported

    cache = CompressedCache(model.config, "nuq4+quest-1024")
    ids = torch.randint(3, 256, (1, 150), generator=torch.Generator().manual_seed(9))
    with kvcompress.enabled(model):
        model(ids, **with_cache(cache))
    layer = cache.layers[2]
    assert layer.key_store.n_pages == 2 and layer.sparse.policy.page_size == layer.key_store.page_size == 64
    assert fused_supported(layer)
    assert cache.layers[0].sparse is None and cache.layers[1].sparse is None


def test_quest_25_preset_shares_the_step_across_layers():
    """The quest-25 preset: every layer sparse at 25 % in pages of 4, all of them on one LayerAllocator."""
    m = make_tiny_model("llama")
    cache = CompressedCache(m.config, "quest-25")
    policies = [layer.sparse.policy for layer in cache.layers]
    assert all(p.budget_sharing == "layers" and p.page_size == 4 and p.ratio == 0.25 for p in policies)
    assert policies[0].allocator is not None and all(p.allocator is policies[0].allocator for p in policies)


@torch.no_grad()
def on_both_backends(model, cfg, ids, prompt: int, monkeypatch) -> dict:
    """Prefill `prompt` tokens of ids, then feed the rest one by one, on the torch backend then on Triton:
    {backend: (last-token logits of each forward [steps + 1, B, V], the cache)}."""
    out = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", backend)
        with kvcompress.enabled(model):
            cache = CompressedCache(model.config, cfg)
            steps = [model(ids[:, :prompt], **with_cache(cache)).logits[:, -1]]
            for i in range(prompt, ids.shape[1]):
                steps.append(model(ids[:, i:i + 1], **with_cache(cache)).logits[:, -1])
        out[backend] = torch.stack(steps), cache
    return out


@torch.no_grad()
def test_quest_over_a_residual_window_reads_the_same_on_both_backends(model, monkeypatch):
    """Quest over nuq4 with exact sinks and a 16-token exact tail: every step reads the sinks and the whole
    tail beside the selected pages, on the torch backend as in the fused kernel (which is given only the
    body pages), so the two backends' logits agree over decode steps that fill and flush the tail."""
    import os
    from dataclasses import replace

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 to test the Triton kernel on CPU")
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    from kvcompress.kernels import attention_backend

    base = KVCompressConfig.from_preset("nuq4+quest-1024", model.config)
    spec = replace(base.layers[-1].sparsity, budget=48, page_size=16, dense_layers=0)
    layers = [replace(p, page_size=16, sinks=16, residual=16, sparsity=spec) for p in base.layers]
    cfg = KVCompressConfig(layout=base.layout, layers=layers, name="nuq4-quest-r16")
    ids = torch.randint(3, 256, (1, 140), generator=torch.Generator().manual_seed(12))
    lists, page_list = [], attention_backend.quest_page_list

    def spy(layer, index):
        lists.append(page_list(layer, index))
        return lists[-1]

    monkeypatch.setattr(attention_backend, "quest_page_list", spy)
    runs, read = {}, {}
    for backend, (runs[backend], cache) in on_both_backends(model, cfg, ids, 100, monkeypatch).items():
        read[backend] = cache.tokens_read_last_step()
        layer = cache.layers[-1]
        held, n_tail = layer.held_tokens, layer.tail_k.shape[2]
        index = layer.sparse.read_index[0, 0].tolist()
        assert n_tail > 0 and index[-n_tail:] == list(range(held - n_tail, held))  # the whole exact tail
        assert set(range(16)) <= set(index)  # the exact sinks
    assert lists and all(pl.shape[-1] < 8 for pl in lists)  # the kernel got a page list, not every page
    assert read["torch"] == read["triton"] < 140
    assert (runs["triton"] - runs["torch"]).abs().max() / runs["torch"].abs().max() < 1e-3


@torch.no_grad()
@pytest.mark.parametrize("method", ["h2o", "h2o-heads", "streaming", "snapkv"])
def test_full_precision_evicting_layers_decode_on_the_fused_kernel(model, method, monkeypatch):
    """A full-precision H2O / StreamingLLM / SnapKV layer's decode steps run the fused kernel over its held
    tokens, read in place (their whole pages as a body view, kvcompress.kernels.parts.dense_parts; with
    per-kv-head budgets the packed heads, each from its own offset, ragged_parts): the kernel is called on
    every decode step, the logits match the torch backend's, and H2O's attention mass from the kernel keeps
    the same tokens (the same positions held) as the torch reference's."""
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 to test the Triton kernel on CPU")
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    import kvcompress.kernels.decode_attention_triton as fused
    from kvcompress.sparse.ragged import RaggedHeads

    cfg = sparse_config(model, SPECS[method](24))
    ids = torch.randint(3, 256, (2, 70), generator=torch.Generator().manual_seed(13))
    calls, kernel = [], fused.decode_attention_triton

    def spy(q, parts, *args, **kwargs):
        calls.append(parts.n_body)
        return kernel(q, parts, *args, **kwargs)

    monkeypatch.setattr(fused, "decode_attention_triton", spy)
    padded, view = [], RaggedHeads.padded  # who builds the zero-padded view of a layer's per-head tokens

    def watch(self):
        padded.append(os.environ["KVCOMPRESS_KERNELS"])
        return view(self)

    monkeypatch.setattr(RaggedHeads, "padded", watch)
    runs, held = {}, {}
    for backend, (runs[backend], cache) in on_both_backends(model, cfg, ids, 40, monkeypatch).items():
        held[backend] = [layer.sparse.positions(layer.held_tokens, layer.tail_k) for layer in cache.layers]
    n_layers = len(cache.layers)
    assert len(calls) == 30 * n_layers and max(calls) >= 16  # every decode step of every layer; a body view
    if method == "h2o-heads":
        assert all(layer.ragged is not None for layer in cache.layers)  # the heads' own counts, packed
        # the torch attention reads a padded view; the kernel's steps and the evictions read the packed tokens
        assert "torch" in padded and "triton" not in padded
    assert (runs["triton"] - runs["torch"]).abs().max() / runs["torch"].abs().max() < 1e-4
    for a, b in zip(held["torch"], held["triton"]):
        assert torch.equal(a, b)


def test_full_precision_sparse_layer_appends_in_place(model):
    """A full-precision H2O layer writes each decode token into its buffer's free slots (the held tokens are
    a view of one buffer between evictions, not a copy per step), lets the buffer go when an eviction
    gathers what it keeps, and memory_report counts the buffer's free slots too (which a step does not read)."""
    from kvcompress.memory import storage_bytes

    cache = CompressedCache(model.config, sparse_config(model, SparsitySpec("h2o", budget=24, page_size=8)))
    layer, previous, evictions, reused = cache.layers[0], None, 0, 0
    with torch.inference_mode(), kvcompress.enabled(model, "torch"):
        for _ in decode_steps(model, cache, 40):
            payload = layer.memory().payload_bytes
            if layer.room_k is None:  # this step evicted: the layer holds what the gather kept, nothing more
                evictions += 1
                assert payload == layer.tail_k.untyped_storage().nbytes() + layer.tail_v.untyped_storage().nbytes()
            else:
                assert layer.tail_k.data_ptr() == layer.room_k.data_ptr()  # a view of the buffer
                assert layer.room_k.shape[2] > layer.held_tokens  # with free slots, which are counted
                assert payload == layer.room_k.untyped_storage().nbytes() + layer.room_v.untyped_storage().nbytes()
                reused += layer.room_k is previous
                # a step reads the held tokens (and H2O's positions and scores), not the free slots
                tokens = (layer.tail_k.numel() + layer.tail_v.numel()) * layer.tail_k.element_size()
                assert layer.bytes_read_last_step() == tokens + storage_bytes(layer.sparse.tensors())
            previous = layer.room_k
    assert 4 <= evictions <= 6 and reused >= 25  # an eviction every 8 steps; one buffer in between
