"""The bitsandbytes NF4 / FP4 codec (kvcompress/quant/bnb.py): round-trip SQNR, the bytes it stores,
a SmolLM2 generation through the "bnb-nf4" preset, and what happens when bitsandbytes is missing."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

import kvcompress
from kvcompress.cache import CompressedCache
from kvcompress.compat import with_cache
from kvcompress.config import QuantSpec
from kvcompress.quant.factory import make_codec

from quant_data import gaussian, heavy_keys, sqnr_db


def bnb_codec(quant_type="nf4", blocksize=64, head_dim=64, num_heads=2, page_size=64):
    spec = QuantSpec(method="bnb", bnb_type=quant_type, bnb_blocksize=blocksize)
    return make_codec(
        spec, page_size=page_size, head_dim=head_dim, num_heads=num_heads, dtype=torch.float32, tensors={}, seed=0
    )


needs_bnb = pytest.mark.skipif(
    importlib.util.find_spec("bitsandbytes") is None, reason='needs pip install "kvcompress[bnb]"'
)


# ---------------------------------------------------------------------------------------------
# round trip


# Thresholds ~0.35 dB (Gaussian) / 0.45 dB (heavy) under the measured value. NF4's 16 levels are normal
# quantiles scaled to the block absmax; on N(0, 1) blocks of 64 (absmax ~2.4 sigma) that gives ~20.7 dB,
# 0.5 dB below a Lloyd-Max 4-bit code; FP4's levels fit a Gaussian worse (~18.3 dB). Per-token blocks
# cannot isolate the x20 key channels, so heavy data loses 0.1-4 dB (more with larger blocks).
SQNR_CASES = [
    ("nf4", 64, 64, 20.3, 18.4),  # measured 20.68 / 18.84
    ("nf4", 32, 64, 20.7, 20.5),  # measured 21.06 / 20.97
    ("fp4", 64, 64, 17.9, 16.8),  # measured 18.26 / 17.26
    ("nf4", 128, 128, 20.0, 15.6),  # measured 20.39 / 16.02
]


@needs_bnb
@pytest.mark.parametrize("quant_type,blocksize,head_dim,gauss_db,heavy_db", SQNR_CASES)
def test_round_trip_sqnr(quant_type, blocksize, head_dim, gauss_db, heavy_db):
    codec = bnb_codec(quant_type, blocksize, head_dim)
    for name, x, threshold in (
        ("gauss", gaussian((1, 2, 128, head_dim), 0), gauss_db),
        ("heavy", heavy_keys((1, 2, 128, head_dim), 1), heavy_db),
    ):
        y = codec.decode(codec.encode(x, {}), {}, torch.float32)
        got = sqnr_db(x, y)
        assert got >= threshold, f"bnb {quant_type} blocksize {blocksize} on {name}: {got:.2f} dB < {threshold}"


@needs_bnb
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_decode_is_the_codebook_lookup_times_absmax(quant_type):
    """The stored layout, checked against plain torch: a byte holds channel 2i in its high nibble and
    2i+1 in its low nibble, each an index into bitsandbytes' fixed 16-level table, times its block's absmax."""
    from bitsandbytes.functional import get_4bit_type

    codec = bnb_codec(quant_type, blocksize=32)
    x = gaussian((2, 2, 64, 64), 5)
    f = codec.encode(x, {})
    codes, absmax = f["codes"].long(), f["absmax"]  # [B, H, N, 32], [B, H, N, 2]
    idx = torch.stack([codes >> 4, codes & 0xF], -1).flatten(-2)  # [B, H, N, 64]
    table = get_4bit_type(quant_type, device="cpu").float()
    expected = table[idx] * absmax.repeat_interleave(32, -1)
    assert torch.equal(codec.decode(f, {}, torch.float32), expected)
    assert torch.equal(absmax, x.reshape(2, 2, 64, 2, 32).abs().amax(-1))


@needs_bnb
@pytest.mark.parametrize("blocksize", [32, 64])
def test_stored_bytes_follow_the_blocksize(blocksize):
    """Per token and kv head: 64 channels / 2 bytes of codes + one float32 absmax per block."""
    codec = bnb_codec(blocksize=blocksize, num_heads=3)
    f = codec.encode(gaussian((1, 3, 128, 64), 2), {})
    assert f["codes"].dtype == torch.uint8 and f["codes"].shape == (1, 3, 128, 32)
    assert f["absmax"].dtype == torch.float32 and f["absmax"].shape == (1, 3, 128, 64 // blocksize)
    stored = sum(t.numel() * t.element_size() for t in f.values())
    assert stored == 3 * 128 * (32 + 4 * 64 // blocksize)
    assert codec.bits == 8 * stored / (3 * 128 * 64) == 4 + 32 / blocksize
    assert set(codec.fields()) == {"codes", "absmax"}


@needs_bnb
def test_blocks_that_would_straddle_tokens_are_refused():
    with pytest.raises(ValueError, match=r"divide the head dim 64.*use bnb_blocksize in \[32, 64\]"):
        bnb_codec(blocksize=128, head_dim=64)
    with pytest.raises(ValueError, match="use the 'nuq' or 'int' method"):
        bnb_codec(blocksize=32, head_dim=80)


# ---------------------------------------------------------------------------------------------
# SmolLM2


@needs_bnb
def test_smollm2_generates_with_bnb_nf4_at_4_5_bits(smollm2):
    """Prompt 100 + 28 fed generated tokens = 128 = 2 pages of 64 per layer, so nothing is left in the
    full-precision tail: every held element costs exactly 4 bits of NF4 code + 32 / 64 bits of fp32
    absmax = 4.5 bits, all-in."""
    from kvcompress.evaluation.perplexity import default_eval_text

    model, tokenizer = smollm2
    ids = tokenizer(default_eval_text(), return_tensors="pt").input_ids[:, :100]
    cache = CompressedCache(model.config, "bnb-nf4")
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=29, min_new_tokens=29, do_sample=False,
            **with_cache(cache),
        )
    assert out.shape == (1, 129)
    assert all(layer.key_store.n_tokens == 128 and layer.tail_k.shape[2] == 0 for layer in cache.layers)
    report = cache.memory_report()
    assert report["tokens_seen"] == 128 and report["window_bytes"] == 0
    assert report["bits_per_element"] == 4.5
    assert report["payload_bytes"] / report["held_bytes"] == pytest.approx(4.0 / 4.5)  # codes; the rest absmax


# ---------------------------------------------------------------------------------------------
# without bitsandbytes


@pytest.fixture
def without_bnb(monkeypatch):
    """bitsandbytes made unimportable (None in sys.modules), installed or not."""
    for name in [m for m in sys.modules if m == "bitsandbytes" or m.startswith("bitsandbytes.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "bitsandbytes", None)
    monkeypatch.setitem(sys.modules, "bitsandbytes.functional", None)


@pytest.mark.parametrize("preset", ["bnb-nf4", "bnb-fp4"])
def test_bnb_preset_without_bitsandbytes_names_the_install(without_bnb, tiny_model, preset):
    model = tiny_model("llama", head_dim=64)
    cache = CompressedCache(model.config, preset)
    with pytest.raises(ImportError, match=r'pip install "kvcompress\[bnb\]"'):
        cache.update(gaussian((1, 2, 70, 64), 0), gaussian((1, 2, 70, 64), 1), 0)


def test_every_other_preset_works_without_bitsandbytes(without_bnb, tiny_model):
    """A tiny llama (head dim 64, as KIVI groups of 32 need) generates through each non-bnb preset with
    a 200-token prompt, long enough for every quantizer to encode pages (KIVI: residual 128 + pages of 32)."""
    model = tiny_model("llama", head_dim=64)
    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(0))
    others = [p for p in kvcompress.preset_names() if not p.startswith("bnb")]
    assert {"none", "fp8", "int4", "nuq4", "k8v4"} <= set(others)
    for preset in others:
        cache = CompressedCache(model.config, preset)
        with torch.no_grad(), kvcompress.enabled(model):
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=3, min_new_tokens=3, do_sample=False,
                **with_cache(cache),
            )
        assert out.shape == (1, 203), preset
