"""DecodeGraph's fixed-address decode steps (kvcompress.graph), on a tiny random Llama.

On the CPU the steps run eagerly (use_graph=False) through the fused kernels in Triton's interpreter: the
same code a CUDA graph captures, with the tail's and the body's lengths read from device tensors and the
body in reserved buffers. What these prove:
- the logits of every step equal those of the growing cache on the same fused path (the pages are encoded
  at the same tokens: the page is taken before the step that fills the tail), across several page flushes,
  for the phase (nuq4, int4), fp8 and paged (nuq3) kernels;
- the buffers the kernels read never move while the graph holds the cache (a replay reads them by address);
- the layer's own view (held tokens, dense K/V, memory report) stays right, and `release()` hands back a
  growing cache that goes on equal to the reference;
- an H2O layer over quantized pages (nuq4+h2o-20) evicts between the steps as the growing layer does;
- a Quest layer over quantized pages (nuq4+quest-1024) reads the same pages as the growing layer;
- bad use is a clear ConfigError.
The CUDA graph itself (capture, replay) is tested on the GPU (tests/test_gpu.py).
Tolerance: the two paths read the same bytes; only the kernels' split plans differ (the graph plans for the
whole reservation), i.e. float32 summation order.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import kvcompress
from kvcompress import CompressedCache, ConfigError, DecodeGraph, KVCompressConfig
from kvcompress.compat import with_cache
from kvcompress.kernels.backend import triton_available

from conftest import make_tiny_model

pytestmark = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter on CPU)")

PROMPT = 29
ATOL, RTOL = 1e-4, 1e-3


@pytest.fixture(scope="module")
def model():
    m = make_tiny_model(
        "llama",
        hidden_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=256,
        num_hidden_layers=2,
    )
    kvcompress.enable(m)
    yield m
    kvcompress.disable(m)


@pytest.fixture(autouse=True)
def fused(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "triton")


def small_pages(model, preset: str, residual: int = 2) -> KVCompressConfig:
    """The preset with pages of 8 tokens and a short residual, so a few steps cross several page flushes."""
    cfg = KVCompressConfig.from_preset(preset, model.config)
    layers = [replace(p, page_size=8, residual=residual) for p in cfg.layers]
    return KVCompressConfig(layout=cfg.layout, layers=layers, name=f"{preset}-p8")


def tokens(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 256, (2, n), generator=torch.Generator().manual_seed(seed))


def prefilled(model, cfg, prompt):
    cache = CompressedCache(model.config, cfg)
    with torch.no_grad():
        model(prompt, **with_cache(cache))
    return cache


def steps_match_growing(model, ref, graph, new, mask):
    """Teacher-force new [B, n] through the growing cache `ref` (with generate's mask and positions, from the
    prompt's mask [B, T]) and through `graph`: every step's logits agree."""
    with torch.no_grad():
        for i in range(new.shape[1]):
            t = new[:, i : i + 1]
            mask = torch.cat([mask, torch.ones(mask.shape[0], 1, dtype=torch.long)], 1)
            step_pos = mask.sum(-1, keepdim=True) - 1
            want = model(t, attention_mask=mask, position_ids=step_pos, **with_cache(ref)).logits[:, -1]
            torch.testing.assert_close(graph.step(t), want, atol=ATOL, rtol=RTOL)


def graph_then_growing(model, ref, cache, graph, new, steps: int, extra, each_step) -> None:
    """Teacher-force new [B, n] through the growing cache `ref` and, for the first `steps`, through `graph`, then
    release it and go on with `cache` growing: every step's logits agree, each_step(i) runs after step i, and
    while the graph holds the cache layer 1's buffers (its pages, tail and `extra(layer)`) never move."""
    addresses = None
    with torch.no_grad():
        for i in range(new.shape[1]):
            if i == steps:
                graph.release()
            t = new[:, i : i + 1]
            want = model(t, **with_cache(ref)).logits[:, -1]
            got = graph.step(t) if i < steps else model(t, **with_cache(cache)).logits[:, -1]
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
            each_step(i)
            layer = cache.layers[1]
            if i < steps:
                now = [x.data_ptr() for x in (*layer.key_store.buffers.values(), layer.static.tail_k, extra(layer))]
                assert addresses is None or now == addresses
                addresses = now


@pytest.mark.parametrize("preset", ["nuq4", "int4", "fp8", "nuq3"])
def test_fixed_address_steps_equal_the_growing_cache(model, preset):
    steps = 14
    cfg, prompt, new = small_pages(model, preset), tokens(PROMPT), tokens(steps, seed=1)
    ref, cache = prefilled(model, cfg, prompt), prefilled(model, cfg, prompt)
    graph = DecodeGraph(model, cache, max_tokens=PROMPT + steps, use_graph=False)
    addresses = None
    with torch.no_grad():
        for i in range(steps):
            want = model(new[:, i : i + 1], **with_cache(ref)).logits[:, -1]
            got = graph.step(new[:, i : i + 1])
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
            layer = cache.layers[1]
            now = [t.data_ptr() for t in (*layer.key_store.buffers.values(), layer.static.tail_k)]
            assert addresses is None or now == addresses  # nothing the kernel reads has moved
            addresses = now
    assert graph.statics is not None and graph.eager_static_steps == steps
    assert cache.layers[1].key_store.n_pages > ref.layers[1].key_store.n_pages - 1 >= 3  # pages were flushed
    assert cache.get_seq_length() == ref.get_seq_length() == PROMPT + steps
    assert cache.layers[0].held_tokens == ref.layers[0].held_tokens
    assert (
        cache.memory_report()["held_bytes"] >= ref.memory_report()["held_bytes"]
    )  # the reservation is charged


@pytest.mark.parametrize("residual,prompt_len", [(2, 48), (16, 160)])  # a budget above the residual: pages held
def test_h2o_steps_equal_the_growing_cache(model, residual, prompt_len):
    """nuq4+h2o-20 (pages of 8): the graph's steps add the attention mass to a score buffer and the host evicts
    between steps. Every step's logits equal the growing cache's, the evictions keep the same positions with
    the same scores, the buffers the kernel reads never move, and the body's room is the budget's (plus a few
    pages), not max_tokens'. After release() the cache grows and evicts as the reference does."""
    steps, after = 20, 4
    cfg, prompt, new = small_pages(model, "nuq4+h2o-20", residual), tokens(prompt_len), tokens(steps + after, seed=6)
    ref, cache = prefilled(model, cfg, prompt), prefilled(model, cfg, prompt)
    graph = DecodeGraph(model, cache, max_tokens=prompt_len + steps, use_graph=False)
    body, evictions = [layer.key_store.n_tokens for layer in cache.layers], 0

    def count_evictions(i):
        nonlocal body, evictions
        now = [layer.key_store.n_tokens for layer in cache.layers]
        evictions += sum(n < was for n, was in zip(now, body))
        body = now

    graph_then_growing(model, ref, cache, graph, new, steps, lambda layer: layer.static.h2o.scores, count_evictions)
    assert evictions >= 2 and graph.eager_static_steps == steps
    for a, b in zip(ref.layers, cache.layers):
        assert a.held_tokens == b.held_tokens < 0.2 * (prompt_len + steps + after) + 2 * a.key_store.page_size
        torch.testing.assert_close(b.sparse.pos.long(), a.sparse.pos.long(), rtol=0, atol=0)
        torch.testing.assert_close(b.sparse.scores, a.sparse.scores)
        assert b.key_store.capacity < prompt_len + steps - b.sink_k.shape[2] - residual  # not max_tokens' room


def small_quest(model, budget: int, residual: int = 2, sinks: int = 0, **sparsity) -> KVCompressConfig:
    """nuq4+quest-1024 with pages of 8 (the body's and Quest's), a budget of `budget` tokens, every layer sparse."""
    cfg = KVCompressConfig.from_preset("nuq4+quest-1024", model.config)
    layers = [replace(p, page_size=8, residual=residual, sinks=sinks, sparsity=replace(
        p.sparsity, page_size=8, budget=budget, dense_layers=0, **sparsity)) for p in cfg.layers]
    return KVCompressConfig(layout=cfg.layout, layers=layers, name=f"quest-{budget}-p8")


@pytest.mark.parametrize("residual,prompt_len,sinks,ratio", [(2, 48, 0, 0.0), (16, 160, 8, 0.0), (2, 96, 0, 0.3)])
def test_quest_steps_equal_the_growing_cache(model, residual, prompt_len, sinks, ratio):
    """nuq4+quest (pages of 8, a 40-token budget: 2 to 4 pages read of up to 22, sink pages forced in; or 30 %
    of the context, the pages read growing with it): the graph's steps score the page summaries in their fixed
    buffers and take the top pages by device counts the host sets. Every step's logits equal the growing
    cache's, the tokens read are the growing layer's selection, the buffers never move, and after release()
    the layer's summaries and pending keys are the growing layer's, so it goes on equal. (With residual 0 a graph step reads the newest page exact, as for
    every graph: kvcompress.graph.static_layer.)"""
    steps, after = 20, 4
    cfg, new = small_quest(model, 0 if ratio else 40, residual, sinks, ratio=ratio), tokens(steps + after, seed=8)
    prompt = tokens(prompt_len)
    ref, cache = prefilled(model, cfg, prompt), prefilled(model, cfg, prompt)
    graph = DecodeGraph(model, cache, max_tokens=prompt_len + steps, use_graph=False)

    def same_tokens_read(i):
        for a, b in zip(ref.layers, cache.layers):
            assert b.sparse.tokens_read == a.sparse.tokens_read < a.held_tokens
            torch.testing.assert_close(b.sparse.read_index, a.sparse.read_index, rtol=0, atol=0)

    graph_then_growing(model, ref, cache, graph, new, steps, lambda layer: layer.static.quest.page_min,
                       same_tokens_read)
    assert graph.eager_static_steps == steps
    for a, b in zip(ref.layers, cache.layers):
        assert a.held_tokens == b.held_tokens == prompt_len + steps + after  # Quest evicts nothing
        for name in ("page_min", "page_max", "pending_keys"):
            torch.testing.assert_close(getattr(b.sparse, name), getattr(a.sparse, name), rtol=0, atol=0)


def test_release_gives_back_a_growing_cache(model):
    cfg, prompt, new = small_pages(model, "nuq4"), tokens(PROMPT), tokens(12, seed=2)
    ref, cache = prefilled(model, cfg, prompt), prefilled(model, cfg, prompt)
    graph = DecodeGraph(model, cache, max_tokens=PROMPT + 6, use_graph=False)
    with torch.no_grad():
        for i in range(12):
            want = model(new[:, i : i + 1], **with_cache(ref)).logits[:, -1]
            if i == 6:
                graph.release()
                assert all(layer.static is None for layer in cache.layers)
            got = (
                graph.step(new[:, i : i + 1])
                if i < 6
                else model(new[:, i : i + 1], **with_cache(cache)).logits[:, -1]
            )
            torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)
    for a, b in zip(ref.layers[0].dense(), cache.layers[0].dense()):
        torch.testing.assert_close(a, b)


