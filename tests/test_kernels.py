"""Decode-attention kernels and Quest page scoring: the torch twin against a plain reference (codec decode +
SDPA), and the Triton kernels against the torch twin on the same packed data (Triton's interpreter on CPU).

What is proved: the fused kernel reads every codec's packed layout as the codec's own `decode` does
(int 2/3/4/8 with per-page-channel and per-token-group scales, nuq 2/3/4 with outliers and rotation, fp8
e4m3/e5m2; 2- and 4-bit keys per page through a kernel of their own), merges sinks and tail, honours GQA
groups, ragged batches and Quest page lists, and returns the H2O probabilities; float32 relative error
<= 1e-3 in every case.
"""

from __future__ import annotations

import os

import pytest
import torch

from kvcompress.config import QuantSpec
from kvcompress.kernels.backend import select_backend
from kvcompress.kernels.decode_attention import decode_attention_torch, layer_decode_attention
from kvcompress.kernels.parts import AttentionParts, PackedStream
from kvcompress.kernels.quest import quest_select_pages
from kvcompress.presets import nuq_specs
from kvcompress.quant.factory import make_codec
from kvcompress.quant.rotation import random_signs

try:  # without a GPU the Triton side runs in Triton's interpreter (TRITON_INTERPRET=1, set by conftest.py)
    import triton  # noqa: F401

    HAVE_TRITON, WHY = True, ""
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        HAVE_TRITON, WHY = False, "no GPU and TRITON_INTERPRET is not 1: set it before Triton is imported"
except ImportError as e:  # pragma: no cover - depends on the machine
    HAVE_TRITON, WHY = False, f"triton is not importable ({e}); `pip install triton` to run the kernel tests"

needs_triton = pytest.mark.skipif(not HAVE_TRITON, reason=WHY or "triton present")

SPECS = {
    "int4": (QuantSpec(method="int", bits=4, axis="channel"), QuantSpec(method="int", bits=4, group_size=32)),
    "int2": (QuantSpec(method="int", bits=2, axis="channel"), QuantSpec(method="int", bits=2, group_size=32)),
    "int8": (QuantSpec(method="int", bits=8, axis="channel"), QuantSpec(method="int", bits=8)),
    # values scaled per whole token: both streams enter the fast kernel's dots through a magic pattern
    "int4-vtok": (QuantSpec(method="int", bits=4, axis="channel"), QuantSpec(method="int", bits=4)),
    "int2-vtok": (QuantSpec(method="int", bits=2, axis="channel"), QuantSpec(method="int", bits=2)),
    "int3": (QuantSpec(method="int", bits=3, axis="channel"), QuantSpec(method="int", bits=3, group_size=16)),
    "nuq4": (QuantSpec(method="nuq", bits=4, axis="channel", outlier_fraction=0.02),
             QuantSpec(method="nuq", bits=4, axis="token", outlier_fraction=0.02)),
    "nuq3": (QuantSpec(method="nuq", bits=3, axis="channel", outlier_fraction=0.01),
             QuantSpec(method="nuq", bits=3, axis="token", outlier_fraction=0.01)),
    "nuq2": (QuantSpec(method="nuq", bits=2, axis="channel"), QuantSpec(method="nuq", bits=2, axis="token")),
    # the nuq presets' key layout: range per page and channel
    "nuq4-page": (QuantSpec(method="nuq", bits=4, axis="page", outlier_fraction=0.01),
                  QuantSpec(method="nuq", bits=4, axis="token", outlier_fraction=0.01)),
    # one-byte scales (FP8 key ranges, FP8 value scales) through the paged kernel
    "nuq3-page": (QuantSpec(method="nuq", bits=3, axis="page", scale_format="e4m3"),
                  QuantSpec(method="nuq", bits=3, axis="token", scale_format="e5m2")),
    "nuq2-page": (QuantSpec(method="nuq", bits=2, axis="page", outlier_fraction=0.02),
                  QuantSpec(method="nuq", bits=2, axis="token")),
    # the nuq4 preset: key outliers only, values on a Student-t codebook, scales in FP8 (one byte)
    "nuq4-kout": (QuantSpec(method="nuq", bits=4, axis="page", outlier_fraction=0.01, scale_format="e4m3"),
                  QuantSpec(method="nuq", bits=4, axis="token", codebook="student_t5", scale_format="e5m2")),
    # the same with the key outliers chosen per token (a fixed count per token: the phase kernel gathers them)
    "nuq4-ktok": (QuantSpec(method="nuq", bits=4, axis="page", outlier_fraction=0.01, scale_format="e4m3",
                            outlier_scope="token"),
                  QuantSpec(method="nuq", bits=4, axis="token", codebook="student_t5", scale_format="e5m2")),
    "nuq4-rot": (QuantSpec(method="nuq", bits=4, rotation=True), QuantSpec(method="nuq", bits=4, rotation=True)),
    # the nuq4-vrot preset: nuq4's keys, values Hadamard-rotated onto Gaussian levels (phase kernel)
    "nuq4-vrot": (QuantSpec(method="nuq", bits=4, axis="page", outlier_fraction=0.01, scale_format="e4m3"),
                  QuantSpec(method="nuq", bits=4, axis="token", rotation=True, scale_format="e5m2")),
    # the nuq2 preset: keys per page range, values Hadamard-rotated on a Gaussian codebook (phase kernel)
    "nuq2-vrot": (QuantSpec(method="nuq", bits=2, axis="page", outlier_fraction=0.01, scale_format="e4m3"),
                  QuantSpec(method="nuq", bits=2, axis="token", rotation=True, scale_format="e5m2")),
    # the nuq3 preset: keys per page range with 2 % outliers, values Hadamard-rotated (phase kernel at d >= 64)
    "nuq3-vrot": (QuantSpec(method="nuq", bits=3, axis="page", outlier_fraction=0.02, scale_format="e4m3"),
                  QuantSpec(method="nuq", bits=3, axis="token", rotation=True, scale_format="e5m2")),
    # calibrated mixed configs: nuq keys and values at different bits (phase kernel)
    "nuq4k-nuq3v": (QuantSpec(method="nuq", bits=4, axis="page", outlier_fraction=0.01, scale_format="e4m3"),
                    QuantSpec(method="nuq", bits=3, axis="token", rotation=True, scale_format="e5m2")),
    "nuq2k-nuq4v": (QuantSpec(method="nuq", bits=2, axis="page", outlier_fraction=0.02, scale_format="e4m3"),
                    QuantSpec(method="nuq", bits=4, axis="token", codebook="student_t5", scale_format="e5m2")),
    "fp8": (QuantSpec(method="fp8"), QuantSpec(method="fp8")),
    "fp8-e5m2": (QuantSpec(method="fp8", fp8_format="e5m2"), QuantSpec(method="fp8", fp8_format="e5m2")),
    # calibrated fp8: static scales per head on streams shifted per channel (fp8 kernel), and fp8 shifted
    # keys beside nuq4 values (paged kernel)
    "fp8-shift": (QuantSpec(method="fp8"), QuantSpec(method="fp8")),
    "fp8-shift-k": (QuantSpec(method="fp8"), QuantSpec(method="nuq", bits=4, axis="token")),
    # what `calibrate --preset fp8` writes by default: keys shifted, values with static scales only
    "fp8-shift-kstatic": (QuantSpec(method="fp8"), QuantSpec(method="fp8")),
    # the nuq3 / nuq2 presets' streams with levels per kv head and the rotation's signs given in the config
    # (rotated values on their own levels; nuq3 reads through the paged kernel, nuq2 the phase kernel)
    "nuq3-vbooks": nuq_specs(3),
    "nuq2-vbooks": nuq_specs(2),
    # calibrated key widths per channel (0..8 bits, one bit stream per token: general kernel), with and
    # without exact key outliers
    "nuq-widths": (QuantSpec(method="nuq", bits=3, axis="page", scale_format="e4m3"), nuq_specs(3)[1]),
    "nuq-widths-kout": (QuantSpec(method="nuq", bits=3, axis="page", outlier_fraction=0.01),
                        QuantSpec(method="nuq", bits=4, axis="token")),
}


