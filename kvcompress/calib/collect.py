"""Stream calibration text through the model and gather, per layer, what the cache would hold.

For each layer and stream (keys, values) this keeps: running per-channel mean / std of the keys and
per-head absmax of both streams over every calibration token (the first `skip_first` positions of each
window excluded from the mean / std: those are the attention sinks the NUQ policies keep exact), a
random subsample of tokens for codebook fitting, and, for full GQA layers, how much each sampled element
matters to attention (KVQuant, arXiv:2401.18079, weights its k-means by a Fisher-information proxy; this
uses the attention itself):

- key element (j, c): mean over later queries i of sum_h p[h, i, j] * q[h, i, c]**2, the weight of an
  error in k[j, c] on the logits q_i . k_j that it feeds, counted by how much attention those logits get;
- value token j: mean over later queries of sum_h p[h, i, j], the share of the attention output it makes.

K/V are read from a transformers DynamicCache after each batch (what is really cached, MLA latents
included); queries come from a scoped wrapper of the model's attention function, removed on exit.
A small probe (queries, keys and values of the first window) is kept for the sensitivity measurement.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from kvcompress.config import ConfigError
from kvcompress.evaluation.progress import progress_display
from kvcompress.layout.arch import ModelLayout

WEIGHTINGS = ("attention", "none")


@dataclass
class CollectSettings:
    """samples windows of seq_len tokens, batch_size windows per forward; sample_tokens tokens kept per layer."""

    samples: int = 32
    seq_len: int = 1024
    batch_size: int = 4
    sample_tokens: int = 4096
    skip_first: int = 4
    probe_tokens: int = 512
    query_stride: int = 4
    weighting: str = "attention"
    seed: int = 0

    def __post_init__(self):
        if self.samples < 1 or self.batch_size < 1 or self.sample_tokens < 1 or self.query_stride < 1:
            raise ConfigError("samples, batch_size, sample_tokens and query_stride must be >= 1")
        if self.seq_len <= self.skip_first + 16:
            raise ConfigError(f"seq_len must exceed {self.skip_first + 16} tokens, got {self.seq_len}")
        if self.weighting not in WEIGHTINGS:
            raise ConfigError(f"unknown weighting {self.weighting!r}; use one of {WEIGHTINGS}")


@dataclass
class LayerStats:
    """What calibration saw of one layer. Shapes: H kv heads, N sampled tokens, Dk / Dv head dims."""

    keys: torch.Tensor  # [H, N, Dk] float32
    values: torch.Tensor  # [H, N, Dv]
    key_weight: torch.Tensor | None  # [H, N, Dk] (None: unweighted)
    value_weight: torch.Tensor | None  # [H, N]
    key_amax: torch.Tensor  # [H] over every calibration token
    value_amax: torch.Tensor  # [H]
    key_mean: torch.Tensor  # [H, Dk]
    key_std: torch.Tensor  # [H, Dk]
    probe_k: torch.Tensor  # [1, H, P, Dk] first window, as cached
    probe_v: torch.Tensor  # [1, H, P, Dv]
    probe_q: torch.Tensor | None = None  # [1, Hq, P, Dk] (None when the cache holds something else, e.g. MLA)
    query_energy: torch.Tensor | None = None  # [H, Dk] mean q_c^2 over the group's query heads (None: as probe_q)
    # [1, Hq, P, Dv] the Fisher information of the probe's attention output (calib/fisher.py; None: not measured)
    probe_fisher: torch.Tensor | None = None
    scaling: float = 1.0
    tokens: int = 0


@dataclass
class _Running:
    """Per-layer accumulators while batches stream through."""

    key_sum: torch.Tensor | None = None
    key_sq: torch.Tensor | None = None
    count: int = 0
    key_amax: torch.Tensor | None = None
    value_amax: torch.Tensor | None = None
    keys: list = field(default_factory=list)
    values: list = field(default_factory=list)
    key_weight: list = field(default_factory=list)
    value_weight: list = field(default_factory=list)
    query_sq: torch.Tensor | None = None  # [H, Dk] sum of q^2 over the group's heads and positions
    query_count: int = 0
    probe: dict = field(default_factory=dict)


def calibration_windows(token_ids: list[int], samples: int, seq_len: int) -> torch.Tensor:
    """[samples, seq_len] windows of the token stream, evenly spaced (overlapping if the text is short).

    Raises a ConfigError naming the sizes when the text has fewer than seq_len tokens.
    """
    n = len(token_ids)
    if n == 0:
        raise ConfigError("the calibration text is empty; pass a text file with --text (or use the shipped one)")
    if n < seq_len:
        raise ConfigError(
            f"the calibration text has {n} tokens, fewer than one window of --seq-len {seq_len}; "
            "use a longer text or a shorter --seq-len"
        )
    ids = torch.tensor(token_ids, dtype=torch.long)
    if samples == 1:
        starts = [0]
    else:
        stride = (n - seq_len) / (samples - 1)
        starts = [int(round(i * stride)) for i in range(samples)]
    return torch.stack([ids[s : s + seq_len] for s in starts])


@contextlib.contextmanager
def wrap_attention(model, hook):
    """Within the block, every attention call of `model` also calls hook(module, query, key, value, output,
    scaling); a hook that returns a tensor replaces the output with it.

    A local override of the model's implementation in transformers' attention registry, removed on exit.
    query [B, Hq, T, D], key / value [B, Hkv, T, D] (as cached, before any repeat), output [B, T, Hq, Dv].
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    impl = getattr(model.config, "_attn_implementation", None) or "sdpa"
    local = ALL_ATTENTION_FUNCTIONS._local_mapping
    had_local, previous = impl in local, local.get(impl)
    original = ALL_ATTENTION_FUNCTIONS.get(impl, sdpa_attention_forward) if impl != "eager" else sdpa_attention_forward

    def wrapped(module, query, key, value, attention_mask, *args, **kwargs):
        out, weights = original(module, query, key, value, attention_mask, *args, **kwargs)
        scaling = kwargs.get("scaling") or getattr(module, "scaling", None) or query.shape[-1] ** -0.5
        replaced = hook(module, query, key, value, out, float(scaling))
        return (out if replaced is None else replaced), weights

    local[impl] = wrapped
    try:
        yield
    finally:
        if had_local:
            local[impl] = previous
        else:
            del local[impl]