def test_a_dropped_cache_is_freed_at_once(model):
    """No reference cycle between a layer and its StaticLayer: dropping the cache frees its buffers without
    waiting for the garbage collector (a cycle kept a whole cache alive in the benchmark)."""
    import gc
    import weakref

    cache = prefilled(model, small_pages(model, "nuq4"), tokens(PROMPT))
    graph = DecodeGraph(model, cache, max_tokens=PROMPT + 4, use_graph=False)
    with torch.no_grad():
        graph.step(tokens(1))
    buffer = weakref.ref(cache.layers[0].key_store.buffers["codes"])
    gc.disable()
    try:
        del cache, graph
        assert buffer() is None
    finally:
        gc.enable()


def test_steps_before_the_first_page_run_eagerly(model):
    """A prompt shorter than sinks + a page: the first steps grow the cache normally, then it goes static."""
    cfg, new = small_pages(model, "nuq4"), tokens(12, seed=3)
    cache = prefilled(model, cfg, tokens(5))
    graph = DecodeGraph(model, cache, max_tokens=5 + 12, use_graph=False)
    with torch.no_grad():
        graph.step(new[:, :1])
        assert graph.statics is None
        for i in range(1, 12):
            graph.step(new[:, i : i + 1])
    assert graph.statics is not None and cache.get_seq_length() == 17