def _channel_widths(stream, hkv, d):
    """Key widths 0..8 per channel, 3.25 bits on average in every head (a code may straddle two bytes)."""
    if stream:
        return {}
    g = torch.Generator().manual_seed(70)
    w = torch.zeros(hkv, d, dtype=torch.long)
    for h in range(hkv):
        for c in torch.randint(0, d, (13 * d,), generator=g):  # 13 d draws, capped at 8 bits: spread widths
            if w[h].sum() < 13 * d // 4 and w[h, c] < 8:
                w[h, c] += 1
    assert (w.sum(-1) == 13 * d // 4).all() and (w == 0).any() and (w >= 6).any()
    return {"channel_widths": w.to(torch.uint8)}


def _rotated_value_tensors(stream, hkv, d, bits):
    """Config tensors of a rotated value stream: sorted levels per kv head, the rotation's signs."""
    if stream == 0:
        return {}
    g = torch.Generator().manual_seed(60 + bits)
    levels = torch.sort(torch.randn(hkv, 2**bits, generator=g) * 1.5, dim=-1).values
    return {"codebook": levels, "rotation_signs": random_signs(d, 61)}


def _fp8_shift_tensors(stream, hkv, d):
    """Calibration-like tensors of a shifted fp8 stream: a shift [H, D] with large channel means and
    static per-head scales [H] of the shifted stream."""
    g = torch.Generator().manual_seed(40 + stream)
    return {"shift": 3 * torch.randn(hkv, d, generator=g), "scale": (6 + torch.rand(hkv, generator=g)) / 448}


# calibrated tensors of a spec's streams: fn(stream index, kv heads, head dim) -> {name: tensor}
TENSORS = {
    "fp8-shift": _fp8_shift_tensors,
    "fp8-shift-k": lambda s, hkv, d: _fp8_shift_tensors(s, hkv, d) if s == 0 else {},
    "fp8-shift-kstatic": lambda s, hkv, d: (_fp8_shift_tensors(s, hkv, d) if s == 0 else
                                            {"scale": _fp8_shift_tensors(s, hkv, d)["scale"] * 3}),
    "nuq3-vbooks": lambda s, hkv, d: _rotated_value_tensors(s, hkv, d, 3),
    "nuq2-vbooks": lambda s, hkv, d: _rotated_value_tensors(s, hkv, d, 2),
    "nuq-widths": lambda s, hkv, d: {**_channel_widths(s, hkv, d), **_rotated_value_tensors(s, hkv, d, 3)},
    "nuq-widths-kout": _channel_widths,
}


def make_parts(name, *, b=2, hkv=2, d=64, pages=3, page=16, sinks=3, tail=5, lengths=None, seed=0,
               dtype=torch.float32, value_gain=1.0):
    """Random K/V (a few large channels, as real keys have) packed by the codecs of preset-like `name`;
    values times value_gain."""
    g = torch.Generator().manual_seed(seed)
    n = pages * page

    def rnd(t, gain=1.0):
        x = torch.randn(b, hkv, t, d, generator=g)
        return (x * (1 + 4 * (torch.rand(d, generator=g) > 0.9)) * gain).to(dtype)

    streams = []
    for s, spec in enumerate(SPECS[name]):
        tensors = TENSORS[name](s, hkv, d) if name in TENSORS else {}
        codec = make_codec(spec, page_size=page, head_dim=d, num_heads=hkv, dtype=dtype, tensors=tensors, seed=s)
        x = rnd(n, value_gain if s == 1 else 1.0)
        if "shift" in tensors:  # the stream's channel means are the shift (as calibration finds them)
            x = x + tensors["shift"][None, :, None, :].to(dtype)
        row = codec.prepare(x)
        streams.append(PackedStream(codec, codec.encode(x, row), row, n))
    lens = None if lengths is None else torch.tensor(lengths, dtype=torch.int32)
    return AttentionParts(streams[0], streams[1], rnd(sinks), rnd(sinks, value_gain), rnd(tail),
                          rnd(tail, value_gain), lens)


def reference(q, parts, scaling, page_list=None):
    """Plain attention: the codec's decode of the whole body, a boolean mask, SDPA (GQA by repeat)."""
    b, hq, d = q.shape
    hkv, n_body, p = parts.kv_heads, parts.n_body, parts.key.page_size
    k = torch.cat([parts.sink_k, parts.key.decode(q.dtype), parts.tail_k], 2).float()
    v = torch.cat([parts.sink_v, parts.value.decode(q.dtype), parts.tail_v], 2).float()
    keep = torch.ones(b, hkv, k.shape[2], dtype=torch.bool)
    body = keep[:, :, parts.n_sinks: parts.n_sinks + n_body]
    if parts.body_lengths is not None:
        body &= torch.arange(n_body) < parts.body_lengths.view(b, 1, 1)
    if page_list is not None:
        chosen = torch.zeros(b, hkv, n_body // p + 1, dtype=torch.bool)
        chosen.scatter_(2, torch.where(page_list < 0, n_body // p, page_list).long(), True)
        body &= chosen[:, :, :-1].repeat_interleave(p, 2)
    g = hq // hkv
    mask = keep.repeat_interleave(g, 1)[:, :, None, :]  # [B, Hq, 1, n]
    out = torch.nn.functional.scaled_dot_product_attention(
        q.float()[:, :, None], k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), attn_mask=mask, scale=scaling
    )
    return out[:, :, 0]


def rel_err(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())


def random_page_list(b, hkv, n_pages, n_sel, seed, holes=True):
    """Distinct pages per (row, head), shuffled, some entries -1 (unused slots)."""
    g = torch.Generator().manual_seed(seed)
    pl = torch.stack([torch.randperm(n_pages, generator=g)[:n_sel] for _ in range(b * hkv)]).view(b, hkv, n_sel)
    if holes:
        pl[0, 0, -1] = -1
    return pl.to(torch.int32)


# -- the torch twin against the plain reference ---------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SPECS))
def test_torch_twin_matches_decode_plus_sdpa(name):
    """Every codec: the twin (page-wise field gather + decode) equals whole-body decode + SDPA."""
    parts = make_parts(name, b=3, hkv=2, d=64, pages=4, lengths=[64, 37, 50], seed=1)
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(2))
    out, _ = decode_attention_torch(q, parts, 0.125)
    assert rel_err(out, reference(q, parts, 0.125)) < 1e-5
    pl = random_page_list(3, 2, 4, 3, seed=3)
    out, _ = decode_attention_torch(q, parts, 0.125, page_list=pl)
    assert rel_err(out, reference(q, parts, 0.125, pl)) < 1e-5


def test_outliers_matter():
    """nuq outliers change the attention output: the kernels' outlier path is exercised, not a no-op."""
    parts = make_parts("nuq4", seed=4)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(5))
    full, _ = decode_attention_torch(q, parts, 0.125)
    for s in (parts.key, parts.value):
        s.data = {k: v for k, v in s.data.items() if not k.startswith("outlier")}
        s.codec.outlier_fraction = 0.0
    assert rel_err(decode_attention_torch(q, parts, 0.125)[0], full) > 1e-2


def test_probs_are_the_attention_weights():
    """H2O probabilities: per query head they sum to 1, so the group sum is G, and zero on unread pages."""
    parts = make_parts("int4", b=2, hkv=2, pages=4, seed=6)
    q = torch.randn(2, 8, 64, generator=torch.Generator().manual_seed(7))
    pl = torch.tensor([[[0, 2], [1, 3]], [[3, 0], [2, -1]]], dtype=torch.int32)
    _, probs = decode_attention_torch(q, parts, 0.125, page_list=pl, return_probs=True)
    assert torch.allclose(probs.sum(-1), torch.full((2, 2), 4.0), atol=1e-5)
    body = probs[:, :, parts.n_sinks: parts.n_sinks + parts.n_body].reshape(2, 2, 4, 16)
    assert (body[0, 0, 1] == 0).all() and (body[1, 1, 3] == 0).all() and (body[1, 1, 2] > 0).all()


# -- Triton against the torch twin (same packed data) ---------------------------------------------------
def check_triton(parts, q, page_list=None, block_n=16, tol=1e-3, **kw):
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    want, want_p = decode_attention_torch(q, parts, 0.125, page_list, return_probs=True)
    got, got_p = decode_attention_triton(q, parts, 0.125, page_list, return_probs=True, block_n=block_n, **kw)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= tol, rel_err(got, want)
    assert rel_err(got_p, want_p) <= tol, rel_err(got_p, want_p)


@needs_triton
@pytest.mark.parametrize("name", sorted(SPECS))
def test_triton_matches_twin_each_codec(name):
    """d=64, GQA 3, ragged batch (the second row's last page partly valid), sinks and tail."""
    parts = make_parts(name, b=2, hkv=2, d=64, pages=3, lengths=[48, 29], seed=8)
    check_triton(parts, torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(9)))


