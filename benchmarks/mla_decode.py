"""One DeepSeek-V3-size MLA attention layer, one decode step (GPU, bf16):

- stock:    transformers' DeepseekV3Attention (re-expands the cached latent through kv_b_proj, then SDPA)
- absorbed: the same module under kvcompress.layout.mla_attention.patch_mla (torch, bf16 latent)
- enabled:  the same absorbed forward on the fused backend, as `kvcompress.enable(model)` runs it on CUDA
            over an exact latent: the Triton kernel with the library's default launch (mla_layer.LAUNCH)
- fused:    absorbed query + kvcompress.kernels.mla_decode (Triton) over the latent as the nuq4 MLA
            preset stores it (4-bit per-channel NUQ kv_nope with 1% outliers per token, FP8 k_rot); also
            without outliers and over the bf16 latent, for reference.

Every variant runs the whole layer (q/kv projections, RoPE, attention, o_proj) over a latent cache of
T tokens held in a preallocated buffer (no per-step concatenation in any variant). With --graph every
variant is captured once in a CUDA graph and the replays are timed: what the device needs per step,
without the host's launch time (eager, one layer at batch 8 spends about 1 ms launching).

    PYTHONPATH=. python benchmarks/mla_decode.py [--graph] [--cases 32768x8 8192x8] [--variants plain,dense]
        [--kernel-sweep] [--out bench_mla.md]
"""

from __future__ import annotations

import argparse
import datetime
import statistics
import types

import torch
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from kvcompress.compat import with_cache
from kvcompress.config import QuantSpec
from kvcompress.kernels.mla_decode import MlaLatent, default_num_splits, merge_partials, mla_decode_triton
from kvcompress.layout.mla_attention import absorb_query, expand_output, patch_mla, split_kv_b_proj
from kvcompress.layout.store import PagedStore
from kvcompress.quant.factory import make_codec

CASES = [(8192, 1), (8192, 8), (32768, 1), (32768, 8)]
VARIANTS = ("plain", "outliers", "dense", "library")  # table order
PAGE = 64


class LatentBuffer:
    """A cache stand-in: the latent of T tokens plus a slot for the new one (what a static cache does)."""

    def __init__(self, kv, kr):
        b, _, t, _ = kv.shape
        self.kv = torch.cat([kv, kv[:, :, :1]], 2)
        self.kr = torch.cat([kr, kr[:, :, :1]], 2)
        self.t = t

    def update(self, k, v, layer_idx, *args, **kwargs):
        self.kv[:, :, self.t:] = k
        self.kr[:, :, self.t:] = v
        return self.kv, self.kr


def deepseek_v3_layer(device):
    cfg = DeepseekV3Config(
        hidden_size=7168, num_attention_heads=128, num_key_value_heads=128, q_lora_rank=1536, kv_lora_rank=512,
        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, num_hidden_layers=1,
        max_position_embeddings=163840, attn_implementation="sdpa",
    )
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    attn = DeepseekV3Attention(cfg, 0).to(device, torch.bfloat16).eval()
    rope = DeepseekV3RotaryEmbedding(cfg).to(device)
    return cfg, attn, rope


def pack_latent(kv, kr, outliers: float) -> MlaLatent:
    """kv [B, 1, T, 512], kr [B, 1, T, 64] -> MlaLatent as the nuq4 MLA preset's stores hold it."""
    kspec = QuantSpec(method="nuq", bits=4, axis="channel", outlier_fraction=outliers, outlier_scope="token")
    vspec = QuantSpec(method="fp8")
    stores = []
    for spec, x, seed in ((kspec, kv, 0), (vspec, kr, 1)):
        codec = make_codec(spec, page_size=PAGE, head_dim=x.shape[-1], num_heads=1, dtype=x.dtype, tensors={}, seed=seed)
        store = PagedStore(codec.to(x.device))
        for lo in range(0, x.shape[2], 4096):  # encode in chunks to bound the temporaries
            store.append(x[:, :, lo: lo + 4096])
        stores.append(store)
    return MlaLatent.from_stores(*stores)