def test_left_padded_batch(model):
    """Prompts of different lengths, left-padded as generate() pads them: with the prompt's mask, each row
    attends from its first real token and counts positions from there, as the growing cache does when
    fed generate()'s mask and positions. (The padded row is not compared with the prompt alone: its pages
    hold pad tokens too, which change their quantization ranges.)"""
    cfg, new = small_pages(model, "nuq4"), tokens(10, seed=4)
    prompt = tokens(PROMPT, seed=5)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :7] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    caches = [CompressedCache(model.config, cfg) for _ in range(2)]
    with torch.no_grad():
        for c in caches:
            model(prompt, attention_mask=mask, position_ids=pos, **with_cache(c))
        ref, cache = caches
        graph = DecodeGraph(model, cache, max_tokens=PROMPT + 10, use_graph=False, attention_mask=mask)
        steps_match_growing(model, ref, graph, new, mask)
    assert graph.statics is not None
    with pytest.raises(ConfigError, match="left padding"):
        holes = torch.ones(2, PROMPT, dtype=torch.long)
        holes[0, 5] = 0
        DecodeGraph(
            model, prefilled(model, cfg, prompt), max_tokens=64, use_graph=False, attention_mask=holes
        )


def test_bad_use_is_a_clear_error(model):
    cfg, prompt = small_pages(model, "nuq4"), tokens(PROMPT)
    cache = prefilled(model, cfg, prompt)
    with pytest.raises(ConfigError, match="max_tokens"):
        DecodeGraph(model, cache, max_tokens=PROMPT)
    graph = DecodeGraph(model, cache, max_tokens=PROMPT + 1, use_graph=False)
    with torch.no_grad():
        graph.step(tokens(1))
        with pytest.raises(ConfigError, match="max_tokens=30"):
            graph.step(tokens(1))
    with pytest.raises(ConfigError, match="use_graph=True needs a CUDA"):
        DecodeGraph(model, prefilled(model, cfg, prompt), max_tokens=64, use_graph=True)
    lossless = prefilled(model, KVCompressConfig.from_preset("none", model.config), prompt)
    with pytest.raises(ConfigError, match="lossless"):
        DecodeGraph(model, lossless, max_tokens=64, use_graph=False)
    sparse = prefilled(model, small_quest(model, 16, budget_sharing="heads"), prompt)
    with pytest.raises(ConfigError, match="sparse.*Quest with budget sharing"):
        DecodeGraph(model, sparse, max_tokens=64, use_graph=False)
    h2o, mask = prefilled(model, small_pages(model, "nuq4+h2o-20"), prompt), torch.ones(2, PROMPT, dtype=torch.long)
    mask[1, :3] = 0
    with pytest.raises(ConfigError, match="without padding"):
        DecodeGraph(model, h2o, max_tokens=64, use_graph=False, attention_mask=mask)
    with pytest.raises(ConfigError, match="prefill"):
        DecodeGraph(model, CompressedCache(model.config, cfg), max_tokens=64, use_graph=False)
    kvcompress.disable(model)
    try:
        with pytest.raises(ConfigError, match="kvcompress.enable"):
            DecodeGraph(model, prefilled(model, cfg, prompt), max_tokens=64, use_graph=False)
    finally:
        kvcompress.enable(model)