@needs_triton
@pytest.mark.parametrize("name", ["fp8", "fp8-e5m2", "fp8-shift", "fp8-shift-kstatic"])
def test_fp8_kernel_with_fp16_operands(name):
    """A 16-bit cache: the fp8 kernel's dots take fp16 operands converted straight from the codes (on a GPU
    the bf16 model's path too). fp16 inputs, so the tolerance is fp16's (measured 3e-4 to 5e-4)."""
    parts = make_parts(name, b=2, hkv=2, d=64, pages=3, lengths=[48, 29], seed=8, dtype=torch.float16)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(9)).half()
    check_triton(parts, q, tol=2e-3)


def test_scale_words_share_the_fp16_scales():
    """fp8's per-token fp16 scales handed over as int32 words: a view of the same storage whose words hold
    each row's scales in token order; anything else (odd token count, tokens not adjacent, float32) keeps
    the per-token loads."""
    import dataclasses

    from kvcompress.kernels.scale_words import WORDS_FP16, WORDS_NONE, scale_words
    from kvcompress.kernels.streams import stream_args

    parts = make_parts("fp8", b=2, hkv=2, d=64, pages=3, seed=8)
    a = stream_args(parts.key.codec, parts.key.data, parts.key.row)
    w, sw = scale_words(a)
    assert sw == WORDS_FP16 and w.scale.dtype == torch.int32
    assert w.scale.untyped_storage().data_ptr() == a.scale.untyped_storage().data_ptr()
    sb, sh, _, _ = w.scale_strides
    n = a.scale.shape[2]
    for b in range(2):
        for h in range(2):
            row = w.scale[b * sb + h * sh: b * sb + h * sh + n // 2].view(torch.float16)
            assert torch.equal(row, a.scale[b, h, :, 0])
    assert scale_words(dataclasses.replace(a, scale=a.scale[:, :, :n - 1]))[1] == WORDS_NONE
    strided = dataclasses.replace(a, scale_strides=(a.scale_strides[0], a.scale_strides[1], 2, 1))
    assert scale_words(strided)[1] == WORDS_NONE
    assert scale_words(dataclasses.replace(a, scale=a.scale.float()))[1] == WORDS_NONE


@needs_triton
@pytest.mark.parametrize("exact_apart", [True, False], ids=["exact-in-merge", "exact-in-body-launch"])
@pytest.mark.parametrize("name", ["fp8", "fp8-shift-kstatic"])
def test_fp8_exact_parts_in_the_merge(name, exact_apart):
    """The fp8 kernel leaves sinks and tail to the split merge (exact_reduce_triton; the default) or runs
    them in its own launch: both equal the twin, probabilities included, with left padding in the sinks,
    the body and the tail, ragged lengths, splits whose last block is partly filled (block 32 over pages
    of 16), and rows whose body is empty."""
    parts = make_parts(name, b=3, hkv=2, d=64, pages=5, page=16, sinks=3, tail=5, lengths=[80, 53, 37],
                       seed=40)
    parts.row_starts = torch.tensor([2, 40, 0], dtype=torch.int32)
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(41))
    check_triton(parts, q, block_n=32, splits=2, exact_apart=exact_apart)
    parts.row_starts = None
    check_triton(parts, q, block_n=32, splits=3, exact_apart=exact_apart)
    parts.body_lengths = torch.tensor([0, 16, 0], dtype=torch.int32)
    check_triton(parts, q, block_n=32, exact_apart=exact_apart)


@needs_triton
@pytest.mark.parametrize("name", ["nuq4", "int4", "fp8", "nuq-widths-kout"])
def test_triton_page_list_gqa8_d128(name):
    """d=128, GQA 8, batch 3 of different lengths, a Quest page list with holes; pages of 32, blocks of 16."""
    parts = make_parts(name, b=3, hkv=1, d=128, pages=4, page=32, sinks=0, tail=7, lengths=[128, 70, 33], seed=10)
    q = torch.randn(3, 8, 128, generator=torch.Generator().manual_seed(11))
    check_triton(parts, q, page_list=random_page_list(3, 1, 4, 3, seed=12))


@needs_triton
@pytest.mark.parametrize("name", ["int4", "nuq4-page", "int2"])
@pytest.mark.parametrize("with_pages", [False, True], ids=["all", "page-list"])
def test_triton_tiles_of_several_pages(name, with_pages):
    """Tiles of 4 pages whose per-page key scales fold into stacked query rows (4 pages x GQA 3 = 12
    rows), ragged lengths cutting a tile, a page list with holes."""
    parts = make_parts(name, b=2, hkv=2, d=64, pages=7, page=16, lengths=[112, 53], seed=30)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(31))
    check_triton(parts, q, random_page_list(2, 2, 7, 5, seed=32) if with_pages else None, block_n=64)


@needs_triton
@pytest.mark.parametrize("lut", ["select", "gather"])
@pytest.mark.parametrize("name", ["nuq4-page", "nuq2", "nuq4"])
def test_triton_codebook_reads(name, lut):
    """The codebook read through a tree of selects (lut="select", the default) or a load per element
    (lut="gather") equals the twin."""
    parts = make_parts(name, b=2, hkv=2, d=64, pages=3, lengths=[48, 29], seed=33)
    check_triton(parts, torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(34)), lut=lut)


@needs_triton
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("name", ["int4", "int2", "int8", "nuq4-kout", "nuq2", "int4-vtok", "int2-vtok",
                                  "nuq4-vrot", "nuq-widths"])
def test_triton_half_operands(name, d):
    """fp16 model: integer codes enter the dots as (c | magic) read as fp16 (1024 + c), the offset taken
    back out exactly; words of 8 / 16 / 32 bits by head dim and bit width; "-vtok": both streams through the
    magic pattern. fp16 output: rel err 1e-2 (the twin rounds the decoded body to fp16, the kernel keeps it
    in fp32 registers)."""
    parts = make_parts(name, b=2, hkv=2, d=d, pages=3, page=32, lengths=[96, 45], seed=35, dtype=torch.float16)
    q = torch.randn(2, 6, d, generator=torch.Generator().manual_seed(36)).half()
    check_triton(parts, q, block_n=64, tol=1e-2)
    check_triton(parts, q, page_list=random_page_list(2, 2, 3, 2, seed=37), block_n=32, tol=1e-2)


