"""Keys with calibrated bits per channel (NuqCodec.channel_widths, calib/widths.py): the bit stream they pack
to, the codec against its fixed-width twin, the knapsack that picks the widths, and a cache that holds them."""

from __future__ import annotations

import itertools
import random
from dataclasses import replace

import pytest
import torch
from conftest import make_tiny_model
from test_memory_report import run, walked_bytes

from kvcompress import CompressedCache
from kvcompress.calib.bits import config_bits_per_element
from kvcompress.calib.collect import LayerStats
from kvcompress.calib.inspect import layer_rows
from kvcompress.calib.widths import channel_widths, least_cost_widths, page_errors
from kvcompress.config import ConfigError, KVCompressConfig, LayerPolicy, QuantSpec
from kvcompress.kernels.attention_backend import fused_supported
from kvcompress.layout.arch import ModelLayout
from kvcompress.quant.nuq import NuqCodec
from kvcompress.quant.pack_widths import pack_widths, unpack_widths, widths_packed_width

KEY = QuantSpec(method="nuq", bits=3, axis="page", scale_format="e4m3")


def _widths(h: int, d: int, total: int, seed: int) -> torch.Tensor:
    """Random widths in 0..8 per channel, `total` bits in every head."""
    rnd = random.Random(seed)
    out = torch.zeros(h, d, dtype=torch.uint8)
    for i in range(h):
        left = total
        while left:
            c = rnd.randrange(d)
            if out[i, c] < 8:
                out[i, c] += 1
                left -= 1
    return out


def width_config(model, extra_bits: int = 16) -> KVCompressConfig:
    """Every layer's keys on random widths (3 bits a channel on average, layer i extra_bits * i more per
    token), values nuq3 rotated; pages of 32, 4 sinks, residual 32."""
    layout = ModelLayout.from_model_config(model.config)
    h, d = layout.num_kv_heads, layout.key_head_dim
    layers = [
        LayerPolicy(key=KEY, value=QuantSpec(method="nuq", bits=3, axis="token", rotation=True), page_size=32,
                    sinks=4, residual=32, tensors={"key.channel_widths": _widths(h, d, d * 3 + extra_bits * i, seed=i)})
        for i in range(layout.num_layers)
    ]
    return KVCompressConfig(layout=layout, layers=layers, name="widths")


def _codec(widths=None, bits=3, page=8, heads=2, dim=16, fmt="e4m3") -> NuqCodec:
    return NuqCodec(nbits=bits, axis="page", page_size=page, head_dim=dim, num_heads=heads, scale_format=fmt,
                    channel_widths=widths)


def test_width_stream_round_trips_in_its_stated_bytes():
    widths = _widths(3, 16, 45, seed=1)
    assert set(widths.flatten().tolist()) > {0, 1, 2, 3}  # zero-width and wide channels both present
    torch.manual_seed(0)
    codes = (torch.rand(2, 3, 5, 16) * (1 << widths.long())[None, :, None, :]).long()
    packed = pack_widths(codes, widths)
    assert packed.shape == (2, 3, 5, 6) == (2, 3, 5, widths_packed_width(widths))  # ceil(45 / 8) bytes
    assert torch.equal(unpack_widths(packed, widths), codes)
    # the stream is channel 0's bits first, least significant first
    one = torch.zeros(1, 1, 1, 4, dtype=torch.long)
    one[..., 1] = 5
    w = torch.tensor([[2, 3, 0, 3]], dtype=torch.uint8)
    assert pack_widths(one, w).flatten().tolist() == [5 << 2]
    with pytest.raises(ValueError, match="same number of code bits"):
        pack_widths(codes, torch.tensor([[3] * 16, [3] * 15 + [2], [3] * 16], dtype=torch.uint8))


def test_equal_widths_pack_as_the_fixed_width_codec():
    """Every channel at the codec's own width: the very same codes and bytes as the fixed-width twin."""
    torch.manual_seed(0)
    x = torch.randn(2, 2, 32, 16) * torch.linspace(0.1, 4, 16)
    for bits in (2, 3, 4):
        plain, wide = _codec(bits=bits), _codec(torch.full((2, 16), bits, dtype=torch.uint8), bits=bits)
        fp, fw = plain.encode(x, {}), wide.encode(x, {})
        assert torch.equal(fp["codes"], fw["codes"]) and torch.equal(fp["scale"], fw["scale"])
        assert torch.allclose(plain.decode(fp, {}, torch.float32), wide.decode(fw, {}, torch.float32), atol=1e-6)
        assert wide.bits == plain.bits


def test_each_channel_is_coded_at_its_width():
    """Channel error falls with its width (about 4x per bit), and a zero-width channel reads its page's
    middle, which the page range stores anyway."""
    torch.manual_seed(0)
    x = torch.randn(1, 1, 64, 16)
    widths = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 8] * 2], dtype=torch.uint8)
    codec = _codec(widths, heads=1, fmt="fp16")
    f = codec.encode(x, {})
    got = codec.decode(f, {}, torch.float32)
    err = (got - x).pow(2).mean((0, 1, 2)).reshape(2, 8).mean(0)  # per width
    assert all(err[i + 1] < err[i] / 2.5 for i in range(2, 6)), err
    zero = f["zero"].float().repeat_interleave(8, 2)  # [1, 1, 64, 16]
    assert torch.equal(got[..., [0, 8]], zero[..., [0, 8]])
    assert codec.bits == pytest.approx(widths_packed_width(widths) * 8 / 16 + 2 * 16 / 8)


