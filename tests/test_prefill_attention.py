"""Prefill attention a block of pages at a time (kvcompress/kernels/prefill_attention.py).

What these prove:
- `prefill_attention` equals causal attention over the layer's dense K/V (the drop-in path's input) for
  every codec family, GQA 3, a batch of 3 with left padding, chunks landing in the sinks, the body and
  the tail, and budgets small enough to force many blocks and row passes; float32: the two differ only in
  summation order (<= 1e-5 relative);
- under `kvcompress.enable` with the fused backend a prefill chunk of a compressed layer is deferred:
  the layer never decodes its dense K/V (`dense()` is not called), the chunk runs `prefill_attention`,
  and the model's logits equal the drop-in path's (1e-4 absolute, as in test_kernel_integration);
- a prefill chunk attends to its own K/V exactly, the tokens held before it as stored: `update` returns that,
  `prefill_attention(chunk=...)` reads it (the chunk split into blocks too), and a one-chunk prompt gives
  DynamicCache's logits through an int2 cache on every path;
- Quest layers (nothing evicted, no prefill scores) prefill the same way and give the torch path's logits;
  H2O layers keep the dense prefill (their policy scores it).
"""

from __future__ import annotations

import contextlib
from dataclasses import replace

import pytest
import torch

import kvcompress
from kvcompress.cache import CompressedCache
from kvcompress.compat import with_cache
from kvcompress.config import KVCompressConfig
from kvcompress.kernels.backend import triton_available
from kvcompress.kernels.prefill_attention import prefill_attention

from conftest import make_tiny_model

TOL = 1e-5