def test_a_cropped_cache_leaves_the_graph(model):
    cfg, prompt = small_pages(model, "nuq4"), tokens(PROMPT)
    cache = prefilled(model, cfg, prompt)
    graph = DecodeGraph(model, cache, max_tokens=64, use_graph=False)
    with torch.no_grad():
        graph.step(tokens(1))
        cache.crop(PROMPT - 3)
        with pytest.raises(ConfigError, match="left the decode graph"):
            graph.step(tokens(1))


@pytest.mark.compat  # transformers' decoding-method call differs between releases
def test_generate_with_the_graph_method(model):
    """model.generate(custom_generate=graph_generate): the same greedy tokens as transformers' own loop over
    the same cache preset on the same fused path, for a left-padded batch; sampling runs the configured
    logits processors (top_k=1 makes it greedy, so its tokens are known); an EOS stops its row and pads it,
    as transformers' loop does. Over nuq4+h2o-20 (evicting between steps) and Quest (1 or 2 pages of 8 read
    of up to 5), the same tokens as well, unpadded (a graph) and padded (eager steps)."""
    cfg = small_pages(model, "nuq4")
    prompt = tokens(PROMPT, seed=6)
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[0, :4] = 0
    kw = dict(input_ids=prompt, attention_mask=mask, max_new_tokens=12, pad_token_id=0)
    want = model.generate(**kw, do_sample=False, **with_cache(CompressedCache(model.config, cfg)))
    got = model.generate(
        **kw,
        do_sample=False,
        custom_generate=kvcompress.graph_generate,
        **with_cache(CompressedCache(model.config, cfg)),
    )
    assert got.shape == (2, PROMPT + 12) and torch.equal(got, want)
    sampled = model.generate(
        **kw,
        do_sample=True,
        top_k=1,
        custom_generate=kvcompress.graph_generate,
        **with_cache(CompressedCache(model.config, cfg)),
    )
    assert torch.equal(sampled, want)
    eos = int(want[1, PROMPT])  # row 1's first new token: that row stops at once
    want = model.generate(
        **kw, do_sample=False, eos_token_id=eos, **with_cache(CompressedCache(model.config, cfg))
    )
    stopped = model.generate(
        **kw,
        do_sample=False,
        eos_token_id=eos,
        custom_generate=kvcompress.graph_generate,
        **with_cache(CompressedCache(model.config, cfg)),
    )
    assert torch.equal(stopped, want) and (stopped[1, PROMPT + 1 :] == 0).all()
    # sparse caches: a graph for the unpadded batch, eager steps for the padded one
    for sparse in (small_pages(model, "nuq4+h2o-20"), small_quest(model, 24)):
        for m in (torch.ones_like(mask), mask):
            kw["attention_mask"] = m
            want = model.generate(**kw, do_sample=False, **with_cache(CompressedCache(model.config, sparse)))
            got = model.generate(**kw, do_sample=False, custom_generate=kvcompress.graph_generate,
                                 **with_cache(CompressedCache(model.config, sparse)))
            assert torch.equal(got, want)
    with pytest.raises(ConfigError, match="CompressedCache"):
        model.generate(**kw, custom_generate=kvcompress.graph_generate)