def test_bad_widths_are_refused_with_the_fix():
    ok = torch.full((2, 16), 3, dtype=torch.uint8)
    for widths, match in (
        (ok[:1], "expected \\[kv heads, head dim\\]"),
        (torch.full((2, 16), 9, dtype=torch.uint8), "integers in 0..8"),
        (ok.float(), "integers in 0..8"),
        (torch.cat([ok[:1], ok[1:] - 1]), "same number of code bits"),
    ):
        with pytest.raises(ConfigError, match=match):
            _codec(widths)
    with pytest.raises(ConfigError, match="axis='page'"):
        NuqCodec(nbits=3, axis="token", page_size=8, head_dim=16, num_heads=2, channel_widths=ok)


def test_least_cost_widths_is_the_exact_optimum():
    """The knapsack against brute force, on costs that are not convex in the width (the grid with ends on
    the range gains nothing from 0 to 1 bit)."""
    rnd = random.Random(0)
    for trial in range(5):
        cost = torch.tensor([[rnd.random() * 4.0 ** -w * (1 if w != 1 else 4) for w in range(4)] for _ in range(4)])
        for total in (0, 3, 7, 12):
            got = least_cost_widths(cost, total)
            assert int(got.sum()) == total
            best = min(sum(float(cost[c, w]) for c, w in enumerate(combo))
                       for combo in itertools.product(range(4), repeat=4) if sum(combo) == total)
            assert sum(float(cost[c, w]) for c, w in enumerate(got.tolist())) == pytest.approx(best)


def _stats(keys: torch.Tensor, energy: torch.Tensor) -> LayerStats:
    h, _, d = keys.shape[1:]
    z = torch.zeros(h, d)
    return LayerStats(keys=keys[0], values=keys[0], key_weight=None, value_weight=None, key_amax=z[:, 0],
                      value_amax=z[:, 0], key_mean=z, key_std=z, probe_k=keys, probe_v=keys, query_energy=energy)


def test_widths_go_where_the_queries_read_and_the_pages_spread():
    torch.manual_seed(0)
    d = 16
    spread = torch.ones(d)
    spread[:4] = 8.0  # wide pages in channels 0-3
    keys = torch.randn(1, 2, 4 + 8 * 32, d) * spread
    energy = torch.ones(2, d)
    energy[1, 4:8] = 64.0  # head 1's queries also weigh channels 4-7 (8x the range's worth: 64x in squares)
    widths = channel_widths(_stats(keys, energy), 3.0, page_size=32, sinks=4)
    assert widths.dtype == torch.uint8 and widths.long().sum(-1).tolist() == [48, 48]
    w = widths.long()
    assert w[0, :4].min() > w[0, 4:].max()
    assert w[1, :8].min() > w[1, 8:].max()
    # the cost it minimised is what page_errors measures: lower than 3 bits everywhere
    cost = page_errors(keys, 32, 4) * energy[..., None]
    chosen = cost.gather(-1, w[..., None]).sum()
    assert chosen < cost[..., 3].sum() / 2
    with pytest.raises(ConfigError, match="raise --seq-len"):
        channel_widths(_stats(keys[:, :, :20], energy), 3.0, page_size=32, sinks=4)


def test_a_cache_of_width_coded_keys_generates_and_reports_its_bytes():
    """A config whose keys carry widths: it saves and loads, generates through the drop-in path (no fused
    kernel reads the bit stream on the CPU), and memory_report's bytes are the tensors held and the estimate's bits."""
    model = make_tiny_model("llama", num_hidden_layers=2, head_dim=64)
    cfg = width_config(model)
    layout, layers, h = cfg.layout, cfg.layers, cfg.layout.num_kv_heads
    cache = CompressedCache(model.config, cfg)
    run(model, cache, prefill=150, decode_steps=20)
    rep = cache.memory_report()
    assert [m["held_bytes"] for m in rep["layers"]] == [walked_bytes(layer) for layer in cache.layers]
    assert all(fused_supported(layer) for layer in cache.layers)  # test_gpu: Triton steps equal these
    for i, layer in enumerate(cache.layers):
        codes = dict((name, t) for name, t, _ in layer.key_store.tensors())["codes"]
        assert codes.shape[-1] == (64 * 3 + 16 * i + 7) // 8  # ceil(bits per token / 8)
    tokens = 171
    bits = config_bits_per_element(cfg.layers, layout, tokens, batch=2, dtype=torch.float32)
    assert rep["held_bytes"] * 8 / (rep["uncompressed_bytes"] * 8 / 32) == pytest.approx(bits, rel=0.02)
    low = int(layers[1].tensors["key.channel_widths"].min())
    assert layer_rows(cfg)[1]["keys"] == f"nuq~{3 + 16 / 64:.3g}/page (widths {low}-8)"
    wrong = replace(layers[0], tensors={"key.channel_widths": torch.full((h, 32), 3, dtype=torch.uint8)})
    with pytest.raises(ConfigError, match="another model"):
        run(model, CompressedCache(model.config, KVCompressConfig(layout=layout, layers=[wrong, layers[1]])), 150, 1)
