"""Absorbed MLA attention for DeepSeek-V3 (kvcompress.layout.mla_attention), the MLA presets, and the
fused MLA decode kernel against its torch twin (under TRITON_INTERPRET=1 on CPU)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import DynamicCache

import kvcompress
from kvcompress import CompressedCache, KVCompressConfig, ModelLayout
from kvcompress.compat import with_cache
from kvcompress.kernels.mla_decode import (
    MlaLatent,
    dequantize_latent,
    merge_partials,
    mla_decode_torch,
)
from kvcompress.layout.mla_attention import is_mla, patch_mla
from kvcompress.quant.codebook import gaussian_lloyd_max
from kvcompress.quant.pack import pack

from conftest import make_tiny_model

DECODE_STEPS = 32
MLA_DIMS = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=16)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest single-threaded (no thread start-up per op on a shared 2-core CI box)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def deepseek():
    """Tiny DeepSeek-V3: hidden 64, 4 heads, latent 32 + 16, one dense and one (tiny) MoE layer, fp32."""
    return make_tiny_model("deepseek_v3", **MLA_DIMS)


@pytest.fixture(scope="module")
def padded_batch():
    """Two prompts of 7 and 12 tokens, left padded to 12."""
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 256, (2, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    ids[0, :5] = 0
    return ids, mask


def _greedy(model, ids, mask, cache, steps=DECODE_STEPS):
    """Prefill then `steps` greedy decode steps; returns the logits of every step [steps+1, B, V] and tokens."""
    logits, tokens = [], []
    out = model(ids, attention_mask=mask, **with_cache(cache))
    for _ in range(steps):
        step = out.logits[:, -1]
        logits.append(step)
        nxt = step.argmax(-1, keepdim=True)
        tokens.append(nxt)
        mask = torch.cat([mask, torch.ones_like(nxt)], 1)
        out = model(nxt, attention_mask=mask, **with_cache(cache))
    logits.append(out.logits[:, -1])
    return torch.stack(logits), torch.cat(tokens, 1), out


def _rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


@torch.no_grad()
def test_absorbed_matches_stock_prefill_and_decode(deepseek, padded_batch):
    """fp32, batch 2 with left padding, prefill + 32 decode steps: logits within 1e-4 relative, same tokens."""
    ids, mask = padded_batch
    stock_logits, stock_tokens, _ = _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config))
    stock_prefill = deepseek(ids, attention_mask=mask).logits
    undo = patch_mla(deepseek)
    try:
        logits, tokens, _ = _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config))
        prefill = deepseek(ids, attention_mask=mask).logits
    finally:
        undo()
    valid = mask.bool()
    assert _rel_err(prefill[valid], stock_prefill[valid]) <= 1e-4
    assert _rel_err(logits, stock_logits) <= 1e-4
    assert torch.equal(tokens, stock_tokens)


@torch.no_grad()
def test_eager_mask_and_compressed_cache(padded_batch):
    """Eager (float additive mask) and an uncompressed CompressedCache give the stock results too."""
    model = make_tiny_model("deepseek_v3", attn_implementation="eager", **MLA_DIMS)
    ids, mask = padded_batch
    stock_logits, stock_tokens, _ = _greedy(model, ids, mask, DynamicCache(config=model.config), steps=8)
    undo = patch_mla(model)
    try:
        logits, tokens, _ = _greedy(model, ids, mask, CompressedCache(model.config, "none"), steps=8)
    finally:
        undo()
    assert _rel_err(logits, stock_logits) <= 1e-4
    assert torch.equal(tokens, stock_tokens)


@torch.no_grad()
def test_kv_b_proj_never_sees_cached_tokens(deepseek, padded_batch):
    """Absorbed: kv_b_proj's forward is never called (its weights are folded into query and output);
    stock: it is called on the whole cached latent every step (the hook sees T tokens)."""
    ids, mask = padded_batch
    seen = []
    hooks = [
        layer.self_attn.kv_b_proj.register_forward_hook(lambda m, a, o: seen.append(a[0].shape[-2]))
        for layer in deepseek.model.layers
    ]
    try:
        _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config), steps=2)
        assert max(seen) == ids.shape[1] + 2  # stock re-expands the cache
        seen.clear()
        undo = patch_mla(deepseek)
        try:
            _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config), steps=4)
        finally:
            undo()
        assert seen == []
    finally:
        for h in hooks:
            h.remove()


def test_undo_restores_stock_forwards():
    """undo() puts back exactly what was there (no instance attribute, or a user's own), class untouched."""
    model = make_tiny_model("deepseek_v3", **MLA_DIMS)
    other = make_tiny_model("deepseek_v3", **MLA_DIMS)
    attns = [layer.self_attn for layer in model.model.layers]
    cls_forward = type(attns[0]).forward
    own = attns[1].forward  # a user's own instance-level forward must survive
    attns[1].forward = own
    assert is_mla(model)
    undo = patch_mla(model)
    assert all("forward" in a.__dict__ for a in attns)
    assert "forward" not in other.model.layers[0].self_attn.__dict__  # scoped to this model
    assert type(attns[0]).forward is cls_forward
    undo()
    assert "forward" not in attns[0].__dict__
    assert attns[1].__dict__["forward"] is own
    undo()  # twice is harmless
    assert not is_mla(make_tiny_model("llama"))


@torch.no_grad()
def test_uncompressed_cache_holds_the_latent(deepseek, padded_batch):
    """'none' holds kv_lora_rank + qk_rope_head_dim values per token per layer (and per batch row)."""
    ids, mask = padded_batch
    cache = CompressedCache(deepseek.config, "none")
    undo = patch_mla(deepseek)
    try:
        deepseek(ids, attention_mask=mask, **with_cache(cache))
    finally:
        undo()
    rep = cache.memory_report()
    per_token = MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"]
    n_layers = deepseek.config.num_hidden_layers
    assert rep["held_bytes"] == n_layers * ids.numel() * per_token * 4  # float32
    assert rep["uncompressed_bytes"] == rep["held_bytes"]


def test_nuq4_preset_on_mla_layout():
    """nuq4 on an MLA layout: latent per-channel NUQ with outliers, k_rot in FP8; GQA nuq4 unchanged."""
    model = make_tiny_model("deepseek_v3", **MLA_DIMS)
    layout = ModelLayout.from_model_config(model.config)
    assert layout.attention == "mla"
    cfg = KVCompressConfig.from_preset("nuq4", layout)
    lp = cfg.layers[0]
    assert (lp.key.method, lp.key.bits, lp.key.axis, lp.key.outlier_fraction) == ("nuq", 4, "channel", 0.01)
    assert lp.value.method == "fp8"
    gqa = KVCompressConfig.from_preset("nuq4", make_tiny_model("llama").config).layers[0]
    assert gqa.value.method == "nuq"


@torch.no_grad()
def test_nuq4_compressed_latent_runs_absorbed(deepseek, padded_batch):
    """A nuq4 CompressedCache (a page of latent really quantized) under absorbed attention: logits
    within 15 dB SQNR of the stock model on the exact cache."""
    ids = torch.randint(3, 256, (2, 72), generator=torch.Generator().manual_seed(4))  # sinks + one page
    mask = torch.ones_like(ids)
    mask[0, :6] = 0
    stock_logits, _, _ = _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config), steps=4)
    undo = patch_mla(deepseek)
    try:
        cache = CompressedCache(deepseek.config, "nuq4")
        logits, _, _ = _greedy(deepseek, ids, mask, cache, steps=4)
    finally:
        undo()
    sqnr = 10 * torch.log10(stock_logits.pow(2).sum() / (logits - stock_logits).pow(2).sum())
    assert sqnr > 15, f"logit SQNR {sqnr:.1f} dB"
    assert cache.layers[0].key_store.n_tokens > 0  # pages were really quantized