def reference(query, layer, scaling, row_starts=None, chunk=None):
    """Causal attention over layer.dense() in float32, GQA by repeating K/V; chunk: exact (K, V) of the newest
    positions, read in place of their stored form."""
    k, v = layer.dense()
    if chunk is not None:
        n = chunk[0].shape[2]
        k, v = torch.cat([k[:, :, :-n], chunk[0]], 2), torch.cat([v[:, :, :-n], chunk[1]], 2)
    b, hq, q, _ = query.shape
    g = hq // k.shape[1]
    k, v = k.float().repeat_interleave(g, 1), v.float().repeat_interleave(g, 1)
    held = k.shape[2]
    q_pos = torch.arange(held - q, held)
    ok = torch.arange(held)[None, :] <= q_pos[:, None]  # [q, held]
    ok = ok.expand(b, 1, q, held)
    if row_starts is not None:
        ok = ok & (torch.arange(held).view(1, 1, 1, -1) >= row_starts.view(b, 1, 1, 1))
    s = (query.float() @ k.transpose(-1, -2)) * scaling
    s = s.masked_fill(~ok, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see nothing: 0
    return p @ v


def small_pages(preset, config):
    """The preset with pages of 8 tokens, 3 sinks and a residual of 2, so a short prompt fills pages."""
    cfg = KVCompressConfig.from_preset(preset, config)
    layers = [replace(p, page_size=8, residual=2, sinks=3) for p in cfg.layers]
    return KVCompressConfig(layout=cfg.layout, layers=layers, name=f"{preset}-p8")


def filled_layer(preset, chunks, *, hkv=2, d=64, seed=0):
    """Layer 0 of a CompressedCache(preset, pages of 8) (tiny Llama shape, GQA 3) after appending `chunks`
    tokens."""
    config = make_tiny_model("llama", num_attention_heads=3 * hkv, num_key_value_heads=hkv,
                             hidden_size=3 * hkv * d).config
    cache = CompressedCache(config, small_pages(preset, config))
    g = torch.Generator().manual_seed(seed)
    for n in chunks:
        k = torch.randn(3, hkv, n, d, generator=g) * (1 + 4 * (torch.rand(d, generator=g) > 0.9))
        cache.layers[0].update(k, torch.randn(3, hkv, n, d, generator=g))
    return cache.layers[0]


@pytest.mark.parametrize("preset", ["int4", "nuq4", "fp8", "nuq3", "int2"])
@pytest.mark.parametrize("budget", [None, 48])
def test_equals_causal_attention_over_the_dense_cache(preset, budget):
    layer = filled_layer(preset, [3, 70, 41])  # sinks, pages of the body, a partly filled tail
    assert layer.key_store.n_pages >= 2 and layer.tail_k.shape[2] > 0
    q_len = 41
    query = torch.randn(3, 6, q_len, 64, generator=torch.Generator().manual_seed(7))
    starts = torch.tensor([0, 5, 90], dtype=torch.int32)  # none; inside the sinks..body; inside the chunk
    for row_starts in (None, starts):
        want = reference(query, layer, 0.125, row_starts)
        got = prefill_attention(query, layer, 0.125, row_starts, budget=budget)
        assert got.shape == want.shape
        assert (got - want).abs().max() <= TOL * want.abs().max(), (got - want).abs().max()


def layer_and_last_chunk(preset, chunks, seed=0):
    """filled_layer's layer after `chunks` tokens, and the exact (K, V) [3, 2, n, 64] of the last chunk."""
    layer = filled_layer(preset, chunks[:-1], seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    k = torch.randn(3, 2, chunks[-1], 64, generator=g) * (1 + 4 * (torch.rand(64, generator=g) > 0.9))
    v = torch.randn(3, 2, chunks[-1], 64, generator=g)
    return layer, (k, v), layer.update(k, v)


@pytest.mark.parametrize("preset", ["int2", "nuq4"])
def test_update_gives_a_prefill_chunk_its_own_tokens_exact(preset):
    """The drop-in path: a chunk of q > 1 tokens gets the tokens held before it as stored and its own q
    tokens as computed, though the layer stores them compressed (pages of the chunk went to the body)."""
    layer, (k, v), (got_k, got_v) = layer_and_last_chunk(preset, [3, 70, 41])
    dense_k, dense_v = layer.dense()
    assert layer.key_store.n_tokens > 73 - 3  # some of the chunk's tokens were encoded
    assert torch.equal(got_k[:, :, -41:], k) and torch.equal(got_v[:, :, -41:], v)
    assert torch.equal(got_k[:, :, :-41], dense_k[:, :, :-41])
    assert torch.equal(got_v[:, :, :-41], dense_v[:, :, :-41])
    assert not torch.equal(dense_k[:, :, -41:], k)  # what later steps read is the compressed form


@pytest.mark.parametrize("preset, budget", [("int2", None), ("nuq4", None), ("fp8", None), ("int4", 48)])
def test_a_given_chunk_is_attended_exactly(preset, budget):
    """prefill_attention(chunk=...) equals attention over the held-before tokens as stored and the chunk exact
    (the drop-in path's input), the chunk in blocks of the budget too; it differs from reading the chunk as
    stored."""
    layer, chunk, _ = layer_and_last_chunk(preset, [3, 70, 41])
    query = torch.randn(3, 6, 41, 64, generator=torch.Generator().manual_seed(7))
    starts = torch.tensor([0, 5, 90], dtype=torch.int32)
    for row_starts in (None, starts):
        want = reference(query, layer, 0.125, row_starts, chunk=chunk)
        got = prefill_attention(query, layer, 0.125, row_starts, budget=budget, chunk=chunk)
        assert (got - want).abs().max() <= TOL * want.abs().max(), (got - want).abs().max()
        stored = prefill_attention(query, layer, 0.125, row_starts, budget=budget)
        assert (stored - want).abs().max() > 100 * TOL * want.abs().max()


def test_small_budget_reads_many_blocks_and_row_passes(monkeypatch):
    """budget 48 with 3 x 2 (batch x kv heads): passes of 1 query row over blocks of one page (8 tokens)."""
    layer = filled_layer("int4", [3, 70, 41])
    calls = []
    real = layer.key_store.decode_pages
    monkeypatch.setattr(layer.key_store, "decode_pages",
                        lambda a, b, dt: calls.append((a, b)) or real(a, b, dt))
    query = torch.randn(3, 6, 41, 64)
    prefill_attention(query, layer, 0.125, budget=48)
    assert len(calls) == layer.key_store.n_pages  # one page per block at this budget
    assert sorted(calls) == [(p, p + 1) for p in range(layer.key_store.n_pages)]


def test_more_queries_than_held_tokens_is_an_error():
    layer = filled_layer("int4", [3, 10])
    with pytest.raises(ValueError, match="holds only"):
        prefill_attention(torch.randn(3, 6, 20, 64), layer, 0.125)


# -- wired into the kvcompress attention ----------------------------------------------------------------
needs_triton = pytest.mark.skipif(not triton_available(), reason="needs Triton (its interpreter on CPU)")


@needs_triton
@pytest.mark.parametrize("preset", ["nuq4", "int4"])
def test_enabled_prefill_is_deferred_and_equals_the_drop_in_path(preset, monkeypatch):
    import kvcompress.kernels.prefill_attention as pa

    monkeypatch.setenv("KVCOMPRESS_KERNELS", "triton")
    # One layer: its K/V come from the embeddings, so both runs store the same codes and the logits differ
    # only by summation order. A second layer's K/V would carry the first layer's attention rounding (SDPA
    # against prefill_attention, ~1e-7), which can flip a 4-bit code (an int4 value code flipped that way
    # under transformers 5.25 and moved later logits by 1e-3): a difference of inputs, not of the paths.
    model = make_tiny_model("llama", hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                            head_dim=64, intermediate_size=256, num_hidden_layers=1)
    ids = torch.randint(3, 256, (2, 90), generator=torch.Generator().manual_seed(3))
    chunks = [ids[:, :40], ids[:, 40:77], ids[:, 77:]]

    def run(enabled):
        cache = CompressedCache(model.config, small_pages(preset, model.config))
        out = []
        with torch.no_grad():
            if enabled:
                kvcompress.enable(model)
            try:
                for c in chunks:
                    out.append(model(c, **with_cache(cache)).logits)
            finally:
                kvcompress.disable(model)
        return torch.cat(out, 1), cache

    want, _ = run(False)
    calls = []
    real = pa.prefill_attention
    monkeypatch.setattr(pa, "prefill_attention", lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    dense_calls = []
    from kvcompress.cache import CompressedLayer

    real_dense = CompressedLayer.dense
    monkeypatch.setattr(CompressedLayer, "dense", lambda self: dense_calls.append(1) or real_dense(self))
    got, cache = run(True)
    assert len(calls) == len(chunks)  # every chunk
    assert not dense_calls  # the dense K/V was never built
    assert cache.layers[0].key_store.n_pages > 0
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


@pytest.mark.parametrize("kernels", [None, "torch", "triton"])
def test_a_one_chunk_prompt_gives_the_uncompressed_logits(kernels, monkeypatch):
    """A prompt prefilled in one chunk attends to its exact K/V whatever the cache stores: int2 gives
    DynamicCache's logits (bit-identical on the drop-in path, within the online softmax's rounding on the
    fused one), and the next chunk, which reads the int2 cache, does not."""
    if kernels == "triton" and not triton_available():
        pytest.skip("needs Triton (its interpreter on CPU)")
    from transformers import DynamicCache

    model = make_tiny_model("llama", hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                            head_dim=64, intermediate_size=256, num_hidden_layers=2)
    ids = torch.randint(3, 256, (2, 90), generator=torch.Generator().manual_seed(5))

    def run(cache):
        with torch.no_grad(), (kvcompress.enabled(model) if kernels else contextlib.nullcontext()):
            a = model(ids[:, :70], **with_cache(cache)).logits
            return a, model(ids[:, 70:], **with_cache(cache)).logits

    if kernels:
        monkeypatch.setenv("KVCOMPRESS_KERNELS", kernels)
    want_a, want_b = run(DynamicCache(config=model.config))
    cache = CompressedCache(model.config, small_pages("int2", model.config))
    got_a, got_b = run(cache)
    assert cache.layers[1].key_store.n_pages >= 7  # the prompt is stored in int2 pages
    if kernels == "triton":
        torch.testing.assert_close(got_a, want_a, atol=1e-5, rtol=1e-5)
    else:
        assert torch.equal(got_a, want_a)
    assert (got_b - want_b).abs().max() > 1e-3


@needs_triton
def test_quest_prefill_is_deferred_and_equals_the_torch_path(monkeypatch):
    """Quest evicts nothing and needs no prefill scores: its prefill chunks run `prefill_attention` too."""
    import kvcompress.kernels.prefill_attention as pa
    from kvcompress.config import SparsitySpec

    model = make_tiny_model("llama", hidden_size=384, num_attention_heads=6, num_key_value_heads=2,
                            head_dim=64, intermediate_size=256, num_hidden_layers=2)
    cfg = small_pages("nuq4", model.config)
    cfg = KVCompressConfig(layout=cfg.layout, name="nuq4-quest-p8", layers=[
        replace(p, sinks=8, residual=0, sparsity=SparsitySpec(method="quest", budget=24, page_size=8))
        for p in cfg.layers])
    ids = torch.randint(3, 256, (2, 80), generator=torch.Generator().manual_seed(4))

    def run(kernels):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", kernels)
        cache = CompressedCache(model.config, cfg)
        with torch.no_grad(), kvcompress.enabled(model):
            a = model(ids[:, :50], **with_cache(cache)).logits
            b = model(ids[:, 50:79], **with_cache(cache)).logits
            c = model(ids[:, 79:], **with_cache(cache)).logits  # a decode step: Quest reads a subset
        return torch.cat([a, b, c], 1), cache

    want, _ = run("torch")
    calls = []
    real = pa.prefill_attention
    monkeypatch.setattr(pa, "prefill_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    got, cache = run("triton")
    assert len(calls) == 2 * 2  # both prefill chunks of both layers
    assert cache.layers[1].sparse.tokens_read < 80
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-3)


@needs_triton
def test_sparse_layers_keep_the_dense_prefill(monkeypatch):
    import kvcompress.kernels.prefill_attention as pa

    monkeypatch.setenv("KVCOMPRESS_KERNELS", "triton")
    calls = []
    monkeypatch.setattr(pa, "prefill_attention", lambda *a, **k: calls.append(1))
    model = make_tiny_model("llama", num_hidden_layers=2)
    ids = torch.randint(3, 256, (1, 64))
    with torch.no_grad(), kvcompress.enabled(model):
        model(ids, **with_cache(CompressedCache(model.config, "h2o-50")))
    assert not calls