def test_cli_generate_with_the_graph(smollm2, monkeypatch):
    """`kvcompress generate --graph` on SmolLM2 (fused kernels in the interpreter, fixed-address steps): the
    same text as plain `kvcompress generate` over the same preset; without the fused backend, a clear error."""
    from click.testing import CliRunner

    from kvcompress.cli import main

    prompt = "The KV cache grows with the context, so long prompts need memory. " * 4  # > a page per layer
    args = ["generate", "smollm2-135m", prompt, "-p", "nuq4", "-n", "3", "--no-chat"]
    plain = CliRunner().invoke(main, args)
    assert plain.exit_code == 0, plain.output
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "triton")
    graphed = CliRunner().invoke(main, [*args, "--graph"])
    assert graphed.exit_code == 0, graphed.output
    assert "decode graph" in graphed.output
    assert graphed.output.splitlines()[0] == plain.output.splitlines()[0]
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "torch")
    refused = CliRunner().invoke(main, [*args, "--graph"])
    assert refused.exit_code != 0 and "fused Triton kernels" in refused.output


@pytest.mark.parametrize("padded", [False, True])
def test_mla_fixed_address_steps(padded):
    """A DeepSeek-V3 (MLA) model in the decode graph: the packed latent in reserved buffers read up to its
    length on the device, the sinks and the fixed tail buffer masked by the tail's length, left padding from
    the row starts; every step equals the growing cache's fused step, across page flushes."""
    from test_mla import MLA_DIMS

    mla = make_tiny_model("deepseek_v3", **MLA_DIMS)
    cfg = KVCompressConfig.from_preset("nuq4", mla.config)
    # a residual window, so that pages are encoded at the same tokens on both paths (see small_pages)
    layers = [replace(p, page_size=16, residual=2) for p in cfg.layers]
    cfg = KVCompressConfig(layout=cfg.layout, layers=layers, name="nuq4-p16")
    prompt, new, steps = tokens(PROMPT, seed=6), tokens(40, seed=7), 40
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    if padded:
        mask[1, :9] = 0
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    kvcompress.enable(mla)
    try:
        caches = [CompressedCache(mla.config, cfg) for _ in range(2)]
        with torch.no_grad():
            for c in caches:
                mla(prompt, attention_mask=mask, position_ids=pos, **with_cache(c))
            ref, cache = caches
            graph = DecodeGraph(mla, cache, max_tokens=PROMPT + steps, use_graph=False,
                                attention_mask=mask if padded else None)
            steps_match_growing(mla, ref, graph, new[:, :steps], mask)
    finally:
        kvcompress.disable(mla)
    assert graph.statics is not None and graph.eager_static_steps > 30
    assert cache.layers[1].key_store.n_pages >= 4  # pages were flushed while in the graph