# -- kernel twins -------------------------------------------------------------------------------------
def _packed_latent(b, t, r, dr, page, n_out, fp8_rot, seed=0, per_token=0):
    """A random packed latent built by hand (4-bit codes, channel stats, outliers, fp8 k_rot): n_out
    outliers per page anywhere in it, or (per_token > 0) that many in every token, listed token by token."""
    g = torch.Generator().manual_seed(seed)
    cb = gaussian_lloyd_max(4)
    codes = torch.randint(0, 16, (b, t, r), generator=g)
    mean, scale = torch.randn(b, r, generator=g) * 0.1, torch.rand(b, r, generator=g) + 0.5
    oidx = oval = None
    if per_token:
        n_out = per_token * page
        chans = torch.stack([torch.randperm(r, generator=g)[:per_token].sort().values for _ in range(b * t)])
        oidx = (torch.arange(t).repeat(b) % page)[:, None] * r + chans  # [B * T, per_token]
        oidx = oidx.view(b, t // page, n_out).to(torch.int16)
    elif n_out:
        oidx = torch.stack([torch.randperm(page * r, generator=g)[:n_out].sort().values for _ in range(b * t // page)])
        oidx = oidx.view(b, t // page, n_out).to(torch.int16)
    if n_out:
        oval = (torch.randn(b, t // page, n_out, generator=g) * 4).to(torch.float16)
    k_rot = torch.randn(b, t, dr, generator=g)
    krs = None
    if fp8_rot:
        krs = (k_rot.abs().amax(-1) / 448).to(torch.float16)
        k_rot = (k_rot / krs.float()[..., None]).to(torch.float8_e4m3fn).view(torch.uint8)
    return MlaLatent(kv=pack(codes, 4), k_rot=k_rot, latent_dim=r, page_size=page, codebook=cb,
                     channel_mean=mean, channel_scale=scale, outlier_idx=oidx, outlier_val=oval, k_rot_scale=krs,
                     outliers_per_token=per_token)


def test_twin_matches_plain_attention():
    """The torch twin (split 3 ways and merged) equals softmax attention over the dequantized latent."""
    lat = _packed_latent(2, 128, 32, 16, 16, 5, fp8_rot=True)
    g = torch.Generator().manual_seed(1)
    ql, qr = torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 16, generator=g)
    kv, kr = dequantize_latent(lat, torch.float32)
    ref = torch.softmax((ql @ kv.transpose(1, 2) + qr @ kr.transpose(1, 2)) * 0.3, -1) @ kv
    out = merge_partials(*mla_decode_torch(ql, qr, lat, 0.3, num_splits=3))
    assert (out - ref).abs().max() < 1e-5
    # outliers really are exact entries of the latent
    p, pos = lat.outlier_idx[0, 1, 0].item() // 32, lat.outlier_idx[0, 1, 0].item() % 32
    assert kv[0, 16 + p, pos] == lat.outlier_val[0, 1, 0].float()


def test_absorbed_products_match_einsum():
    """absorb_query / expand_output read W_UK and W_UV as strided views of kv_b_proj's weight and equal the
    einsums they stand for."""
    from kvcompress.layout.mla_attention import absorb_query, expand_output, split_kv_b_proj

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(4 * (16 + 8), 32, generator=g)  # 4 heads, Dn 16, Dv 8, latent 32
    w_uk, w_uv = split_kv_b_proj(weight, 4, 16, 8)
    q_nope, o_latent = torch.randn(3, 4, 2, 16, generator=g), torch.randn(3, 4, 2, 32, generator=g)
    assert torch.allclose(absorb_query(q_nope, w_uk), torch.einsum("bhsd,hdr->bhsr", q_nope, w_uk), atol=1e-5)
    assert torch.allclose(expand_output(o_latent, w_uv), torch.einsum("bhsr,hvr->bhsv", o_latent, w_uv), atol=1e-5)


def test_launch_fills_one_wave():
    """The split count puts at most one wave of programs on the multiprocessors (at DeepSeek-V3 sizes on 132
    of them: 8 splits of 16 programs), keeps 4 tiles per split on short contexts, and small models get
    small head blocks."""
    from kvcompress.kernels.mla_decode import default_num_splits
    from kvcompress.kernels.mla_layer import launch_for

    assert default_num_splits(8, 128, 32768, 64, sms=132) == 8
    assert default_num_splits(1, 128, 32768, 64, sms=132) == 66
    assert default_num_splits(8, 128, 32768, 128, sms=132) == 16
    assert default_num_splits(64, 128, 32768, 64, sms=132) == 1  # 128 programs already
    assert default_num_splits(1, 128, 600, 64, sms=132) == 2  # 600 tokens: at least 4 tiles per split
    for b in (1, 3, 8, 32):
        programs = b * 2 * default_num_splits(b, 128, 1 << 20, 64, sms=132)
        assert programs <= max(132, b * 2)
    packed = _packed_latent(2, 128, 32, 16, 16, 0, fp8_rot=False)
    launch = launch_for(packed, heads=4, batch=2, device=torch.device("cpu"))
    assert launch["block_h"] == 16 and launch["num_warps"] == 4
    with_outliers = _packed_latent(2, 128, 32, 16, 16, 0, fp8_rot=False, per_token=1)
    assert launch_for(with_outliers, heads=128, batch=8, device=torch.device("cpu"))["block_h"] == 128


def _triton_or_skip():
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("run with TRITON_INTERPRET=1 to test the Triton kernel on CPU")
    pytest.importorskip("triton", reason="Triton is not installed (pip install triton)")
    from kvcompress.kernels.mla_decode import mla_decode_triton

    return mla_decode_triton


@pytest.mark.parametrize(
    "packed,n_out,fp8_rot,heads,t,splits,dtype",
    [
        (True, 2, True, 6, 64, 2, torch.float32),
        (True, 2, True, 6, 64, 2, torch.float16),
        (True, 0, False, 16, 48, 1, torch.float32),
        (True, 0, False, 16, 48, 1, torch.float16),
        (False, 0, False, 20, 40, 3, torch.float32),
        (False, 0, False, 20, 40, 3, torch.float16),
    ],
)
def test_triton_kernel_matches_twin(packed, n_out, fp8_rot, heads, t, splits, dtype):
    """Kernel vs twin on small awkward shapes: heads not a multiple of the block, a ragged last tile
    (dense), empty splits, outliers (n_out per token), fp8 k_rot. fp32: both sides see the same dequantized tile (1e-3
    covers exp2 vs exp). fp16: the packed kernel looks levels up in its byte-pair table and rounds the
    query times the channel scale to fp16 where the twin rounds the dequantized latent: 1e-2."""
    mla_decode_triton = _triton_or_skip()
    page = 16
    if packed:
        lat = _packed_latent(2, t, 32, 16, page, 0, fp8_rot, per_token=n_out)
    else:
        g = torch.Generator().manual_seed(2)
        lat = MlaLatent(kv=torch.randn(2, t, 32, generator=g).to(dtype), k_rot=torch.randn(2, t, 16, generator=g).to(dtype),
                        latent_dim=32, page_size=page)  # a dense latent is held in the model dtype
    g = torch.Generator().manual_seed(3)
    ql = torch.randn(2, heads, 32, generator=g).to(dtype)
    qr = torch.randn(2, heads, 16, generator=g).to(dtype)
    tol = 1e-3 if dtype == torch.float32 else 1e-2
    ref_out, ref_lse = mla_decode_torch(ql, qr, lat, 0.25, num_splits=splits)
    out, lse = mla_decode_triton(ql, qr, lat, 0.25, num_splits=splits, block_h=16)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert (lse[finite] - ref_lse[finite]).abs().max() < tol
    merged, ref = merge_partials(out, lse), merge_partials(ref_out, ref_lse)
    assert _rel_err(merged, ref) < tol


@pytest.mark.parametrize("packed", [True, False])
def test_kernel_scores_give_the_attention_mass(packed):
    """The scores the kernels write for H2O (masked tokens -inf): equal to the twin's, and `token_mass` of
    them with the partials' lse is the softmax attention per token summed over the heads (each head's
    attention sums to 1, so the mass sums to the number of heads)."""
    mla_decode_triton = _triton_or_skip()
    from kvcompress.kernels.mla_decode import token_mass

    b, h, t = 2, 6, 48
    if packed:
        lat = _packed_latent(b, t, 32, 16, 16, 0, True, per_token=1)
    else:
        g = torch.Generator().manual_seed(2)
        lat = MlaLatent(kv=torch.randn(b, t, 32, generator=g), k_rot=torch.randn(b, t, 16, generator=g),
                        latent_dim=32, page_size=16)
    g = torch.Generator().manual_seed(4)
    ql, qr = torch.randn(b, h, 32, generator=g), torch.randn(b, h, 16, generator=g)
    allowed = torch.rand(b, t, generator=g) > 0.3
    kv, kr = dequantize_latent(lat, torch.float32)
    logits = (ql @ kv.transpose(1, 2) + qr @ kr.transpose(1, 2)) * 0.25
    want = torch.softmax(logits.masked_fill(~allowed[:, None], float("-inf")), -1).sum(1)  # [B, T]
    for fn in (mla_decode_torch, mla_decode_triton):
        scores = torch.full((b, h, t), float("-inf"))
        out, lse = fn(ql, qr, lat, 0.25, 3, allowed, scores=scores)
        assert torch.isinf(scores[~allowed[:, None].expand(b, h, t)]).all()
        mass = token_mass(scores, lse)
        assert (mass - want).abs().max() < 1e-4
        assert torch.allclose(mass.sum(-1), torch.full((b,), float(h)), atol=1e-4)
    with pytest.raises(ValueError, match="page list"):
        mla_decode_torch(ql, qr, lat, 0.25, 1, scores=torch.zeros(b, h, t),
                         pages=torch.zeros(b, 1, dtype=torch.long))


def test_packed_kernel_fp32_queries_with_fp16_tiles():
    """fp32 queries on a GPU multiply the packed tiles as fp16 (two fp32 half tiles do not fit in shared
    memory): forced here, the result stays within fp16 rounding (1e-2) of the fp32 twin."""
    mla_decode_triton = _triton_or_skip()
    lat = _packed_latent(2, 64, 32, 16, 16, 0, fp8_rot=True, seed=7, per_token=2)
    g = torch.Generator().manual_seed(8)
    ql, qr = torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 16, generator=g)
    ref = merge_partials(*mla_decode_torch(ql, qr, lat, 0.25, num_splits=2))
    exact = merge_partials(*mla_decode_triton(ql, qr, lat, 0.25, num_splits=2, tile_f16=False))
    half = merge_partials(*mla_decode_triton(ql, qr, lat, 0.25, num_splits=2, tile_f16=True))
    assert _rel_err(exact, ref) < 1e-3 and 1e-6 < _rel_err(half, ref) < 1e-2  # fp16 really ran, and is close


def test_triton_kernel_refuses_outliers_chosen_per_page():
    """Outliers listed per page cannot be folded into the tile: a clear error that names the fix."""
    mla_decode_triton = _triton_or_skip()
    lat = _packed_latent(1, 32, 32, 16, 16, 5, fp8_rot=False)
    q = torch.randn(1, 4, 32)
    with pytest.raises(ValueError, match="outlier_scope='token'"):
        mla_decode_triton(q, q[..., :16].contiguous(), lat, 0.25)


def test_mla_preset_keeps_outliers_per_token():
    """The MLA nuq4 preset keeps 1 % of each token's latent exactly (6 of 512 at DeepSeek-V3 size): every
    token of a page has its own, listed token by token, so the fused kernel can read the layer."""
    from kvcompress.kernels.mla_layer import mla_fused_supported

    cfg = make_tiny_model("deepseek_v3", kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=16,
                          v_head_dim=16).config
    cache = CompressedCache(cfg, "nuq4")
    kv = torch.randn(1, 1, 132, 512)
    kv[..., 5] *= 30  # one loud channel: a per-page choice would spend every outlier on it
    cache.update(kv, torch.randn(1, 1, 132, 64), 0)
    layer = cache.layers[0]
    idx = layer.key_store.data["outlier_idx"][0, 0].long()  # [pages, 64 * 6]
    assert idx.shape[-1] == 64 * 6
    assert torch.equal(idx // 512, torch.arange(64).repeat_interleave(6).expand_as(idx))
    assert mla_fused_supported(layer)


def test_triton_kernel_reads_a_mask():
    """A keep-mask [B, T] with holes, one split wholly masked in one row: kernel = twin, and that split's
    lse is -inf with a zero output (merging it adds nothing)."""
    mla_decode_triton = _triton_or_skip()
    lat = _packed_latent(2, 64, 32, 16, 16, 0, fp8_rot=True, seed=4, per_token=2)
    g = torch.Generator().manual_seed(5)
    allowed = torch.rand(2, 64, generator=g) > 0.3
    allowed[1, :32] = False  # row 1: the first of two splits sees nothing
    ql, qr = torch.randn(2, 5, 32, generator=g), torch.randn(2, 5, 16, generator=g)
    ref_out, ref_lse = mla_decode_torch(ql, qr, lat, 0.25, num_splits=2, allowed=allowed)
    out, lse = mla_decode_triton(ql, qr, lat, 0.25, num_splits=2, allowed=allowed, block_h=16)
    assert torch.isneginf(ref_lse[1, :, 0]).all() and torch.isneginf(lse[1, :, 0]).all()
    assert out[1, :, 0].abs().max() == 0
    finite = torch.isfinite(ref_lse)
    assert (lse[finite] - ref_lse[finite]).abs().max() < 1e-3
    merged, ref = merge_partials(out, lse), merge_partials(ref_out, ref_lse)
    kv, kr = dequantize_latent(lat, torch.float32)
    s = ((ql @ kv.transpose(1, 2) + qr @ kr.transpose(1, 2)) * 0.25).masked_fill(~allowed[:, None], float("-inf"))
    assert _rel_err(merged, ref) < 1e-3 and _rel_err(ref, torch.softmax(s, -1) @ kv) < 1e-5


@torch.no_grad()
def test_deepseek_v2_absorbed_matches_stock():
    """DeepSeek-V2 attention (complex-number RoPE) absorbs the same way: prefill logits within 1e-4."""
    import transformers

    cfg = transformers.DeepseekV2Config(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, first_k_dense_replace=1, n_group=1, topk_group=1, **MLA_DIMS,
    )
    torch.manual_seed(0)
    model = transformers.DeepseekV2ForCausalLM(cfg).eval()
    ids = torch.randint(3, 256, (2, 10), generator=torch.Generator().manual_seed(5))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    stock = model(ids, attention_mask=mask).logits
    undo = patch_mla(model)
    try:
        absorbed = model(ids, attention_mask=mask).logits
    finally:
        undo()
    assert _rel_err(absorbed, stock) <= 1e-4


@torch.no_grad()
def test_enable_with_the_fused_backend(deepseek, monkeypatch):
    """Under kvcompress.enable on the fused backend (what CUDA gets by default; here Triton's interpreter),
    a compressed MLA cache still hands the absorbed attention its latent: the same logits as the torch
    backend. (The GQA fused path used to defer these layers too, and the second layer then raised.)"""
    ids = torch.randint(3, 256, (2, 72), generator=torch.Generator().manual_seed(5))
    runs = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", backend)
        kvcompress.enable(deepseek)
        try:
            cache = CompressedCache(deepseek.config, "nuq4")
            steps = [deepseek(ids, **with_cache(cache)).logits[:, -1]]
            for i in range(3):
                steps.append(deepseek(ids[:, i:i + 1], **with_cache(cache)).logits[:, -1])
            runs[backend] = torch.stack(steps)
        finally:
            kvcompress.disable(deepseek)
    torch.testing.assert_close(runs["triton"], runs["torch"])


@torch.no_grad()
def test_fused_decode_reads_the_packed_latent(deepseek, monkeypatch):
    """On the fused backend a decode step of a compressed MLA layer runs the kernel over the packed body
    (sinks and tail exact, merged by log-sum-exp) and never decodes the cache: logits equal the torch
    backend's (which attends over the dequantized latent), with left padding reaching into the body."""
    _triton_or_skip()
    import kvcompress.kernels.mla_decode as mla_mod
    from kvcompress.cache import CompressedLayer

    ids = torch.randint(3, 256, (2, 72), generator=torch.Generator().manual_seed(6))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # past the 4 sinks: the body's first tokens are padding
    runs, counts = {}, {}
    kernel, dense = mla_mod.mla_decode_triton, CompressedLayer.dense
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", backend)
        calls = {"kernel": 0, "dense": 0}

        def counted_kernel(*a, **k):
            calls["kernel"] += 1
            return kernel(*a, **k)

        def counted_dense(self):
            calls["dense"] += 1
            return dense(self)

        monkeypatch.setattr("kvcompress.kernels.mla_layer.mla_decode_triton", counted_kernel)
        kvcompress.enable(deepseek)
        try:
            cache = CompressedCache(deepseek.config, "nuq4")
            deepseek(ids, attention_mask=mask, **with_cache(cache))
            monkeypatch.setattr(CompressedLayer, "dense", counted_dense)
            logits, tokens, _ = _greedy(deepseek, ids[:, -1:], mask, cache, steps=3)
            monkeypatch.setattr(CompressedLayer, "dense", dense)
        finally:
            kvcompress.disable(deepseek)
        runs[backend], counts[backend] = (logits, tokens), dict(calls)
    # 2 layers x 4 decode steps x (packed body + exact sinks and tail)
    assert counts["triton"]["dense"] == 0 and counts["triton"]["kernel"] == 2 * 4 * 2
    assert counts["torch"]["kernel"] == 0 and counts["torch"]["dense"] > 0
    assert _rel_err(runs["triton"][0], runs["torch"][0]) < 1e-4
    assert torch.equal(runs["triton"][1], runs["torch"][1])


@torch.no_grad()
def test_fused_decode_over_an_exact_latent(deepseek, padded_batch, monkeypatch):
    """A plain DynamicCache under enable on the fused backend: decode steps run the kernel over the
    exact latent; logits match the stock model's (fp32, relative 1e-4) and greedy tokens are equal."""
    _triton_or_skip()
    ids, mask = padded_batch
    stock_logits, stock_tokens, _ = _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config), steps=6)
    monkeypatch.setenv("KVCOMPRESS_KERNELS", "triton")
    kvcompress.enable(deepseek)
    try:
        logits, tokens, _ = _greedy(deepseek, ids, mask, DynamicCache(config=deepseek.config), steps=6)
    finally:
        kvcompress.disable(deepseek)
    assert _rel_err(logits, stock_logits) <= 1e-4
    assert torch.equal(tokens, stock_tokens)


# -- sparsity on the MLA latent (kvcompress.sparse.mla) ----------------------------------------------
def _sparse_config(model, spec, base: str = "none"):
    from kvcompress import LayerPolicy, SparsitySpec  # noqa: F401 (SparsitySpec: the callers' specs)

    cfg = KVCompressConfig.from_preset(base, ModelLayout.from_model_config(model.config))
    cfg.layers = [LayerPolicy(key=p.key, value=p.value, page_size=p.page_size, residual=p.residual, sinks=p.sinks,
                              sparsity=spec) for p in cfg.layers]
    return cfg


@torch.no_grad()
@pytest.mark.parametrize("method", ["h2o", "streaming", "snapkv", "quest"])
def test_sparse_mla_with_room_for_everything_is_exact(deepseek, padded_batch, method):
    """A budget that covers the context keeps every token: the sparse MLA step (policy bookkeeping, mask by
    position, attention over one latent head for all query heads) gives the lossless path's logits."""
    from kvcompress import SparsitySpec

    ids, mask = padded_batch
    with kvcompress.enabled(deepseek, backend="torch"):
        ref, ref_tokens, _ = _greedy(deepseek, ids, mask, CompressedCache(deepseek.config, "none"), steps=12)
        cache = CompressedCache(deepseek.config, _sparse_config(deepseek, SparsitySpec(method=method, budget=4096,
                                                                                       page_size=4)))
        logits, tokens, _ = _greedy(deepseek, ids, mask, cache, steps=12)
    assert all(layer.sparse is not None for layer in cache.layers)
    assert _rel_err(logits, ref) < 1e-5
    assert torch.equal(tokens, ref_tokens)


@torch.no_grad()
@pytest.mark.parametrize("base", ["none", "nuq4"])
def test_h2o_on_mla_holds_its_budget(deepseek, base):
    """H2O on the latent evicts while decoding: over 150 steps the tokens held never pass the budget plus
    one page, and the bytes held stay flat once it is reached (exact latent, and the packed nuq4 latent)."""
    from kvcompress import SparsitySpec

    budget = 48
    ids = torch.randint(3, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    cache = CompressedCache(deepseek.config, _sparse_config(deepseek, SparsitySpec(method="h2o", budget=budget), base))
    # the eviction slack: a whole page of the packed body, or the policy's page over an exact latent
    page = cache.kv_config.layers[0].page_size if base != "none" else cache.layers[0].sparse.policy.page_size
    held, held_bytes = [], []
    with kvcompress.enabled(deepseek, backend="torch"):
        out = deepseek(ids, **with_cache(cache))
        for _ in range(150):
            out = deepseek(out.logits[:, -1:].argmax(-1), **with_cache(cache))
            held.append(cache.layers[-1].held_tokens)
            held_bytes.append(cache.memory_report()["held_bytes"])
    assert max(held) <= budget + page
    assert cache.layers[-1].cumulative_length == 190
    # bounded: the last 50 steps hold no more than the first 100 did at most (a sawtooth as pages fill)
    assert max(held_bytes[-50:]) <= max(held_bytes[:100])


@torch.no_grad()
def test_quest_on_mla_reads_the_top_pages(deepseek):
    """Quest on the latent: page summaries span the latent and the RoPE key; a decode step reads the
    pages its bound ranks highest within the budget (plus the sinks' page and the newest), nothing is
    evicted, and with every page selected the step equals the dense one."""
    from kvcompress import SparsitySpec
    from kvcompress.sparse.quest import page_scores

    ids = torch.randint(3, 256, (1, 96), generator=torch.Generator().manual_seed(4))
    spec = SparsitySpec(method="quest", budget=32, page_size=8)
    cache = CompressedCache(deepseek.config, _sparse_config(deepseek, spec))
    seen = {}
    real_select = type(cache.layers[1].sparse.policy).select

    def spy(self, state, query, mask):
        idx = real_select(self, state, query, mask)
        if state.layer_idx == 1 and idx is not None:
            seen.update(query=query, idx=idx, page_min=state.page_min, page_max=state.page_max, scaling=state.step.scaling)
        return idx

    with kvcompress.enabled(deepseek, backend="torch"):
        out = deepseek(ids, **with_cache(cache))
        type(cache.layers[1].sparse.policy).select = spy
        try:
            deepseek(out.logits[:, -1:].argmax(-1), **with_cache(cache))
        finally:
            type(cache.layers[1].sparse.policy).select = real_select
    width = MLA_DIMS["kv_lora_rank"] + MLA_DIMS["qk_rope_head_dim"]
    assert seen["page_min"].shape[-1] == width and seen["query"].shape[-1] == width
    assert cache.layers[1].held_tokens == 97  # nothing evicted
    idx = seen["idx"][0, 0]
    assert idx.numel() < 97 and cache.tokens_read_last_step() < 97
    pages = idx[:-1].reshape(-1, 8)[:, 0] // 8  # the whole pages read (the newest page comes last)
    n_cand = 96 // 8  # the 12 full pages before the newest token's page
    q = seen["query"].reshape(1, 1, -1, width)
    real = torch.ones(1, 1, n_cand, dtype=torch.bool)
    score = page_scores(q, seen["page_min"][:, :, :n_cand], seen["page_max"][:, :, :n_cand], real, seen["scaling"],
                        0.25)[0, 0]
    score[0] = float("inf")  # the sinks' page is always read
    assert set(pages.tolist()) == set(score.topk(pages.numel()).indices.tolist())


@torch.no_grad()
def test_sparse_mla_without_enable_names_the_fix(deepseek):
    """A sparse policy on an MLA model run without `kvcompress.enable` is refused with the fix in the message."""
    from kvcompress import SparsitySpec
    from kvcompress.config import ConfigError
    from kvcompress.sparse.state import clear_pending

    cache = CompressedCache(deepseek.config, _sparse_config(deepseek, SparsitySpec(method="h2o", budget=16)))
    try:
        with pytest.raises(ConfigError, match="kvcompress.enable"):
            deepseek(torch.randint(3, 256, (1, 20)), **with_cache(cache))
    finally:
        clear_pending()


def test_triton_kernel_reads_a_page_list():
    """The packed kernel with Quest's page list reads only the listed pages (in list order, -1 reads
    nothing, the splits dividing the list) and matches its twin; the twin equals attention over those
    pages' tokens alone."""
    mla_decode_triton = _triton_or_skip()
    lat = _packed_latent(2, 128, 32, 16, 16, 0, fp8_rot=True, per_token=1)  # 8 pages of 16
    g = torch.Generator().manual_seed(7)
    ql, qr = torch.randn(2, 6, 32, generator=g), torch.randn(2, 6, 16, generator=g)
    pages = torch.tensor([[0, 3, 5, -1], [1, 2, 7, 6]])
    allowed = torch.ones(2, 128, dtype=torch.bool)
    allowed[1, 16:20] = False  # inside page 1 of row 1
    ref_out, ref_lse = mla_decode_torch(ql, qr, lat, 0.25, 2, allowed, pages)
    out, lse = mla_decode_triton(ql, qr, lat, 0.25, 2, allowed, pages=pages, block_h=16, tile_f16=False)
    assert _rel_err(merge_partials(out, lse), merge_partials(ref_out, ref_lse)) < 1e-3
    assert torch.allclose(lse, ref_lse, atol=1e-3)
    kv, kr = dequantize_latent(lat, torch.float32)
    for row, listed in enumerate(pages.tolist()):
        tok = torch.cat([torch.arange(p * 16, p * 16 + 16) for p in listed if p >= 0])
        tok = tok[allowed[row, tok]]
        w = torch.softmax((ql[row] @ kv[row, tok].T + qr[row] @ kr[row, tok].T) * 0.25, -1)
        assert (merge_partials(ref_out, ref_lse)[row] - w @ kv[row, tok]).abs().max() < 1e-5


def _fused_against_torch(model, cfg, ids, steps: int, monkeypatch):
    """Prefill ids into a fresh CompressedCache(cfg) under kvcompress.enable, then decode `steps` greedy tokens,
    on the torch and on the Triton backend; on Triton a decode step that decodes the cache (dense()) fails.
    -> ({backend: logits [steps + 1, B, V]}, {backend: cache}, the keyword arguments of every MLA kernel call)."""
    from kvcompress.cache import CompressedLayer
    from kvcompress.kernels import mla_layer

    runs, caches, calls = {}, {}, []
    dense, kernel = CompressedLayer.dense, mla_layer.mla_decode_triton

    def spy_kernel(*a, **k):
        calls.append(k)
        return kernel(*a, **k)

    def no_dense(self):
        raise AssertionError("the fused decode step decoded the cache")

    monkeypatch.setattr(mla_layer, "mla_decode_triton", spy_kernel)
    for backend in ("torch", "triton"):
        monkeypatch.setenv("KVCOMPRESS_KERNELS", backend)
        with kvcompress.enabled(model):
            cache = CompressedCache(model.config, cfg)
            out = model(ids, **with_cache(cache))
            logits = [out.logits[:, -1]]
            if backend == "triton":
                monkeypatch.setattr(CompressedLayer, "dense", no_dense)
            for _ in range(steps):
                out = model(logits[-1].argmax(-1, keepdim=True), **with_cache(cache))
                logits.append(out.logits[:, -1])
            monkeypatch.setattr(CompressedLayer, "dense", dense)
        runs[backend], caches[backend] = torch.stack(logits), cache
    return runs, caches, calls


@torch.no_grad()
def test_quest_on_mla_runs_fused(deepseek, monkeypatch):
    """nuq4+quest on DeepSeek: on the fused backend the decode steps read the packed body's selected pages
    through the kernel (a page list, no dense() of the cache) and give the torch backend's logits."""
    _triton_or_skip()
    from kvcompress import SparsitySpec

    ids = torch.randint(3, 256, (1, 200), generator=torch.Generator().manual_seed(11))
    cfg = _sparse_config(deepseek, SparsitySpec(method="quest", budget=96, page_size=64), "nuq4")
    for p in cfg.layers:
        p.sinks = 0
    runs, caches, calls = _fused_against_torch(deepseek, cfg, ids, 6, monkeypatch)
    for cache in caches.values():
        assert cache.tokens_read_last_step() < cache.layers[1].held_tokens
    lists = [k.get("pages") for k in calls]
    assert any(p is not None and p.shape[-1] < 4 for p in lists)  # 3 body pages, fewer than the body's
    assert _rel_err(runs["triton"], runs["torch"]) < 1e-4


@torch.no_grad()
def test_h2o_on_mla_runs_fused(deepseek, monkeypatch):
    """H2O over the packed nuq4 latent on the fused backend: the decode steps read the packed body through
    the kernel (no dense() of the cache), which writes the scores H2O sums into attention mass; the logits,
    the tokens kept and their accumulated scores match the torch backend's."""
    _triton_or_skip()
    from kvcompress import SparsitySpec

    ids = torch.randint(3, 256, (1, 120), generator=torch.Generator().manual_seed(13))
    cfg = _sparse_config(deepseek, SparsitySpec(method="h2o", budget=96), "nuq4")
    # 40 steps: past the budget plus a page, so the layers evict while decoding
    runs, caches, calls = _fused_against_torch(deepseek, cfg, ids, 40, monkeypatch)
    kept = {}
    for backend, cache in caches.items():
        layer = cache.layers[-1]
        kept[backend] = (layer.sparse.positions(layer.held_tokens, layer.sink_k), layer.sparse.scores)
        assert layer.held_tokens <= 96 + layer.key_store.page_size
    assert calls and all(k.get("scores") is not None for k in calls)
    assert torch.equal(kept["triton"][0], kept["torch"][0])
    assert _rel_err(kept["triton"][1], kept["torch"][1]) < 1e-4
    assert _rel_err(runs["triton"], runs["torch"]) < 1e-4


def test_sparse_presets_on_mla_build_on_the_mla_base():
    """A sparse preset over nuq4 means the MLA nuq4 on an MLA layout (latent per channel, RoPE key in FP8),
    with Quest's pages the body's pages (what the fused kernel reads)."""
    from dataclasses import replace

    from kvcompress.kernels.mla_layer import mla_fused_supported

    model = make_tiny_model("deepseek_v3", **MLA_DIMS)
    cfg = KVCompressConfig.from_preset("nuq4+quest-1024", ModelLayout.from_model_config(model.config))
    policy = cfg.layers[-1]
    assert policy.key.axis == "channel" and policy.key.outlier_scope == "token" and policy.value.method == "fp8"
    assert policy.sparsity.method == "quest" and policy.sparsity.page_size == policy.page_size and policy.sinks == 0
    for p in cfg.layers:  # the preset keeps the first 2 layers dense: all the tiny model has
        p.sparsity = replace(p.sparsity, dense_layers=0)
    cache = CompressedCache(model.config, cfg)
    with torch.no_grad(), kvcompress.enabled(model, backend="torch"):
        model(torch.randint(3, 256, (1, 80)), **with_cache(cache))
    assert cache.layers[-1].sparse is not None and mla_fused_supported(cache.layers[-1])


def test_absorbed_prefill_runs_in_query_blocks(monkeypatch):
    """A long prefill's scores are computed a block of queries at a time (bounded memory), with the same
    result and the mask sliced with its queries."""
    import kvcompress.layout.mla_attention as mla_mod

    g = torch.Generator().manual_seed(12)
    b, h, s, t, r, dr = 2, 4, 37, 50, 32, 16
    ql, qr = torch.randn(b, h, s, r, generator=g), torch.randn(b, h, s, dr, generator=g)
    kv, kr = torch.randn(b, 1, t, r, generator=g), torch.randn(b, 1, t, dr, generator=g)
    mask = mla_mod.additive_mask(torch.ones(b, t).index_fill_(1, torch.arange(5), 0), b, s, t, "cpu", torch.float32)
    whole = mla_mod.absorbed_attention(ql, qr, kv, kr, 0.2, mask)
    monkeypatch.setattr(mla_mod, "SCORE_ELEMENTS", b * h * t * 5)  # blocks of 5 queries
    blocked = mla_mod.absorbed_attention(ql, qr, kv, kr, 0.2, mask)
    assert torch.allclose(blocked, whole, atol=1e-6)