def fused_forward(attn, latent: MlaLatent, launch: dict):
    """A forward for `attn` that attends with the fused kernel over `latent` (decode, one new token
    whose own latent is left out: the benchmark measures the cache read)."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    def forward(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
        b, s, _ = hidden_states.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden_states)))
        q = q.view(b, s, -1, self.qk_head_dim).transpose(1, 2)
        q_nope, q_rot = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        ckv = self.kv_a_proj_with_mqa(hidden_states)
        _, k_rot = torch.split(ckv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_rot, _ = apply_rotary_pos_emb_interleave(q_rot, k_rot.view(b, 1, s, -1), *position_embeddings)
        w_uk, w_uv = split_kv_b_proj(self.kv_b_proj.weight, self.num_heads, self.qk_nope_head_dim, self.v_head_dim)
        q_latent = absorb_query(q_nope, w_uk)[:, :, 0].contiguous()  # [B, H, R]
        out, lse = mla_decode_triton(q_latent, q_rot[:, :, 0].contiguous(), latent, self.scaling, **launch)
        o_latent = merge_partials(out, lse).to(q.dtype)[:, :, None]  # [B, H, 1, R]
        o = expand_output(o_latent, w_uv).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(o), None

    return types.MethodType(forward, attn)


def time_ms(fn, warmup=3, reps=20) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def graph_ms(fn, warmup=3, reps=20) -> float:
    """time_ms of the replays of `fn` captured in a CUDA graph (warm-up runs first, on a side stream)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    ms = time_ms(graph.replay, warmup=warmup, reps=reps)
    del graph
    return ms


TIMER = time_ms  # graph_ms with --graph


def tune(attn, hidden, pe, latent, b, t, name: str) -> dict:
    """Pick block_h / num_warps / num_stages / splits for the fused kernel over `latent` at one shape,
    from eager timings (a graph per config would cost minutes of capture); prints every try."""
    best, best_ms = None, float("inf")
    for block_h in (16, 32, 64):
        for warps in (4, 8):
            base = default_num_splits(b, 128, t, block_h)
            for stages, factor in ((1, 1), (1, 2), (2, 1)):
                launch = dict(block_h=block_h, num_warps=warps, num_stages=stages, num_splits=base * factor)
                try:
                    fwd = fused_forward(attn, latent, launch)
                    ms = time_ms(lambda: fwd(hidden, pe), warmup=2, reps=10)
                except Exception as e:  # a config that does not compile (shared memory) is reported and skipped
                    print(f"  tune {name} {launch}: failed ({type(e).__name__}: {str(e)[:120]})")
                    continue
                print(f"  tune {name} {launch}: {ms:.3f} ms", flush=True)
                if ms < best_ms:
                    best, best_ms = launch, ms
    return best


def library_launch(latent: MlaLatent, b: int, t: int) -> dict:
    """The launch `kvcompress.enable` uses for this latent (mla_layer.launch_for)."""
    from kvcompress.kernels.mla_layer import launch_for

    return launch_for(latent, 128, b, torch.device("cuda"), tokens=t)


class FrozenLayer:
    """A cache stand-in over one `CompressedLayer`: each update defers the step to the fused path as
    `CompressedLayer.update` does on a decode step, but leaves the layer as it is (a graph replays the same
    step; the new token's own latent is left out, as in the other variants)."""

    def __init__(self, layer):
        self.layer = layer

    def update(self, k, v, layer_idx, *args, **kwargs):
        from kvcompress.kernels.attention_backend import defers_dense

        assert defers_dense(self.layer, k), "the fused path does not serve this layer"
        return k, v


def library_layer(cfg, kv, kr):
    """The nuq4 MLA preset's CompressedLayer holding the latent kv [B, 1, T, 512] / kr [B, 1, T, 64]
    (4 exact sinks, packed body, exact tail), filled as a prefill fills it."""
    from kvcompress import CompressedCache

    cache = CompressedCache(cfg, "nuq4")
    for lo in range(0, kv.shape[2], 4096):
        cache.update(kv[:, :, lo: lo + 4096], kr[:, :, lo: lo + 4096], 0)
    return cache.layers[0]