@needs_triton
@pytest.mark.parametrize("name", ["int4", "nuq4-page", "fp8", "int3"])
def test_triton_left_padding(name):
    """row_starts (left padding) inside the sinks, the body and the tail, with a page list: the kernel
    equals the twin, and the twin equals the reference with those positions dropped."""
    parts = make_parts(name, b=3, hkv=2, d=64, pages=4, page=16, sinks=3, tail=5, seed=37)
    parts.row_starts = torch.tensor([2, 40, 69], dtype=torch.int32)  # sinks, body, tail (3 + 64 + 5 held)
    q = torch.randn(3, 6, 64, generator=torch.Generator().manual_seed(38))
    check_triton(parts, q)
    check_triton(parts, q, page_list=random_page_list(3, 2, 4, 3, seed=39))
    want, probs = decode_attention_torch(q, parts, 0.125, return_probs=True)
    assert (probs[0, :, :2] == 0).all() and (probs[1, :, :40] == 0).all() and (probs[2, :, :69] == 0).all()
    row = parts.row_starts[1].item()
    solo = make_parts(name, b=3, hkv=2, d=64, pages=4, page=16, sinks=3, tail=5, seed=37)
    k = torch.cat([solo.sink_k, solo.key.decode(torch.float32), solo.tail_k], 2)[1:2, :, row:]
    v = torch.cat([solo.sink_v, solo.value.decode(torch.float32), solo.tail_v], 2)[1:2, :, row:]
    ref = torch.nn.functional.scaled_dot_product_attention(
        q[1:2, :, None], k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), scale=0.125)[:, :, 0]
    assert rel_err(want[1:2], ref) < 1e-5


def test_affine_levels_are_found_once():
    """Evenly spaced nuq levels (the page-range keys' default codebook) are read as lo + step * c, so the phase
    kernel decodes those keys as integers; other codebooks keep their lookup. Found once per codec."""
    from kvcompress.kernels.streams import _affine_levels

    keys = make_codec(SPECS["nuq4-kout"][0], page_size=16, head_dim=64, num_heads=2, dtype=torch.float32,
                      tensors={}, seed=0)
    lo, step = _affine_levels(keys)
    assert lo == pytest.approx(-1.0) and step == pytest.approx(2 / 15)
    values = make_codec(SPECS["nuq4-kout"][1], page_size=16, head_dim=64, num_heads=2, dtype=torch.float32,
                        tensors={}, seed=1)
    assert _affine_levels(values) is None
    keys.codebook = keys.codebook.clone()
    keys.codebook[3] += 0.01
    assert _affine_levels(keys) == (lo, step)  # cached: a codec's codebook is fixed once it exists


@pytest.mark.parametrize("name", ["int4", "nuq4-kout", "fp8", "nuq3-page"])
def test_tail_length_on_the_device(name):
    """A tail buffer longer than its valid part (a captured decode step's), with the length in a device
    tensor: the twin and the kernel (phase, fp8, paged kernels) equal attention over the valid part only.
    The slack is filled with large values, so reading any of it would show."""
    from dataclasses import replace

    parts = make_parts(name, b=2, hkv=2, d=64, pages=3, page=16, sinks=3, tail=5, seed=41)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(42))
    want, _ = decode_attention_torch(q, parts, 0.125)
    junk = torch.full((2, 2, 6, 64), 30.0)
    padded = replace(parts, tail_k=torch.cat([parts.tail_k, junk], 2), tail_v=torch.cat([parts.tail_v, -junk], 2),
                     tail_lengths=torch.tensor([5]))
    got, _ = decode_attention_torch(q, padded, 0.125)
    assert rel_err(got, want) < 1e-6
    assert rel_err(decode_attention_torch(q, replace(padded, tail_lengths=None), 0.125)[0], want) > 0.1
    if HAVE_TRITON:
        from kvcompress.kernels.decode_attention_triton import decode_attention_triton

        assert rel_err(decode_attention_triton(q, padded, 0.125, block_n=16)[0], want) <= 1e-3


def spy_phase_launches(monkeypatch) -> list:
    """Patch decode_phase_triton's kernel with a spy: the returned list gets each launch's grid."""
    from kvcompress.kernels import decode_phase_triton as phase

    launches = []
    real = phase._phase_split_kernel

    class Spy:
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    monkeypatch.setattr(phase, "_phase_split_kernel", Spy())
    return launches


@needs_triton
@pytest.mark.parametrize("name,d,lut", [
    ("int4", 128, "select"), ("int4", 64, "select"), ("int2", 128, "select"), ("int2", 64, "select"),
    ("int4-vtok", 128, "select"), ("nuq4-kout", 128, "select"), ("nuq4-kout", 64, "gather"),
    ("nuq4-kout", 64, "shuffle"), ("nuq4-ktok", 128, "select"), ("nuq4-ktok", 64, "shuffle"),
    ("nuq2-page", 64, "select"), ("nuq2-vrot", 64, "shuffle")])
