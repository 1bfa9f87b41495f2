"""Per-kv-head H2O budgets from the model's own attention (`SparsitySpec.head_shares`).

Heads differ by decades in what eviction costs them. `eviction_costs` measures it per layer and kv head: on
calibration windows it replays the policy's eviction on the exact attention (the first half of each window
prefilled, then each later query in turn; the recent window half of the budget, the spec's sinks kept, the
heavy hitters by attention accumulated over the head's query group) at a grid of budgets, and records two
costs per budget:
- the expected KL divergence the evictions add to the next-token distribution, 1/2 sum F (o' - o)^2 over the
  attention outputs of the head's query group, o' over the kept tokens, o over all, F the diagonal Fisher
  of those outputs (calib/fisher.py). It is in nats per decoded position, so the costs of different layers
  and heads add;
- the attention mass the group's queries put on evicted tokens (summed over the group, so at most its size).
`allocate_ratios` then gives each head one budget from its KL curve: the least total for the same total of
kept tokens as the base config (a Lagrange multiplier, bisected), no head below `floor` times its layer's
ratio. The shares are each head's ratio over its layer's.

Why the KL and not the missed mass: the mass ignores what the evicted values would have added and how much
the layer's output matters downstream. SmolLM2, H2O at 25 %, eval.txt 8 x 1024 (BENCHMARKS.md, "H2O head
budgets by expected KL"): allocating by KL gives +2.33 % perplexity and KL 2.02e-2, by the mass squared
+3.07 % and 3.22e-2, every head at the budget +4.13 % and 4.51e-2.

The replay evicts at every step (the policy lets the layer grow by its page size between evictions) and
scores with the uncompressed attention (the policy sees its own, after earlier evictions), and costs of
heads are taken as independent: a ranking of heads, not a prediction of the model's loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from kvcompress.calib.collect import wrap_attention
from kvcompress.calib.fisher import output_fisher
from kvcompress.config import ConfigError, KVCompressConfig

RATIOS = (0.02, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
# A head keeps at least this share of its layer's budget. SmolLM2, H2O at 25 % with 4 sinks, eval.txt 4 x 1024,
# allocated by KL (BENCHMARKS.md, "H2O head budgets by expected KL"): KL 1.98e-2 at 0.2x and at 0.1x (the floor
# no longer binds), 2.04e-2 at 0.4x
FLOOR = 0.2
# attention weights a replay chunk of layers may hold ([heads, T, T] float32 each): 1 GiB
CHUNK_ELEMENTS = 1 << 28


def sparse_h2o_layers(cfg: KVCompressConfig) -> list[int]:
    """Layers whose policy is H2O over full-precision K/V without merging: the ones head shares apply to."""
    if cfg.layout.attention != "gqa":
        return []
    return [i for i, p in enumerate(cfg.layers)
            if p.sparsity.method == "h2o" and not p.sparsity.merge and i >= p.sparsity.dense_layers
            and p.key.is_lossless and p.value.is_lossless]


def attention_by_kv_head(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of one window, grouped by kv head.

    query [1, Hq, T, D], key [1, Hkv, T, D] -> [Hkv, G, T, T] (G = Hq / Hkv query heads per kv head; row i of
    [h, g]: query head h * G + g at position i, its weights over keys 0..i).
    """
    hq, t = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    q = query[0].float().reshape(hkv, hq // hkv, t, -1)
    logits = torch.einsum("hgtd,hsd->hgts", q, key[0].float()) * scaling
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1)


@dataclass
class ReplayCosts:
    """What H2O's eviction costs each head at each budget ratio, per decoded position: [N, R] each."""

    mass: torch.Tensor  # attention mass on evicted tokens, summed over the head's query group
    kl: torch.Tensor  # expected KL divergence, nats