def enabled_forward(attn, buf):
    """The library path: the absorbed forward (patch_mla) on the fused backend over a dense bf16 latent
    cache, as `kvcompress.enable(model)` runs a DynamicCache on CUDA (kernel launch from mla_layer.LAUNCH)."""
    from kvcompress.kernels.attention_backend import begin_forward, end_forward

    def step(hidden, pe):
        begin_forward(True)
        try:
            return attn(hidden, pe, None, **with_cache(buf))
        finally:
            end_forward()

    return step


def _launches(*rows):
    keys = ("block_h", "num_warps", "num_stages")
    return [dict(zip(keys, r[:3]), **(r[3] if len(r) > 3 else {})) for r in rows]


# launches tried per latent kind: heads per program, warps, stages (BENCHMARKS.md, issue 8, has what else was
# tried: the scores through memory to stop Triton repeating the score product in both warp groups, the dense
# kernel with tokens as rows, warp specialization; none was faster)
SWEEP = {
    "dense": _launches((64, 8, 2), (64, 8, 1), (32, 4, 2)),
    "plain": _launches((64, 8, 1), (64, 8, 2), (128, 16, 1)),
    "outliers": _launches((64, 8, 1), (128, 16, 1)),
}


def random_step(b: int, t: int, seed: int):
    """A random bf16 latent kv [B, 1, T, 512], k_rot [B, 1, T, 64] and absorbed queries ql [B, 128, 512],
    qr [B, 128, 64] on the GPU, with the generator that drew them."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(seed)
    draw = lambda *shape: torch.randn(*shape, device=dev, dtype=torch.bfloat16, generator=g)  # noqa: E731
    return draw(b, 1, t, 512), draw(b, 1, t, 64), draw(b, 128, 512), draw(b, 128, 64), g


def kernel_sweep(b: int, t: int, kinds=("dense", "plain", "outliers")) -> list[str]:
    """The kernel alone (no projections) at T x B, replayed from a CUDA graph, over the launches of SWEEP
    (split count: the library's, one wave of programs) for each latent kind: dense bf16, nuq4, nuq4 + 1 %
    outliers per token (tiles of 64 tokens, the presets' page)."""
    from kvcompress.kernels.mla_layer import LAUNCH

    kv, kr, ql, qr, _ = random_step(b, t, seed=1)
    flops = 2 * b * 128 * t * (576 + 512)
    lines = [f"kernel alone, T={t} B={b}, graph replays (library defaults {LAUNCH}):",
             "| latent | launch | splits | ms | TFLOP/s | rel. err vs first launch |", "|---|---|---|---|---|---|"]
    for kind in kinds:
        if kind == "dense":
            latent = MlaLatent(kv=kv[:, 0], k_rot=kr[:, 0], latent_dim=512, page_size=PAGE)
        else:
            latent = pack_latent(kv, kr, 0.01 if kind == "outliers" else 0.0)
        first = None
        for launch in SWEEP[kind]:
            splits = default_num_splits(b, 128, t, launch["block_h"])
            fn = lambda: merge_partials(*mla_decode_triton(ql, qr, latent, 0.07, splits, **launch))  # noqa: E731
            try:
                ms = graph_ms(fn)
                out = fn().float()
            except Exception as e:  # out of shared memory or registers: reported, skipped
                print(f"  sweep {kind} {launch}: failed ({type(e).__name__}: {str(e)[:100]})", flush=True)
                continue
            first = out if first is None else first
            err = ((out - first).norm() / first.norm()).item()
            lines.append(f"| {kind} | {launch} | {splits} | {ms:.3f} | {flops / ms / 1e9:.0f} | {err:.1e} |")
            print(lines[-1], flush=True)
        del latent
    return lines


def quest_kernel(b: int, t: int, budget: int) -> list[str]:
    """The packed kernel alone at T x B over every page, and over a page list of budget / 64 pages (random,
    the first page always in), as Quest's selection makes the library read it; graph replays."""
    kv, kr, ql, qr, g = random_step(b, t, seed=3)
    dev = kv.device
    n = budget // PAGE
    pages = torch.stack([torch.cat([torch.zeros(1, device=dev, dtype=torch.int64),
                                    1 + torch.randperm(t // PAGE - 1, device=dev, generator=g)[: n - 1]]).sort().values
                         for _ in range(b)]).to(torch.int32)
    lines = [f"packed kernel alone, T={t} B={b}, every page vs a page list of {n} (Quest at {budget} tokens):",
             "| latent | all pages (ms) | page list (ms) | speed-up |", "|---|---|---|---|"]
    for kind, frac in (("nuq4", 0.0), ("nuq4 + 1 % outliers", 0.01)):
        latent = pack_latent(kv, kr, frac)
        times = []
        for listed in (None, pages):
            launch = library_launch(latent, b, t if listed is None else n * PAGE)
            splits = launch.pop("num_splits")
            times.append(graph_ms(lambda: merge_partials(*mla_decode_triton(ql, qr, latent, 0.07, splits, pages=listed,
                                                                             **launch))))
        lines.append(f"| {kind} | {times[0]:.3f} | {times[1]:.3f} | {times[0] / times[1]:.1f}x |")
        print(lines[-1], flush=True)
        del latent
    return lines


@torch.no_grad()
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--graph", action="store_true", help="time replays of a CUDA graph of each variant")
    ap.add_argument("--cases", nargs="*", default=None, help="TxB shapes, e.g. 32768x8 (default: all four)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help="fused variants to time: plain (nuq4), outliers (nuq4 + 1%% outliers), dense (bf16 latent), "
                         "library (the nuq4 preset's CompressedLayer through the library's decode path)")
    ap.add_argument("--kernel-sweep", action="store_true", help="also time the kernel alone over a grid of launches")
    ap.add_argument("--sweep-only", action="store_true", help="only the kernel sweep (at the largest case)")
    ap.add_argument("--quest", type=int, default=0,
                    help="only the packed kernel over every page vs a Quest page list of this many tokens")
    ap.add_argument("--tune", action="store_true",
                    help="pick each fused variant's launch from eager timings (default: the library's launch)")
    args = ap.parse_args()
    variants = set(args.variants.split(","))
    global TIMER
    TIMER = graph_ms if args.graph else time_ms
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases] if args.cases else CASES
    if args.quest:
        t, b = max(cases, key=lambda c: c[0] * c[1])
        print("\n".join(quest_kernel(b, t, args.quest)))
        return
    if args.sweep_only:
        t, b = max(cases, key=lambda c: c[0] * c[1])
        text = "\n".join(kernel_sweep(b, t))
        print(text)
        if args.out:
            with open(args.out, "w") as fh:
                fh.write(text + "\n")
        return
    dev = torch.device("cuda")
    cfg, attn, rope = deepseek_v3_layer(dev)
    rows, launches, used = [], {}, {}
    for t, b in sorted(cases, key=lambda c: -c[0] * c[1]):
        g = torch.Generator(device=dev).manual_seed(t + b)
        kv = torch.randn(b, 1, t, 512, device=dev, dtype=torch.bfloat16, generator=g)
        kr = torch.randn(b, 1, t, 64, device=dev, dtype=torch.bfloat16, generator=g)
        hidden = torch.randn(b, 1, 7168, device=dev, dtype=torch.bfloat16, generator=g)
        pos = torch.full((b, 1), t, device=dev)
        pe = rope(hidden, pos)
        buf = LatentBuffer(kv, kr)
        stock = TIMER(lambda: attn(hidden, pe, None, **with_cache(buf)))
        ref = attn(hidden, pe, None, **with_cache(buf))[0].float()
        undo = patch_mla(attn)
        absorbed = TIMER(lambda: attn(hidden, pe, None, **with_cache(buf)))
        out_abs = attn(hidden, pe, None, **with_cache(buf))[0].float()
        enabled = enabled_forward(attn, buf)
        enabled_ms = TIMER(lambda: enabled(hidden, pe))
        out_enabled = enabled(hidden, pe)[0].float()
        undo()
        latents = {
            "plain": lambda: pack_latent(kv, kr, 0.0),
            "outliers": lambda: pack_latent(kv, kr, 0.01),
            "dense": lambda: MlaLatent(kv=kv[:, 0], k_rot=kr[:, 0], latent_dim=512, page_size=PAGE),
            "library": lambda: library_layer(cfg, kv, kr),
        }
        ms, sq = {"stock": stock, "absorbed": absorbed, "enabled": enabled_ms}, {}
        for name in VARIANTS:
            if name not in variants:
                ms[name], sq[name] = float("nan"), float("nan")
                continue
            latent = latents[name]()
            if name == "library":  # the library's own decode path over the preset's layer (mla_layer_decode)
                undo = patch_mla(attn)
                fwd = enabled_forward(attn, FrozenLayer(latent))
                ms[name] = TIMER(lambda: fwd(hidden, pe))
                out = fwd(hidden, pe)[0].float()
                undo()
                sq[name] = (10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum())).item()
                del latent, fwd, out
                continue
            if not args.tune:
                launches[name] = library_launch(latent, b, t)
            elif name == "outliers" and "plain" in launches:  # the same kernel, 6 selects more per token
                launches[name] = dict(launches["plain"])
            else:  # tuned per shape (the split count depends on it)
                launches[name] = tune(attn, hidden, pe, latent, b, t, name)
            used[f"{name} {t}x{b}"] = launches[name]
            print("launch", name, launches[name], flush=True)
            fwd = fused_forward(attn, latent, launches[name])
            ms[name] = TIMER(lambda: fwd(hidden, pe))
            out = fwd(hidden, pe)[0].float()  # leaves the new token out (the variants time the cache read)
            sq[name] = (10 * torch.log10(ref.pow(2).sum() / (out - ref).pow(2).sum())).item()
            del latent, fwd, out
        errs = {k: ((o - ref).norm() / ref.norm()).item() for k, o in (("absorbed", out_abs), ("enabled", out_enabled))}
        rows.append((t, b, ms, sq, errs))
        print(rows[-1], flush=True)
        del buf, kv, kr
        torch.cuda.empty_cache()

    lines = [
        "# MLA decode, one DeepSeek-V3 attention layer (128 heads, latent 512 + 64, bf16)",
        "",
        f"Date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}; device: {torch.cuda.get_device_name()}; "
        f"torch {torch.__version__}; command: `PYTHONPATH=. python benchmarks/mla_decode.py{' --graph' if args.graph else ''}`; "
        f"timing: {'CUDA graph replays' if args.graph else 'eager'}; kernel launches: {used}",
        "",
        "| T | B | stock (ms) | absorbed torch (ms) | enabled, fused bf16 (ms) | fused nuq4 (ms) "
        "| fused nuq4+1% outl. (ms) | fused bf16 (ms) | enabled, nuq4 preset layer (ms) | stock/absorbed "
        "| stock/enabled | absorbed/fused nuq4 | absorbed/enabled nuq4 preset | rel.err absorbed / enabled "
        "| SQNR nuq4 / +outl. / bf16 / preset layer (dB) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for t, b, ms, sq, errs in sorted(rows, key=lambda r: (r[0], r[1])):
        cells = " | ".join(f"{ms[k]:.3f}" for k in ("stock", "absorbed", "enabled", *VARIANTS))
        lines.append(
            f"| {t} | {b} | {cells} | {ms['stock'] / ms['absorbed']:.1f}x | {ms['stock'] / ms['enabled']:.1f}x "
            f"| {ms['absorbed'] / ms['plain']:.2f}x | {ms['absorbed'] / ms['library']:.2f}x "
            f"| {errs['absorbed']:.1e} / {errs['enabled']:.1e} "
            f"| {sq['plain']:.1f} / {sq['outliers']:.1f} / {sq['dense']:.1f} / {sq['library']:.1f} |"
        )
    if args.kernel_sweep:
        t, b = max(cases, key=lambda c: c[0] * c[1])
        lines += ["", *kernel_sweep(b, t)]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text)


if __name__ == "__main__":
    main()