def test_phase_kernel_is_used_and_equals_the_others(name, d, lut, monkeypatch):
    """2/4-bit caches with keys per page (KIVI int, the nuq presets' layout with key outliers per page or
    per token, values Hadamard-rotated) go through decode_phase_triton (a spy on its launch says so; int8
    and per-channel nuq keys do not); on GQA 1 / 3 / 8, ragged rows, pages of 16 in tiles of 32 and a page
    list, it equals the twin and the paged kernel it replaces (phase_kernel=False)."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    launches = spy_phase_launches(monkeypatch)
    for g in (1, 3, 8):
        parts = make_parts(name, b=2, hkv=2, d=d, pages=5, page=16, lengths=[80, 37], seed=40 + g)
        q = torch.randn(2, 2 * g, d, generator=torch.Generator().manual_seed(41))
        for pl in (None, random_page_list(2, 2, 5, 3, seed=42)):
            n = len(launches)
            check_triton(parts, q, pl, block_n=None, lut=lut)
            assert len(launches) == n + 1
            paged, _ = decode_attention_triton(q, parts, 0.125, pl, phase_kernel=False, lut=lut)
            assert len(launches) == n + 1
            ours, _ = decode_attention_triton(q, parts, 0.125, pl, lut=lut)
            assert rel_err(ours, paged) <= 1e-5
    for other in ("int8", "nuq4"):
        n = len(launches)
        check_triton(make_parts(other, b=2, hkv=2, d=64, pages=3, seed=43), torch.randn(2, 6, 64), block_n=None)
        assert len(launches) == n


@needs_triton
@pytest.mark.parametrize("name,lut", [("int3", "select"), ("nuq3-vrot", "select"), ("nuq3-vrot", "shuffle"),
                                      ("nuq3-page", "gather")])
def test_three_bit_codes_by_phase(name, lut, monkeypatch):
    """3-bit codes (8 codes in 3 bytes): the phase kernel reads them as 24-bit words of 8 codes at head dim
    128 and as 12-bit words of 4 at head dim 64, each from the one or two 32-bit words it straddles (a spy
    says it ran). With GQA 1 / 4, ragged rows, pages of 16 and 32 and a page list it equals the twin and the
    general kernel (phase_kernel=False). At head dim 32 (8 words, too few for a dot) the general kernel
    reads them."""
    from kvcompress.kernels import decode_phase_triton as phase
    from kvcompress.kernels.streams import stream_args

    launches = spy_phase_launches(monkeypatch)
    for d, g, page in ((128, 1, 16), (128, 4, 32), (64, 3, 32)):
        parts = make_parts(name, b=2, hkv=2, d=d, pages=4, page=page, lengths=[4 * page, 2 * page + 5],
                           seed=60 + g)
        q = torch.randn(2, 2 * g, d, generator=torch.Generator().manual_seed(61))
        for pl in (None, random_page_list(2, 2, 4, 3, seed=62)):
            n = len(launches)
            check_triton(parts, q, pl, block_n=None, lut=lut)
            assert len(launches) == n + 1
            check_triton(parts, q, pl, block_n=None, lut=lut, phase_kernel=False)
            assert len(launches) == n + 1
    key = stream_args(parts.key.codec, parts.key.data, parts.key.row)
    assert [(phase.word_bits(key, d), phase.words(key, d)) for d in (128, 64)] == [(24, 16), (12, 16)]
    assert phase.word_bits(key, 32) == -1
    n = len(launches)
    check_triton(make_parts(name, b=2, hkv=2, d=32, pages=3, seed=63), torch.randn(2, 6, 32), block_n=None)
    assert len(launches) == n


@needs_triton
@pytest.mark.parametrize("name,d,lut", [("nuq4k-nuq3v", 128, "select"), ("nuq4k-nuq3v", 128, "shuffle"),
                                        ("nuq2k-nuq4v", 64, "select"), ("nuq2k-nuq4v", 128, "gather")])
def test_phase_kernel_keys_and_values_at_different_bits(name, d, lut, monkeypatch):
    """nuq keys and values at different bits (a calibrated mixed config's layers): the phase kernel reads
    each stream at its own width (a spy says it ran) and equals the twin, with GQA 4, ragged rows and a
    page list; int streams of different widths stay on the other kernels."""
    from kvcompress.kernels.streams import stream_args

    launches = spy_phase_launches(monkeypatch)
    parts = make_parts(name, b=2, hkv=2, d=d, pages=4, page=32, lengths=[128, 69], seed=70)
    q = torch.randn(2, 8, d, generator=torch.Generator().manual_seed(71))
    for pl in (None, random_page_list(2, 2, 4, 3, seed=72)):
        n = len(launches)
        check_triton(parts, q, pl, block_n=None, lut=lut)
        assert len(launches) == n + 1
    k, v = (stream_args(s.codec, s.data, s.row) for s in (parts.key, parts.value))
    assert k.bits != v.bits
    monkeypatch.setitem(SPECS, "int4k-int2v", (QuantSpec(method="int", bits=4, axis="channel"),
                                               QuantSpec(method="int", bits=2, group_size=32)))
    n = len(launches)
    check_triton(make_parts("int4k-int2v", b=2, hkv=2, d=d, pages=4, page=32, lengths=[128, 69], seed=73), q,
                 block_n=None)
    assert len(launches) == n


@needs_triton
@pytest.mark.parametrize("name", ["nuq4-kout", "nuq4-ktok", "nuq4", "int4", "nuq3-vrot"])
def test_pages_of_48_tokens(name, monkeypatch):
    """Pages whose size is not a power of two (48): the phase kernel reads a page per step in tiles of 16
    (its folded query, outlier list and softmax update once per page; a spy says it ran; splits hold whole
    pages), the general kernel in blocks of 16 (phase_kernel=False; the paged kernel's tiles are whole
    pages, so it is passed over); both equal the twin, with ragged rows, a page list and left padding."""
    from kvcompress.kernels import decode_phase_triton as phase

    assert phase.phase_block(48, None) == 16 and phase.phase_block(48, 8) == 8 and phase.phase_block(32, None) == 32
    with pytest.raises(ValueError, match="power of two"):
        phase.phase_block(48, 24)
    launches = spy_phase_launches(monkeypatch)
    parts = make_parts(name, b=2, hkv=2, d=64, pages=4, page=48, lengths=[192, 101], seed=50)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(51))
    for pl in (None, random_page_list(2, 2, 4, 3, seed=52)):
        n = len(launches)
        check_triton(parts, q, pl, block_n=None)
        assert len(launches) == n + (name != "nuq4")  # nuq4 here: per-channel keys, the general kernel
        check_triton(parts, q, pl, block_n=None, phase_kernel=False)
        assert len(launches) == n + (name != "nuq4")
    parts.row_starts = torch.tensor([1, 70], dtype=torch.int32)  # left padding in the sinks and in a page
    n = len(launches)
    for pl in (None, random_page_list(2, 2, 4, 3, seed=53)):
        check_triton(parts, q, pl, block_n=None)
    assert len(launches) == n + 2 * (name != "nuq4")


@needs_triton
def test_value_levels_by_asm_only_on_checked_triton():
    """The inline-PTX value level lookup is offered only up to the Triton release it was run on (3.6): 3.9's
    compiler aborts on it, so later releases read value levels by shuffle."""
    from kvcompress.kernels.decode_attention_triton import value_levels_by_asm

    assert value_levels_by_asm("3.6.0") and value_levels_by_asm("3.5.1+git1234")
    assert not value_levels_by_asm("3.9.0") and not value_levels_by_asm("3.10.1") and not value_levels_by_asm("x")


@pytest.mark.parametrize("per_head", [False, True])
def test_level_tables_hold_each_level_byte_by_byte(per_head):
    """The byte tables of a 4-bit codebook that the GPU's byte-permute lookup reads: byte j of column k
    (k < 4) and of column 4 + k are the low and high bytes of level 4k + j rounded to bf16 (columns 8-15:
    fp16), one row per kv head where the codebook has one; other widths are refused."""
    from kvcompress.kernels.streams import level_tables

    g = torch.Generator().manual_seed(46)
    levels = torch.sort(torch.randn(3 if per_head else 1, 16, generator=g) * 2)[0]
    codec = make_codec(QuantSpec(method="nuq", bits=4, axis="token"), page_size=16, head_dim=64, num_heads=3,
                       dtype=torch.float32, tensors={"codebook": levels if per_head else levels[0]}, seed=0)
    tables = level_tables(codec, "cpu")
    assert tables.dtype == torch.int32 and tables.shape == (levels.shape[0], 16)
    assert level_tables(codec, "cpu") is tables  # made once per codec
    as_bytes = tables.view(torch.uint8).view(-1, 4, 4, 4).long()  # [H, dtype and byte half, table, byte]
    for i, dtype in enumerate((torch.bfloat16, torch.float16)):
        lo, hi = as_bytes[:, 2 * i].reshape(-1, 16), as_bytes[:, 2 * i + 1].reshape(-1, 16)
        bits = (lo | (hi << 8)).to(torch.int32).to(torch.int16)  # little-endian words: byte j = level 4k + j
        assert torch.equal(bits.view(dtype), levels.to(dtype))
    codec3 = make_codec(QuantSpec(method="nuq", bits=3, axis="token"), page_size=16, head_dim=64, num_heads=3,
                        dtype=torch.float32, tensors={}, seed=0)
    with pytest.raises(ValueError, match="4-bit"):
        level_tables(codec3, "cpu")


@needs_triton
def test_phase_kernel_unpack_choice_is_checked():
    """An unknown unpack, or inline PTX where there is no GPU to run it, is a clear error; None picks what
    runs (Triton's ops here, the same values: tests/test_gpu.py compares the two on the GPU)."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    parts = make_parts("int4", b=1, hkv=2, d=64, pages=2, page=16, seed=44)
    q = torch.randn(1, 4, 64, generator=torch.Generator().manual_seed(45))
    with pytest.raises(ValueError, match="unpack must be"):
        decode_attention_triton(q, parts, 0.125, unpack="simd")
    if not q.is_cuda:
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            decode_attention_triton(q, parts, 0.125, unpack="asm")
    auto, _ = decode_attention_triton(q, parts, 0.125)
    assert torch.equal(auto, decode_attention_triton(q, parts, 0.125, unpack="ops")[0])


@needs_triton
@pytest.mark.parametrize("lut", ["select", "gather", "shuffle"])
def test_phase_kernel_per_head_codebooks(lut):
    """Calibrated codebooks, one per kv head ([H, 16], different for keys and values): the phase kernel
    reads each head's own levels."""
    from kvcompress.kernels import decode_phase_triton as phase
    from kvcompress.kernels.streams import stream_args

    g = torch.Generator().manual_seed(50)
    b, hkv, d, page, n = 2, 2, 64, 16, 64
    streams = []
    for s, spec in enumerate(SPECS["nuq4-kout"]):
        levels = torch.sort(torch.randn(hkv, 16, generator=g) * (1 + s), dim=-1).values
        codec = make_codec(spec, page_size=page, head_dim=d, num_heads=hkv, dtype=torch.float32,
                           tensors={"codebook": levels}, seed=s)
        x = torch.randn(b, hkv, n, d, generator=g)
        row = codec.prepare(x)
        streams.append(PackedStream(codec, codec.encode(x, row), row, n))
    k, v = (stream_args(st.codec, st.data, st.row) for st in streams)
    assert k.codebook_head_stride == 16 and phase.phase_supported(k, v, d, d, page)
    tails = [torch.randn(b, hkv, t, d, generator=g) for t in (2, 2, 5, 5)]
    parts = AttentionParts(streams[0], streams[1], *tails, torch.tensor([64, 41], dtype=torch.int32))
    q = torch.randn(b, 3 * hkv, d, generator=g)
    check_triton(parts, q, block_n=None, lut=lut)
    check_triton(parts, q, random_page_list(b, hkv, 4, 3, seed=51), block_n=None, lut=lut)


@needs_triton
def test_triton_gqa1_blocks_span_pages():
    """GQA 1 (multi-head), several pages per block (outliers of two pages in one block), no sinks/lengths."""
    parts = make_parts("nuq3", b=1, hkv=3, d=64, pages=4, page=16, sinks=0, tail=1, seed=13)
    check_triton(parts, torch.randn(1, 3, 64, generator=torch.Generator().manual_seed(14)), block_n=32)


@needs_triton
def test_triton_through_a_compressed_layer():
    """layer_decode_attention on a CompressedLayer filled by append(): same as attention over layer.dense()."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.config import LayerPolicy

    spec_k, spec_v = SPECS["nuq4"]
    layer = CompressedLayer(LayerPolicy(key=spec_k, value=spec_v, page_size=16, residual=8, sinks=2))
    g = torch.Generator().manual_seed(15)
    layer.update(torch.randn(1, 2, 45, 64, generator=g), torch.randn(1, 2, 45, 64, generator=g))
    layer.update(torch.randn(1, 2, 1, 64, generator=g), torch.randn(1, 2, 1, 64, generator=g))
    q = torch.randn(1, 4, 64, generator=g)
    k, v = layer.dense()
    want = torch.nn.functional.scaled_dot_product_attention(
        q[:, :, None], k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), scale=0.125)[:, :, 0]
    got, _ = layer_decode_attention(layer, q, 0.125, backend="triton")
    assert rel_err(got, want) < 1e-3
    got, _ = layer_decode_attention(layer, q, 0.125, backend="torch")
    assert rel_err(got, want) < 1e-5


# -- Quest ----------------------------------------------------------------------------------------------
def quest_inputs(b=2, hkv=2, g=3, n_pages=9, p=8, d=64, seed=16):
    gen = torch.Generator().manual_seed(seed)
    keys = torch.randn(b, hkv, n_pages, p, d, generator=gen)
    return torch.randn(b, hkv * g, d, generator=gen), keys, keys.amin(3), keys.amax(3)


def test_quest_bound_holds_and_topk_is_best():
    """Radius 1: every head's page logit bounds its q.k over the page; the selection is the top-k of the
    softmax mass summed over the group, within each row's valid pages."""
    from kvcompress.kernels.quest import quest_page_logits_torch, quest_page_scores

    q, keys, lo, hi = quest_inputs()
    logits = quest_page_logits_torch(q, lo, hi).view(2, 2, 3, 9)  # [B, Hkv, G, pages]
    qk = torch.einsum("bhgd,bhnpd->bhgnp", q.view(2, 2, 3, 64), keys).amax(-1)
    assert (logits >= qk - 1e-4).all()
    n_valid = torch.tensor([9, 5])
    pages = quest_select_pages(q, lo, hi, 4, n_valid, scaling=0.125, radius_scale=0.25, backend="torch")
    valid = (torch.arange(9) < n_valid.view(2, 1, 1)).expand(-1, 2, -1)
    mass = quest_page_scores(q, lo, hi, valid, scaling=0.125, radius_scale=0.25, backend="torch")
    best = mass.topk(4, -1).indices.sort(-1).values
    assert torch.equal(pages.long(), best) and (pages[1] < 5).all()
    assert torch.allclose(mass[0].sum(-1), torch.full((2,), 3.0))  # G heads' softmaxes, summed


@needs_triton
def test_quest_triton_matches_torch():
    from kvcompress.kernels.quest import quest_page_logits_torch, quest_page_logits_triton

    q, _, lo, hi = quest_inputs(g=8, hkv=1, n_pages=37)
    for radius in (1.0, 0.25):
        want = quest_page_logits_torch(q, lo, hi, radius)
        got = quest_page_logits_triton(q, lo, hi, radius)
        assert rel_err(got, want) < 1e-6


@needs_triton
@pytest.mark.parametrize("g,hkv,n_pages", [(3, 2, 37), (8, 1, 600)])
def test_quest_mass_triton_matches_torch(g, hkv, n_pages):
    """The fused softmax + group sum equals the torch ops: every page valid, a row with no valid page
    (zeros then -inf), ragged valid prefixes per row, and a mask shared by the kv heads ([B, 1, n]); rows
    held in registers (the default up to 4096 pages) and rows looped over in blocks."""
    from kvcompress.kernels.quest import quest_page_mass_torch, quest_page_mass_triton
    from kvcompress.kernels.quest_triton import quest_mass

    gen = torch.Generator().manual_seed(n_pages)
    logits = torch.randn(3, hkv * g, n_pages, generator=gen) * 8
    n_valid = torch.tensor([n_pages, n_pages // 3, 0])
    ragged = torch.arange(n_pages) < n_valid.view(3, 1, 1)  # [B, 1, n]
    for valid in (None, ragged, ragged.expand(-1, hkv, -1)):
        want = quest_page_mass_torch(logits, hkv, valid, scaling=0.125)
        finite = torch.isfinite(want)
        for got in (quest_page_mass_triton(logits, hkv, valid, scaling=0.125),
                    quest_mass(logits, hkv, valid, 0.125, one_block=16, block_pages=64)):
            assert torch.equal(torch.isinf(got), torch.isinf(want))
            assert rel_err(got[finite], want[finite]) < 1e-6


@needs_triton
@pytest.mark.parametrize("g,hkv,n_pages,k", [(3, 2, 37, 5), (4, 1, 600, 32), (1, 2, 20, 64)])
def test_quest_top_pages_triton_matches_torch(g, hkv, n_pages, k):
    """The top-k in the mass kernel's launch picks the pages the torch stable sort picks, in ascending order
    with -1 last: exact ties (masses that underflow to 0 when one page dominates), ragged valid prefixes,
    a row with no valid page, k larger than the valid pages and than the row."""
    from kvcompress.kernels.quest import quest_page_mass_torch, quest_top_pages_torch
    from kvcompress.kernels.quest_triton import quest_top_pages

    gen = torch.Generator().manual_seed(n_pages + k)
    logits = torch.randn(3, hkv * g, n_pages, generator=gen) * 8
    logits[0, :, 3] = 1e4  # one dominant page: every other mass is exactly 0, a k-way tie
    n_valid = torch.tensor([n_pages, n_pages // 3, 0])
    ragged = torch.arange(n_pages) < n_valid.view(3, 1, 1)
    for valid in (None, ragged):
        mass = quest_page_mass_torch(logits, hkv, valid, scaling=0.125)
        want = quest_top_pages_torch(mass, min(k, n_pages))
        got = quest_top_pages(logits, hkv, min(k, n_pages), valid, 0.125)
        assert torch.equal(got, want)
        kept = want >= 0
        assert torch.equal(kept.sum(-1), torch.isfinite(mass).sum(-1).clamp(max=min(k, n_pages)))
        real = want.clamp(min=0).long()
        assert (want.diff(dim=-1)[kept[..., 1:]] > 0).all()  # ascending, -1 only after the pages
        floor = mass.gather(2, real).masked_fill(~kept, float("inf")).amin(-1, keepdim=True)
        unpicked = mass.scatter(2, real, float("-inf"))
        assert (unpicked <= floor).all()  # no page left out scores above one taken


# -- dispatch -------------------------------------------------------------------------------------------
def test_select_backend(monkeypatch):
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "torch")
    assert select_backend("cpu") == "torch"
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "cuda")
    with pytest.raises(ValueError, match="torch"):
        select_backend("cpu")
    monkeypatch.delenv("KVCOMPRESS_KERNELS")
    assert select_backend("cpu") == "torch"  # the default never picks Triton for CPU tensors


def test_import_needs_no_triton():
    """Only the *_triton modules import Triton at module level; everything else imports it inside functions."""
    import ast
    import pathlib

    import kvcompress.kernels as kernels

    for path in pathlib.Path(kernels.__file__).parent.glob("*.py"):
        top = ast.parse(path.read_text()).body
        names = [a.name for n in top if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in top if isinstance(n, ast.ImportFrom)]
        uses_triton = any(x.split(".")[0] == "triton" for x in names)
        assert uses_triton == path.stem.endswith("_triton"), path.name


# -- page encode (append) -------------------------------------------------------------------------------
# fp8 e4m3 pages are encoded by torch (kernels/page_encode.py says why)
ENCODE_SPECS = [QuantSpec(method="fp8", fp8_format="e5m2"), QuantSpec(method="fp8", fp8_format="e4m3"),
                QuantSpec(method="int", bits=4, axis="channel"), QuantSpec(method="int", bits=2, group_size=32),
                QuantSpec(method="int", bits=8)]


@needs_triton
@pytest.mark.parametrize("spec", ENCODE_SPECS, ids=lambda s: f"{s.method}{s.bits}-{s.axis}-{s.fp8_format}")
def test_triton_page_encode_is_bit_exact(spec):
    """The Triton page encoder writes exactly the codec's fields (codes, fp16 scales, zeros), down to the
    sign of a zero: channels spread over six decades, so FP8 codes include subnormals and negative
    elements that round to -0 (0x80), and a few exact zeros of both signs."""
    from kvcompress.kernels.page_encode import encode_pages_triton

    codec = make_codec(spec, page_size=16, head_dim=64, num_heads=2, dtype=torch.bfloat16, tensors={}, seed=0)
    g = torch.Generator().manual_seed(17)
    x = (torch.randn(2, 2, 32, 64, generator=g) * torch.logspace(-5, 1, 64)).to(torch.bfloat16)
    x[0, 0, :4, 3], x[1, 1, 5:9, 7] = 0.0, -0.0
    want, got = codec.encode(x, {}), encode_pages_triton(codec, x, {})
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


def test_triton_encoder_takes_only_what_it_handles():
    from kvcompress.kernels.page_encode import triton_encodes

    def fp8(**kw):
        return make_codec(QuantSpec(method="fp8"), page_size=kw.pop("page", 16), head_dim=64, num_heads=2,
                          dtype=torch.float32, tensors=kw, seed=0)

    assert triton_encodes(fp8())
    assert not triton_encodes(fp8(page=48))  # the kernel's tiles are powers of two
    assert not triton_encodes(fp8(scale=torch.ones(2)))  # static scales: the codec's torch encode
    assert not triton_encodes(make_codec(SPECS["nuq4-kout"][0], page_size=16, head_dim=64, num_heads=2,
                                         dtype=torch.float32, tensors={}, seed=0))
    for fit, handled in (("minmax", True), ("mse", False)):  # fitted int ranges search on the torch path
        spec = QuantSpec(method="int", bits=2, axis="channel", range_fit=fit)
        assert triton_encodes(make_codec(spec, page_size=16, head_dim=64, num_heads=2, dtype=torch.float32,
                                         tensors={}, seed=0)) is handled


@needs_triton
def test_cache_pages_go_through_the_selected_encoder(monkeypatch):
    """With the Triton backend selected, a layer's pages are encoded by the Triton encoder (FP8 here), and
    hold exactly what the torch backend's layer holds."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.config import LayerPolicy
    from kvcompress.kernels import page_encode

    calls = []
    real = page_encode.encode_pages_triton
    monkeypatch.setattr(page_encode, "encode_pages_triton", lambda *a: calls.append(1) or real(*a))
    g = torch.Generator().manual_seed(70)
    k, v = torch.randn(2, 2, 40, 64, generator=g), torch.randn(2, 2, 40, 64, generator=g)
    stored = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", backend)
        layer = CompressedLayer(LayerPolicy(key=QuantSpec(method="fp8"), value=QuantSpec(method="fp8"),
                                            page_size=16, sinks=2, residual=4))
        layer.update(k, v)
        stored[backend] = dict(layer.key_store.data)
    assert len(calls) == 2  # the triton run's keys and values, none for the torch run
    assert stored["torch"].keys() == stored["triton"].keys()
    for name in stored["torch"]:
        assert torch.equal(stored["torch"][name], stored["triton"][name]), name


def test_store_copies_what_a_graphed_encode_returns(monkeypatch):
    """A graphed page encode (kernels/page_encode_graph.py) returns the graph's own output tensors, which its
    next replay overwrites. Faked here on the CPU by an encoder that writes every result into one buffer per
    shape: a layer fed one page at prefill and then a page at a time stores exactly what the eager encodes
    store (without the store's copy, the first page would be overwritten by the next)."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.config import LayerPolicy
    from kvcompress.kernels import page_encode_graph

    buffers = {}

    def replay(self, x, row):
        out = self.codec.encode(x, row)
        held = buffers.setdefault((id(self), tuple(x.shape)), {k: torch.empty_like(t) for k, t in out.items()})
        for k, t in out.items():
            held[k].copy_(t)
        return held

    g = torch.Generator().manual_seed(71)
    k, v = torch.randn(2, 2, 70, 64, generator=g), torch.randn(2, 2, 70, 64, generator=g)
    policy = LayerPolicy(key=SPECS["nuq4-kout"][0], value=SPECS["nuq4-kout"][1], page_size=16, sinks=2, residual=4)
    stored = {}
    for graphed in (False, True):
        if graphed:
            monkeypatch.setattr(page_encode_graph, "graphs_enabled", lambda x: True)
            monkeypatch.setattr(page_encode_graph.GraphedEncoder, "__call__", replay)
        layer = CompressedLayer(policy)
        layer.update(k[:, :, :22], v[:, :, :22])  # 2 sinks, one page, 4 tail tokens
        assert layer.key_store.n_pages == 1
        for t in range(22, 70):
            layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        stored[graphed] = layer
    assert buffers and stored[True].key_store.n_pages == 4
    for a, b in ((stored[False].key_store, stored[True].key_store), (stored[False].value_store, stored[True].value_store)):
        for name in a.data:
            assert torch.equal(a.data[name], b.data[name]), name


@needs_triton
@pytest.mark.parametrize("name", ["fp8", "int4", "nuq4-kout"])
def test_merge_of_many_splits(name):
    """Batch-1 launches have about 128 splits per pair, which the merge reads in one block (merge_block):
    37 splits (a block of 64, partly masked) and 130 (one block of 128 and a second, nearly empty one)
    equal the twin, for the fp8 kernel (exact parts in the merge) and the phase kernel (its exact split,
    then the plain merge)."""
    from kvcompress.kernels.split_count import merge_block

    assert [merge_block(n) for n in (1, 16, 17, 37, 128, 130)] == [16, 16, 32, 64, 128, 128]
    # the phase kernel walks one page of 32 per block: 37 splits there, both counts on the fp8 kernel
    page, counts = (16, (37, 130)) if name == "fp8" else (32, (37,))
    parts = make_parts(name, b=1, hkv=2, d=64, pages=max(counts), page=page, sinks=3, tail=5, seed=50)
    q = torch.randn(1, 6, 64, generator=torch.Generator().manual_seed(51))
    for splits in counts:
        check_triton(parts, q, block_n=page, splits=splits)


@pytest.mark.parametrize("pairs", [1, 8, 64, 100, 256, 2000])
@pytest.mark.parametrize("n", [100, 8192, 32768, 131072])
def test_default_splits_fill_at_most_one_wave(pairs, n):
    """The fp8 / phase kernels' launch never spills past one wave of resident programs (a nearly empty
    second wave nearly doubled the step on the H200), keeps >= MIN_SPLIT_TOKENS (128) per split where it
    splits, and still fills the wave when the context is long enough; the other kernels keep 16 per
    multiprocessor."""
    from kvcompress.kernels.split_count import MIN_SPLIT_TOKENS, ONE_WARP_PER_SM, default_splits

    sms = 132
    s = default_splits(pairs, sms, n, True)
    assert s >= 1
    assert s == 1 or pairs * s <= ONE_WARP_PER_SM * sms
    assert s == 1 or n // s >= MIN_SPLIT_TOKENS
    if n // MIN_SPLIT_TOKENS >= ONE_WARP_PER_SM * sms // pairs >= 1:  # room to fill: the wave is full
        assert pairs * (s + 1) > ONE_WARP_PER_SM * sms
    assert default_splits(pairs, sms, n, False) == max(1, -(-16 * sms // pairs))


@needs_triton
@pytest.mark.parametrize("name", ["fp8", "fp8-e5m2", "fp8-shift", "fp8-shift-kstatic"])
@pytest.mark.parametrize("group,d", [(1, 128), (3, 64), (8, 64)], ids=["mha-d128", "gqa3-d64", "gqa8-d64"])
def test_fp8_phase_body_equals_twin(name, group, d):
    """The fp8 body with tokens as M of both dots and the values read by phase (decode_fp8_phase_triton,
    the default for 16-bit caches) against the twin and against the body with the query rows as M: left
    padding, ragged lengths, a partly filled last block per split, a Quest page list with holes, the
    probabilities. fp16 inputs (the interpreter's bf16 is not the GPU's; tests/test_gpu.py runs bf16), so
    the tolerance is fp16's (both bodies measured 3e-4 to 6e-4)."""
    parts = make_parts(name, b=3, hkv=2, d=d, pages=5, page=16, sinks=3, tail=5, lengths=[80, 53, 37],
                       seed=50, dtype=torch.float16)
    parts.row_starts = torch.tensor([2, 40, 0], dtype=torch.int32)
    q = torch.randn(3, 2 * group, d, generator=torch.Generator().manual_seed(51)).half()
    check_triton(parts, q, block_n=32, splits=2, tol=2e-3, fp8_phase=True)
    check_triton(parts, q, block_n=32, splits=2, tol=2e-3, fp8_phase=False)
    parts.row_starts = None
    pl = random_page_list(3, 2, 5, 3, seed=52)
    check_triton(parts, q, pl, block_n=16, tol=2e-3, fp8_phase=True)


@needs_triton
def test_fp8_phase_body_keeps_tiny_value_scales():
    """Values around 1e-3 (per-token scales near 1e-5, below fp16's smallest normal): the probabilities
    enter the fp16 dot relative to each block's largest scale, so they keep fp16's precision; p times the
    scale itself goes subnormal (measured 3.8e-3 that way, 6.5e-4 this way)."""
    parts = make_parts("fp8", b=2, hkv=2, d=64, pages=4, page=16, lengths=[64, 45], seed=54,
                       dtype=torch.float16, value_gain=1e-3)
    q = torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(55)).half()
    check_triton(parts, q, block_n=32, splits=2, tol=2e-3, fp8_phase=True)


def test_fp8_phase_body_refuses_what_it_cannot_read():
    """Asked for explicitly, the fp8 phase body says why it cannot run instead of falling back silently."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    parts = make_parts("fp8", b=1, hkv=2, d=64, pages=2, seed=53)  # float32: no fp16 operands
    q = torch.randn(1, 4, 64)
    with pytest.raises(ValueError, match="16-bit model dtype"):
        decode_attention_triton(q, parts, 0.125, fp8_phase=True)
    with pytest.raises(ValueError, match="both fp8"):
        decode_attention_triton(q, make_parts("int4", b=1, hkv=2, d=64, pages=2, seed=53), 0.125, fp8_phase=True)


@needs_triton
# Triton's interpreter gets bfloat16 dots wrong (any of the kernel's bodies, the exact tail too): bf16 on the GPU
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16] + [torch.bfloat16] * torch.cuda.is_available())
def test_full_precision_bodies_read_in_place(dtype):
    """Full-precision held tokens read in place by the fused kernel, against plain softmax attention over the
    same tokens: a layer's tail as whole pages plus a remainder (dense_parts, a view with room after it),
    and H2O's per-kv-head counts packed back to back (ragged_parts: each (row, kv head) from its own
    offset, one head with a single token, one with the largest count). The torch twin gives the same; the
    mass of a head's slots past its count is 0."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton
    from kvcompress.kernels.parts import dense_parts, ragged_parts
    from kvcompress.sparse.ragged import RaggedHeads

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator().manual_seed(3)
    b, h, g, d, width, n_tail = 2, 3, 2, 32, 40, 5
    counts = torch.tensor([[40, 7, 23], [1, 30, 12]])
    k, v = (torch.randn(b, h, width, d, generator=gen).to(dev, dtype) for _ in range(2))
    tk, tv = (torch.randn(b, h, n_tail, d, generator=gen).to(dev, dtype) for _ in range(2))
    q = torch.randn(b, h * g, d, generator=gen).to(dev, dtype)
    ragged = RaggedHeads(k, v, counts.to(dev))
    live = torch.cat([ragged.live(), torch.ones(b, h, n_tail, dtype=torch.bool, device=dev)], 2)

    def reference(keys, values, ok):
        s = torch.einsum("bhgd,bhnd->bhgn", q.float().view(b, h, g, d), keys.float()) * 0.2
        p = s.masked_fill(~ok[:, :, None], float("-inf")).softmax(-1)
        return torch.einsum("bhgn,bhnd->bhgd", p, values.float()).reshape(b, h * g, d), p.sum(2)

    pk, pv = ragged.padded()
    roomy_k, roomy_v = (torch.cat([x, torch.full_like(x[:, :, :9], 1e4)], 2) for x in (k, v))  # slots after
    cases = {
        "ragged": (ragged_parts(ragged, tk, tv), reference(torch.cat([pk, tk], 2), torch.cat([pv, tv], 2), live)),
        "dense": (dense_parts(roomy_k[:, :, :width - 3], roomy_v[:, :, :width - 3]),
                  reference(k[:, :, :width - 3], v[:, :, :width - 3], torch.ones(b, h, width - 3, dtype=torch.bool,
                                                                                 device=dev))),
    }
    tol = 1e-5 if dtype == torch.float32 else 2e-2 if dtype == torch.bfloat16 else 4e-3
    for name, (parts, (out_ref, mass_ref)) in cases.items():
        assert parts.n_body == (width if name == "ragged" else 32)  # whole pages of 16 in the body
        for fn in (decode_attention_torch, decode_attention_triton):
            out, mass = fn(q, parts, 0.2, return_probs=True)
            assert (out.float() - out_ref).abs().max() < tol, (name, fn.__name__)
            assert (mass - mass_ref).abs().max() < tol, (name, fn.__name__)
            if name == "ragged":
                assert float(mass[:, :, :width].masked_select(~ragged.live()).abs().max()) == 0.0