def replay_costs(attn: torch.Tensor, ratios: torch.Tensor, sinks: torch.Tensor, recent: torch.Tensor,
                 values: torch.Tensor, fisher: torch.Tensor) -> ReplayCosts:
    """Replay H2O's eviction on exact attention at each budget ratio.

    attn: [N, G, T, T] (attention_by_kv_head, kv heads of one or more layers); ratios: [R]; sinks, recent:
    [N] (recent 0: half the budget); values: [N, T, Dv]; fisher: [N, G, T, Dv] (the diagonal Fisher of the
    group's attention outputs). The first T // 2 tokens are prefilled, then each query t
    attends over the tokens kept at budget ceil(r * t): the newest half of it (or `recent`) and the first
    `sinks` forced, the rest the highest by attention accumulated over the group. After the prefill's
    compaction one token arrives per step, so each step evicts at most a token or two: the lowest-scoring
    unforced ones.
    """
    n, g, t, _ = attn.shape
    n_r = len(ratios)
    dev = attn.device
    r = ratios.to(dev).repeat(n)  # [n * R]: row k * R + j is head k at ratio j
    sinks, recent = sinks.to(dev).repeat_interleave(n_r)[:, None], recent.to(dev).repeat_interleave(n_r)
    prefill = t // 2
    group = attn.sum(1)  # [n, T, T]: what H2O scores with
    score = group[:, :prefill].sum(1).repeat_interleave(n_r, 0)  # [n * R, T]: accumulated over the prefill
    pos = torch.arange(t, device=dev)
    kept = (pos < prefill).expand(n * n_r, t).clone()
    missed = torch.zeros(n * n_r, device=dev)
    kl = torch.zeros(n, n_r, device=dev)

    def budget_at(seen: int) -> tuple[torch.Tensor, torch.Tensor]:
        budget = torch.ceil(r * seen).long()
        window = torch.where(recent > 0, torch.minimum(recent, budget), budget // 2)
        forced = (pos >= seen - window[:, None]) | (pos < sinks)
        return budget, forced

    budget, forced = budget_at(prefill)  # the prefill's compaction: keep the budget's best
    key = torch.where(forced, torch.inf, score).masked_fill(~kept, -torch.inf)
    nth = key.sort(-1, descending=True).values.gather(1, (budget - 1).clamp(0, t - 1)[:, None])
    kept &= key >= nth
    for step in range(prefill, t):
        kept[:, step] = True  # the step's own token
        q = group[:, step].repeat_interleave(n_r, 0)
        missed += (q * ~kept).sum(-1)
        weights = attn[:, :, step]  # [n, G, T]
        exact = torch.bmm(weights, values)  # [n, G, Dv]
        w = weights[:, None] * kept.view(n, n_r, 1, t)  # [n, R, G, T]: renormalised over the kept tokens
        approx = torch.bmm(w.reshape(n, n_r * g, t), values).reshape(n, n_r, g, -1) / w.sum(-1, keepdim=True)
        kl += 0.5 * (fisher[:, None, :, step] * (approx - exact[:, None]).pow(2)).sum((-1, -2))
        score += q
        budget, forced = budget_at(step + 1)
        while True:  # evict down to the budget of the tokens seen; forced tokens stay even over it
            candidates = torch.where(forced | ~kept, torch.inf, score)
            lowest, victim = candidates.min(-1)
            over = (kept.sum(-1) > budget) & lowest.isfinite()
            if not bool(over.any()):
                break
            rows = over.nonzero()[:, 0]
            kept[rows, victim[rows]] = False
    steps = t - prefill
    return ReplayCosts(mass=(missed / steps).reshape(n, n_r), kl=kl / steps)


def eviction_costs(model, windows: torch.Tensor, cfg: KVCompressConfig, layers: list[int],
                   ratios=RATIOS, seed: int = 0) -> dict[str, torch.Tensor]:
    """{"kl": [L, H, R], "mass": [L, H, R]}: replay_costs per layer, kv head and budget ratio, averaged over the
    calibration windows [N, T], with each layer's sinks and recent window and the window's Fisher
    (output_fisher, label seed + window index). Layers are replayed in chunks of CHUNK_ELEMENTS weights."""
    grid = torch.tensor(ratios, dtype=torch.float32)
    layout = cfg.layout
    h = layout.num_kv_heads
    costs = {name: torch.zeros(layout.num_layers, h, len(ratios)) for name in ("kl", "mass")}
    wanted, recorded = set(layers), {}

    def keep(module, query, key, value, out, scaling):
        idx = getattr(module, "layer_idx", None)
        if idx in wanted:
            recorded[idx] = (query, key, value[0].float(), scaling)

    device = next(model.parameters()).device
    t = windows.shape[1]
    for n, w in enumerate(windows):
        recorded.clear()
        with torch.no_grad(), wrap_attention(model, keep):
            model(w[None].to(device), use_cache=False)
        hq = recorded[layers[0]][0].shape[1]
        per_chunk = max(1, CHUNK_ELEMENTS // (hq * t * t))
        fisher = output_fisher(model, w[None], seed=seed + n)  # {layer: [1, Hq, T, Dv]}
        for c in range(0, len(layers), per_chunk):
            chunk = layers[c:c + per_chunk]
            attn = torch.cat([attention_by_kv_head(q, k, s) for q, k, _, s in (recorded[i] for i in chunk)])
            values = torch.cat([recorded[i][2] for i in chunk])
            f = torch.cat([fisher[i][0].reshape(h, hq // h, t, -1) for i in chunk]).to(attn.device)
            sinks = torch.tensor([cfg.layers[i].sparsity.sinks for i in chunk]).repeat_interleave(h)
            recent = torch.tensor([cfg.layers[i].sparsity.recent for i in chunk]).repeat_interleave(h)
            got = replay_costs(attn, grid, sinks, recent, values, f)
            for name, total in costs.items():
                total[chunk] += getattr(got, name).reshape(len(chunk), h, -1).cpu() / windows.shape[0]
            del attn, values, f
    return costs


def layer_ratio(spec, seq_len: int) -> float:
    """The spec's ratio of the context (a budget in tokens as its share of the calibration window)."""
    return spec.ratio if not spec.budget else min(1.0, spec.budget / seq_len)


def interpolate(cost: torch.Tensor, at: torch.Tensor, ratios=RATIOS) -> torch.Tensor:
    """cost [L, H, R] on the grid `ratios`, linear in between, at ratios `at` [F] -> [L, H, F]."""
    grid = torch.tensor(ratios, dtype=torch.float64)
    at = at.double().clamp(float(grid[0]), float(grid[-1]))
    j = torch.searchsorted(grid, at).clamp(1, len(grid) - 1)
    t = (at - grid[j - 1]) / (grid[j] - grid[j - 1])
    c = cost.double()
    return c[..., j - 1] * (1 - t) + c[..., j] * t


def at_ratios(cost: torch.Tensor, r: torch.Tensor, ratios=RATIOS) -> torch.Tensor:
    """cost [L, H, R] on the grid `ratios` read at one ratio per head, r [L, H] -> [L, H]."""
    return torch.stack([interpolate(cost[k], r[k], ratios).diagonal() for k in range(cost.shape[0])])


def allocate_ratios(cost: torch.Tensor, base: torch.Tensor, floor: float = FLOOR, ratios=RATIOS) -> torch.Tensor:
    """One ratio per (layer, head) [L, H]: on each head's cost curve (interpolate), the least summed cost
    whose mean is the mean of `base` [L] (each layer's ratio for all its heads), each head at least floor x
    its layer's ratio."""
    fine = torch.linspace(ratios[0], ratios[-1], 393, dtype=torch.float64)
    curve = interpolate(cost, fine, ratios).clamp_min(0)  # [L, H, F]
    allowed = fine >= (floor * base.double())[:, None, None] - 1e-12
    target = float(base.double().mean())

    def pick(lam: float) -> torch.Tensor:
        obj = (curve + lam * fine).masked_fill(~allowed, math.inf)
        return fine[obj.argmin(-1)]

    lo, hi = 0.0, 1.0
    while pick(hi).mean() > target and hi < 1e12:
        hi *= 4
    for _ in range(100):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pick(mid).mean() > target else (lo, mid)
    return pick(hi).float()


def fit_head_shares(model, windows: torch.Tensor, cfg: KVCompressConfig, log=None) -> tuple[KVCompressConfig, dict]:
    """cfg with head_shares in every layer sparse_h2o_layers names, allocated by the replayed KL cost, and
    notes on the allocation."""
    layers = sparse_h2o_layers(cfg)
    if not layers:
        raise ConfigError(f"{cfg.name} has no full-precision H2O layer to give per-head budgets; calibrate an "
                          "H2O preset (h2o-25, h2o-50) or pass --no-head-budgets")
    seq_len = windows.shape[1]
    costs = {name: c[layers] for name, c in eviction_costs(model, windows, cfg, layers).items()}
    base = torch.tensor([layer_ratio(cfg.layers[i].sparsity, seq_len) for i in layers])
    chosen = allocate_ratios(costs["kl"], base)
    shares = chosen / base[:, None]
    new_layers = list(cfg.layers)
    for row, i in enumerate(layers):
        p = new_layers[i]
        new_layers[i] = replace(p, sparsity=replace(p.sparsity, head_shares=[round(float(s), 4) for s in shares[row]]))
    even = base[:, None].expand_as(chosen)

    def summed(name: str, r: torch.Tensor) -> float:
        return round(float(at_ratios(costs[name], r).sum()), 6)

    notes = {"layers": layers, "windows": list(windows.shape), "floor": FLOOR,
             "ratios": [[round(float(x), 4) for x in row] for row in chosen],
             # replayed costs summed over the layers' heads, every head at its layer's ratio / as allocated:
             # expected KL divergence per decoded position (nats), attention mass on evicted tokens
             "expected_kl": {"even": summed("kl", even), "allocated": summed("kl", chosen)},
             "missed_mass": {"even": summed("mass", even), "allocated": summed("mass", chosen)}}
    if log:
        log(f"per-head H2O budgets for {len(layers)} layers: head ratios {float(chosen.min()):.3f}-"
            f"{float(chosen.max()):.3f}, mean {float(chosen.mean()):.3f}; replayed KL {notes['expected_kl']['even']:.4f}"
            f" -> {notes['expected_kl']['allocated']:.4f}")
    return KVCompressConfig(layout=cfg.layout, layers=new_layers, name=cfg.name, notes=dict(cfg.notes)), notes