def record_queries(model, sink):
    """A context in which every attention call also calls sink(layer_idx, query, key, scaling)
    (wrap_attention). query: [B, Hq, T, D], key: [B, Hkv, T, D]."""
    return wrap_attention(model, lambda m, q, k, v, out, s: sink(getattr(m, "layer_idx", None), q, k, s))


def attention_importance(query: torch.Tensor, key: torch.Tensor, scaling: float, stride: int):
    """How much each cached element matters to causal attention, from every `stride`-th query.

    query: [B, Hq, T, D], key: [B, Hkv, T, D] ->
    key weight [B, Hkv, T, D] = mean_i sum_h p[h,i,j] q[h,i,c]^2, value weight [B, Hkv, T] = mean_i sum_h p[h,i,j].
    """
    b, hq, t, d = query.shape
    hkv = key.shape[1]
    group = hq // hkv
    qi = torch.arange(0, t, stride, device=query.device)
    q = query[:, :, qi].float()  # [B, Hq, Tq, D]
    k = key.float().repeat_interleave(group, dim=1)  # [B, Hq, T, D]
    logits = torch.matmul(q, k.transpose(-1, -2)) * scaling  # [B, Hq, Tq, T]
    causal = qi[:, None] >= torch.arange(t, device=query.device)[None, :]
    p = logits.masked_fill(~causal, float("-inf")).softmax(-1)
    n_queries = causal.sum(0).clamp_min(1).float()  # [T] queries that see key j
    vw = p.sum(2).reshape(b, hkv, group, t).sum(2) / n_queries  # [B, Hkv, T]
    kw = torch.matmul(p.transpose(-1, -2), q.pow(2))  # [B, Hq, T, D]
    kw = kw.reshape(b, hkv, group, t, d).sum(2) / n_queries[:, None]
    return kw, vw


