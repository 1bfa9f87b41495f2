"""The Cache operations generate() relies on behave like DynamicCache's.

Lossless: after the same random states and the same operation (batch_repeat_interleave,
batch_select_indices, reorder_cache, reset, crop), a "none" CompressedCache holds exactly what
DynamicCache holds and reports the same get_seq_length / get_mask_sizes, for full and sliding layers.
Quantized (small pages so that the packed body is used): the batch operations commute with decoding,
and crop(-n) cuts into the packed body without changing any kept value. A store with reserved room
writes its pages in place and holds what a growing store holds.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, Gemma3TextConfig, LlamaConfig

from kvcompress import CompressedCache, LayerPolicy, QuantSpec
from kvcompress.cache import CompressedLayer

pytestmark = pytest.mark.compat

B, H, D = 4, 2, 16


def llama_config():
    return LlamaConfig(
        vocab_size=64,
        hidden_size=H * 2 * D,
        num_hidden_layers=3,
        num_attention_heads=2 * H,
        num_key_value_heads=H,
    )


def gemma3_config():
    """Sliding (window 6) and full layers; the tests run past the window."""
    return Gemma3TextConfig(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2 * H,
        num_key_value_heads=H,
        head_dim=D,
        sliding_window=6,
        layer_types=["sliding_attention", "full_attention"],
    )


CONFIGS = {"llama": llama_config, "gemma3": gemma3_config}


def random_states(n_layers, batch, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    return [
        (torch.randn(batch, H, tokens, D, generator=g), torch.randn(batch, H, tokens, D, generator=g))
        for _ in range(n_layers)
    ]


def feed(caches, batch, tokens, seed):
    """The same random states [batch, H, tokens, D] into every layer of every cache."""
    n_layers = len(caches[0].layers)
    for i, (k, v) in enumerate(random_states(n_layers, batch, tokens, seed)):
        outs = [c.update(k, v, i) for c in caches]
        for out in outs[1:]:
            assert torch.equal(out[0], outs[0][0]), f"update output keys, layer {i}"
            assert torch.equal(out[1], outs[0][1]), f"update output values, layer {i}"


def assert_like_dynamic(ref: DynamicCache, comp: CompressedCache, what: str):
    for i, (r, c) in enumerate(zip(ref.layers, comp.layers)):
        assert c.is_initialized == r.is_initialized, f"{what}: layer {i} is_initialized"
        if r.is_initialized:
            assert torch.equal(c.keys, r.keys), f"{what}: layer {i} keys"
            assert torch.equal(c.values, r.values), f"{what}: layer {i} values"
        assert comp.get_seq_length(i) == ref.get_seq_length(i), f"{what}: layer {i} get_seq_length"
        for q in (1, 5):
            sizes = comp.get_mask_sizes(q, i)
            assert sizes == ref.get_mask_sizes(q, i), f"{what}: layer {i} get_mask_sizes({q})"


def new_pair(arch):
    config = CONFIGS[arch]()
    return DynamicCache(config=config), CompressedCache(config, "none")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_update_lengths_and_mask_sizes_match(arch):
    ref, comp = new_pair(arch)
    assert_like_dynamic(ref, comp, "empty")
    feed([ref, comp], B, 10, seed=0)
    assert_like_dynamic(ref, comp, "prefill")
    for step in range(3):
        feed([ref, comp], B, 1, seed=10 + step)
        assert_like_dynamic(ref, comp, f"decode step {step}")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_batch_operations_match(arch):
    ref, comp = new_pair(arch)
    feed([ref, comp], B, 9, seed=1)
    for c in (ref, comp):
        c.batch_repeat_interleave(3)
    assert_like_dynamic(ref, comp, "batch_repeat_interleave(3)")
    feed([ref, comp], 3 * B, 1, seed=2)
    assert_like_dynamic(ref, comp, "update after batch_repeat_interleave")

    beam_idx = torch.tensor([11, 0, 0, 5, 3, 3, 2, 1, 9, 9, 10, 4])
    for c in (ref, comp):
        c.reorder_cache(beam_idx)
    assert_like_dynamic(ref, comp, "reorder_cache")
    feed([ref, comp], 3 * B, 1, seed=3)

    keep = torch.tensor([0, 4, 7])
    for c in (ref, comp):
        c.batch_select_indices(keep)
    assert_like_dynamic(ref, comp, "batch_select_indices")
    feed([ref, comp], 3, 2, seed=4)
    assert_like_dynamic(ref, comp, "update after batch_select_indices")


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_reset_is_like_a_fresh_cache(arch):
    """reset() drops every state: the cache then behaves as a new DynamicCache would (transformers 5.17's own
    DynamicLayer.reset only zeroes its tensors and keeps their length, so a fresh cache is the reference)."""
    _, comp = new_pair(arch)
    feed([comp], B, 8, seed=5)
    comp.reset()
    for i, layer in enumerate(comp.layers):
        assert comp.get_seq_length(i) == 0 and not layer.is_initialized, f"layer {i} after reset"
    fresh = DynamicCache(config=CONFIGS[arch]())
    # a reset cache is reusable, with another batch size
    feed([fresh, comp], 2, 4, seed=6)
    assert_like_dynamic(fresh, comp, "update after reset")
    feed([fresh, comp], 2, 5, seed=7)
    assert_like_dynamic(fresh, comp, "second update after reset")
    assert comp.memory_report()["tokens_seen"] == 9


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_crop_matches(arch):
    """crop as assisted decoding uses it: sliding layers record their past first."""
    ref, comp = new_pair(arch)
    for c in (ref, comp):
        c.activate_past_recording()
    feed([ref, comp], B, 7, seed=7)
    for n in (0, -1, -3):
        feed([ref, comp], B, 4, seed=8 - n)
        for c in (ref, comp):
            c.crop(n)
        assert_like_dynamic(ref, comp, f"crop({n})")
    feed([ref, comp], B, 1, seed=20)
    assert_like_dynamic(ref, comp, "update after crop")


# -- quantized layers ----------------------------------------------------------------------------------------
def small_page_policies():
    """Quantized policies with small pages: a few dozen tokens fill sinks, several body pages and a tail."""
    return {
        "int4": LayerPolicy(
            key=QuantSpec(method="int", bits=4, axis="channel"),
            value=QuantSpec(method="int", bits=4, axis="token", group_size=8),
            page_size=4,
            residual=3,
            sinks=2,
        ),
        "nuq3-outliers": LayerPolicy(
            key=QuantSpec(method="nuq", bits=3, axis="channel", outlier_fraction=0.05),
            value=QuantSpec(method="nuq", bits=3, axis="token", outlier_fraction=0.05),
            page_size=5,
            residual=0,
            sinks=1,
        ),
    }


def filled_layer(policy, tokens=30, prefill=5, seed=0):
    """A CompressedLayer fed `prefill` tokens, then one at a time.

    Returns (layer, (keys, values) fed [B, H, tokens, D], snapshots) where snapshots maps each length
    reached to (dense K, dense V, tokens then in sinks + body).
    """
    g = torch.Generator().manual_seed(seed)
    k_in, v_in = torch.randn(B, H, tokens, D, generator=g), torch.randn(B, H, tokens, D, generator=g)
    layer = CompressedLayer(policy, layer_idx=0)
    snapshots = {}
    t = 0
    while t < tokens:
        step = prefill if t == 0 else 1
        layer.update(k_in[:, :, t : t + step], v_in[:, :, t : t + step])
        t += step
        k, v = layer.dense()
        snapshots[t] = (k.clone(), v.clone(), layer.sink_k.shape[2] + layer.key_store.n_tokens)
    assert layer.compressed and layer.key_store.n_pages >= 3, "the test must reach the packed body"
    return layer, (k_in, v_in), snapshots


@pytest.mark.parametrize("name", sorted(small_page_policies()))
@pytest.mark.parametrize("n", [1, 2, 4, 7, 13, 27, 28, 29, 30])
def test_crop_into_packed_body(name, n):
    """crop(-n) keeps exactly the first held - n tokens as they were; what was never lossy (sinks, tail) is
    still the input itself; body pages kept are those that existed when only held - n tokens were cached."""
    policy = small_page_policies()[name]
    layer, (k_in, v_in), snapshots = filled_layer(policy)
    held = layer.held_tokens
    dense_k, dense_v = layer.dense()
    n_sink, n_tail = layer.sink_k.shape[2], layer.tail_k.shape[2]
    # before cropping: sinks and tail are exact copies of the input
    assert torch.equal(dense_k[:, :, :n_sink], k_in[:, :, :n_sink])
    assert torch.equal(dense_k[:, :, held - n_tail :], k_in[:, :, held - n_tail :])
    assert torch.equal(dense_v[:, :, held - n_tail :], v_in[:, :, held - n_tail :])

    layer.crop(-n)
    keep = held - n
    assert layer.held_tokens == keep and layer.get_seq_length() == keep
    assert layer.get_mask_sizes(1) == (keep + 1, 0)
    k, v = layer.dense()
    assert k.shape == (B, H, keep, D) and v.shape == (B, H, keep, D)
    assert torch.equal(k, dense_k[:, :, :keep]) and torch.equal(v, dense_v[:, :, :keep])
    # never lossy: the sinks and the part of the old tail that survives
    exact = list(range(min(n_sink, keep))) + list(range(held - n_tail, keep))
    assert torch.equal(k[:, :, exact], k_in[:, :, exact]) and torch.equal(v[:, :, exact], v_in[:, :, exact])
    # the body pages that existed when `keep` tokens were cached decode to the same values now
    before_k, before_v, packed_then = snapshots[keep] if keep in snapshots else (k, v, 0)
    assert torch.equal(k[:, :, :packed_then], before_k[:, :, :packed_then])
    assert torch.equal(v[:, :, :packed_then], before_v[:, :, :packed_then])

    # the layer keeps working: append the removed tokens again (pages are flushed again)
    packed_after_crop = layer.sink_k.shape[2] + layer.key_store.n_tokens
    layer.update(k_in[:, :, keep:held], v_in[:, :, keep:held])
    assert layer.held_tokens == held and layer.get_seq_length() == held
    k2, v2 = layer.dense()
    assert k2.shape == (B, H, held, D) and v2.shape == (B, H, held, D)
    assert torch.equal(k2[:, :, :packed_after_crop], k[:, :, :packed_after_crop])
    assert torch.equal(v2[:, :, :packed_after_crop], v[:, :, :packed_after_crop])
    tail = layer.tail_k.shape[2]
    assert torch.equal(k2[:, :, held - tail :], k_in[:, :, held - tail : held])
    assert torch.equal(v2[:, :, held - tail :], v_in[:, :, held - tail : held])


def test_crop_more_than_held_raises():
    layer, _, _ = filled_layer(small_page_policies()["int4"])
    with pytest.raises(ValueError, match="cannot remove"):
        layer.crop(-(layer.held_tokens + 1))


@pytest.mark.parametrize("name", sorted(small_page_policies()))
@pytest.mark.parametrize(
    "op",
    [
        ("reorder_cache", torch.tensor([3, 3, 0, 1]), lambda t: t[torch.tensor([3, 3, 0, 1])]),
        ("batch_select_indices", torch.tensor([2, 0]), lambda t: t[torch.tensor([2, 0])]),
        ("batch_repeat_interleave", 2, lambda t: t.repeat_interleave(2, dim=0)),
    ],
    ids=lambda op: op[0] if isinstance(op, tuple) else str(op),
)
def test_batch_operations_commute_with_decoding(name, op):
    """Every packed field (codes, page scales, outliers, frozen row statistics) follows the batch rows."""
    method, arg, on_dense = op
    layer, (k_in, v_in), _ = filled_layer(small_page_policies()[name])
    dense_k, dense_v = layer.dense()
    other = copy.deepcopy(layer)
    getattr(layer, method)(arg)
    k, v = layer.dense()
    assert torch.equal(k, on_dense(dense_k)) and torch.equal(v, on_dense(dense_v))
    # and the layer keeps working at the new batch size
    b = k.shape[0]
    layer.update(torch.randn(b, H, 6, D), torch.randn(b, H, 6, D))
    assert layer.dense()[0].shape == (b, H, layer.held_tokens, D)
    assert other.held_tokens == layer.held_tokens - 6


@pytest.mark.parametrize("name", ["nuq4", "int4", "fp8"])
def test_reserved_store_writes_in_place(name):
    """PagedStore.reserve: pages appended after it land in the reserved buffers (their addresses never move)
    and hold exactly what a growing store holds; past the reservation, or after pop_pages, it grows again."""
    from kvcompress.config import KVCompressConfig
    from kvcompress.layout.store import PagedStore
    from kvcompress.quant.factory import make_codec

    policy = KVCompressConfig.from_preset(name, llama_config()).layers[0]
    x = torch.randn(2, 2, 6 * 16, 32, generator=torch.Generator().manual_seed(3))
    stores = []
    for _ in range(2):
        codec = make_codec(policy.key, page_size=16, head_dim=32, num_heads=2, dtype=torch.float32, tensors={}, seed=0)
        stores.append(PagedStore(codec))
    grow, fixed = stores
    for s in stores:
        s.append(x[:, :, :16])
    fixed.reserve(4)
    pointers = {k: t.data_ptr() for k, t in fixed.buffers.items()}
    for lo in range(16, 64, 16):
        for s in stores:
            s.append(x[:, :, lo:lo + 16])
        assert {k: t.data_ptr() for k, t in fixed.data.items()} == pointers
    for k in grow.data:
        assert torch.equal(grow.data[k], fixed.data[k])
    assert fixed.capacity == 64 and torch.equal(grow.decode(torch.float32), fixed.decode(torch.float32))
    for s in stores:
        s.append(x[:, :, 64:96])  # past the reservation: grows by a new allocation
    assert not fixed.buffers and torch.equal(grow.decode(torch.float32), fixed.decode(torch.float32))
    fixed.reserve(8)
    fixed.pop_pages(1, torch.float32)
    assert not fixed.buffers and fixed.n_pages == 5