def collect(model, windows: torch.Tensor, settings: CollectSettings, progress: bool = True) -> list[LayerStats]:
    """Run `windows` [N, L] through `model` in batches; return one LayerStats per layer."""
    from transformers import DynamicCache

    from kvcompress.compat import with_cache

    layout = ModelLayout.from_model_config(model.config)
    running = [_Running() for _ in range(layout.num_layers)]
    device = next(model.parameters()).device
    gen = torch.Generator().manual_seed(settings.seed)
    n_batches = math.ceil(windows.shape[0] / settings.batch_size)
    per_batch = math.ceil(settings.sample_tokens / n_batches)
    # queries match the cached keys only for GQA/MHA (an MLA cache holds latents)
    use_queries = layout.attention == "gqa"
    weighted = settings.weighting == "attention"
    state: dict = {}

    def sink(layer_idx, query, key, scaling):
        if layer_idx is None:
            return
        if weighted:
            state[layer_idx] = attention_importance(query, key, scaling, settings.query_stride)
        r = running[layer_idx]
        b, hq, t, d = query.shape
        sq = query.float().pow(2).sum((0, 2)).reshape(key.shape[1], hq // key.shape[1], d).sum(1)  # [H, D]
        r.query_sq = sq if r.query_sq is None else r.query_sq + sq
        r.query_count += b * t * (hq // key.shape[1])
        if not r.probe:
            p = min(settings.probe_tokens, t)
            r.probe.update(q=query[:1, :, :p].float().cpu(), scaling=scaling)

    base = getattr(model, "base_model", model)
    batches = range(n_batches)
    ctx = record_queries(model, sink) if use_queries else contextlib.nullcontext()
    with progress_display(progress) as bar, ctx, torch.inference_mode():
        task = bar.add_task("calibrating: tokens", total=windows.numel()) if bar else None
        for bi in batches:
            ids = windows[bi * settings.batch_size : (bi + 1) * settings.batch_size].to(device)
            state.clear()
            cache = DynamicCache(config=model.config)
            base(input_ids=ids, **with_cache(cache, use_cache=True))
            pick = _pick_positions(ids.shape[0], ids.shape[1], settings.skip_first, per_batch, gen)
            for i, layer in enumerate(cache.layers):
                _accumulate(running[i], layer.keys, layer.values, state.get(i), pick, settings)
            del cache
            if bar is not None:
                bar.advance(task, ids.numel())
    return [_finish(r, settings) for r in running]


def _pick_positions(b: int, t: int, skip: int, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """n random (row, position) pairs, positions >= skip."""
    flat = torch.randperm(b * (t - skip), generator=gen)[:n]
    return flat // (t - skip), flat % (t - skip) + skip


def _accumulate(r: _Running, keys, values, importance, pick, settings: CollectSettings) -> None:
    """keys [B, H, T, Dk], values [B, H, T, Dv] of one batch into the running statistics of one layer."""
    k, v = keys.float(), values.float()
    body = k[:, :, settings.skip_first :]
    s, sq = body.sum((0, 2)), body.pow(2).sum((0, 2))  # [H, Dk]
    r.key_sum = s if r.key_sum is None else r.key_sum + s
    r.key_sq = sq if r.key_sq is None else r.key_sq + sq
    r.count += body.shape[0] * body.shape[2]
    ka, va = k.abs().amax((0, 2, 3)), v.abs().amax((0, 2, 3))  # [H]
    r.key_amax = ka if r.key_amax is None else torch.maximum(r.key_amax, ka)
    r.value_amax = va if r.value_amax is None else torch.maximum(r.value_amax, va)
    rows, pos = pick
    pos = pos.clamp_max(k.shape[2] - 1)  # sliding layers hold fewer tokens
    r.keys.append(k[rows, :, pos].transpose(0, 1).cpu())  # [H, n, Dk]
    r.values.append(v[rows, :, pos].transpose(0, 1).cpu())
    if importance is not None and importance[0].shape[2] == k.shape[2]:
        kw, vw = importance
        r.key_weight.append(kw[rows, :, pos].transpose(0, 1).cpu())
        r.value_weight.append(vw[rows, :, pos].transpose(0, 1).cpu())
    if "k" not in r.probe:
        p = min(settings.probe_tokens, k.shape[2])
        r.probe.update(k=k[:1, :, :p].cpu(), v=v[:1, :, :p].cpu())


def _finish(r: _Running, settings: CollectSettings) -> LayerStats:
    mean = r.key_sum / r.count
    std = (r.key_sq / r.count - mean.pow(2)).clamp_min(0).sqrt()
    weighted = len(r.key_weight) == len(r.keys)
    q = r.probe.get("q")
    return LayerStats(
        keys=torch.cat(r.keys, 1),
        values=torch.cat(r.values, 1),
        key_weight=torch.cat(r.key_weight, 1) if weighted else None,
        value_weight=torch.cat(r.value_weight, 1) if weighted else None,
        key_amax=r.key_amax.cpu(),
        value_amax=r.value_amax.cpu(),
        key_mean=mean.cpu(),
        key_std=std.cpu(),
        probe_k=r.probe["k"],
        probe_v=r.probe["v"],
        probe_q=q if q is not None and q.shape[2] == r.probe["k"].shape[2] else None,
        scaling=r.probe.get("scaling", 1.0),
        tokens=r.count,
        query_energy=(r.query_sq / r.query_count).cpu() if r.query_sq is not None and r.query_sq.shape[-1] == mean.shape[-1]
        else None,
    )
