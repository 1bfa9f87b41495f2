"""Per-kv-head H2O budgets from the model's own attention (`SparsitySpec.head_shares`).

Heads differ by decades in what eviction costs them: on SmolLM2-135M at a quarter of the context, H2O's
evictions take 0.02 to 0.9 of a kv head's attention mass per query (summed over its group of 3 query
heads, so at most 3), and 1.3 to 1.9 in the first layer. `eviction_costs` measures that per layer and kv head: on calibration windows it replays
the policy's eviction on the exact attention (the first half of each window prefilled, then each later
query in turn; the recent window half of the budget, the spec's sinks kept, the heavy hitters by
accumulated attention) at a grid of budgets, and records the mean attention mass each query would have
put on evicted tokens. `allocate_ratios` then gives each head one budget from its curve: the least total
cost for the same total of kept tokens as the base config (a Lagrange multiplier, bisected), no head
below `floor` times its layer's ratio. The shares are each head's ratio over its layer's.

The replay evicts at every step (the policy lets the layer grow by its page size between evictions) and
scores with the uncompressed attention (the policy sees its own, after earlier evictions): a ranking of
heads, not a prediction of their loss.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from kvcompress.calib.collect import record_queries
from kvcompress.config import ConfigError, KVCompressConfig

RATIOS = (0.02, 0.05, 0.075, 0.1, 0.125, 0.15, 0.2, 0.25, 0.3, 0.35, 0.4, 0.5, 0.6, 0.75, 0.9, 1.0)
# A head keeps at least this share of its layer's budget. SmolLM2, H2O at 25 % with 4 sinks, 4 windows of 1024
# of eval.txt (BENCHMARKS.md, "H2O budgets per kv head"): KL 2.80e-2 at 0.4x against 3.02e-2 at 0.6x and
# 3.87e-2 with every head at the budget
FLOOR = 0.4
# A head's cost is its missed attention mass squared, so large misses weigh more than many small ones. The
# same runs: KL 2.80e-2 squared, 2.80e-2 cubed, 3.31e-2 plain
POWER = 2.0


def sparse_h2o_layers(cfg: KVCompressConfig) -> list[int]:
    """Layers whose policy is H2O over full-precision K/V without merging: the ones head shares apply to."""
    if cfg.layout.attention != "gqa":
        return []
    return [i for i, p in enumerate(cfg.layers)
            if p.sparsity.method == "h2o" and not p.sparsity.merge and i >= p.sparsity.dense_layers
            and p.key.is_lossless and p.value.is_lossless]


def attention_by_kv_head(query: torch.Tensor, key: torch.Tensor, scaling: float) -> torch.Tensor:
    """Causal attention of one window summed over each kv head's query group.

    query [1, Hq, T, D], key [1, Hkv, T, D] -> [Hkv, T, T] (row i: query i's weights over keys 0..i).
    """
    hq, t = query.shape[1], query.shape[2]
    hkv = key.shape[1]
    q = query[0].float().reshape(hkv, hq // hkv, t, -1)
    logits = torch.einsum("hgtd,hsd->hgts", q, key[0].float()) * scaling
    causal = torch.ones(t, t, dtype=torch.bool, device=query.device).tril()
    return logits.masked_fill(~causal, float("-inf")).softmax(-1).sum(1)


def replay_costs(attn: torch.Tensor, ratios: torch.Tensor, sinks: torch.Tensor, recent: torch.Tensor) -> torch.Tensor:
    """The mean attention mass H2O's eviction misses, per head and budget ratio.

    attn: [N, T, T] (attention_by_kv_head, heads of one or more layers); ratios: [R]; sinks, recent: [N]
    (recent 0: half the budget) -> [N, R]. The first T // 2 tokens are prefilled, then each query t attends
    over the tokens kept at budget ceil(r * t): the newest half of it (or `recent`) and the first `sinks`
    forced, the rest the highest by accumulated attention. After the prefill's compaction one token
    arrives per step, so each step evicts at most a token or two: the lowest-scoring unforced ones.
    """
    n, t, _ = attn.shape
    n_r = len(ratios)
    r = ratios.to(attn.device).repeat(n)  # [n * R]: row k * R + j is head k at ratio j
    sinks, recent = sinks.repeat_interleave(n_r)[:, None], recent.repeat_interleave(n_r)
    prefill = t // 2
    score = attn[:, :prefill].sum(1).repeat_interleave(n_r, 0)  # [n * R, T]: accumulated over the prefill
    pos = torch.arange(t, device=attn.device)
    kept = (pos < prefill).expand(n * n_r, t).clone()
    missed = torch.zeros(n * n_r, device=attn.device)

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
        q = attn[:, step].repeat_interleave(n_r, 0)
        missed += (q * ~kept).sum(-1)
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
    return (missed / (t - prefill)).reshape(n, n_r)


def eviction_costs(model, windows: torch.Tensor, cfg: KVCompressConfig, layers: list[int],
                   ratios=RATIOS) -> torch.Tensor:
    """[L, H, R] mean missed attention mass per layer, kv head and budget ratio over the calibration windows
    [N, T] (replay_costs, with each layer's sinks and recent window), all of a window's layers replayed at once."""
    grid = torch.tensor(ratios, dtype=torch.float32)
    layout = cfg.layout
    h = layout.num_kv_heads
    cost = torch.zeros(layout.num_layers, h, len(ratios))
    wanted, attns = set(layers), {}

    def sink(idx, query, key, scaling):
        if idx in wanted:
            attns[idx] = attention_by_kv_head(query, key, scaling).cpu()

    device = next(model.parameters()).device
    sinks = torch.tensor([cfg.layers[i].sparsity.sinks for i in layers]).repeat_interleave(h)
    recent = torch.tensor([cfg.layers[i].sparsity.recent for i in layers]).repeat_interleave(h)
    for w in windows:
        attns.clear()
        with torch.no_grad(), record_queries(model, sink):
            model(w[None].to(device), use_cache=False)
        stacked = torch.cat([attns[i] for i in layers])  # [len(layers) * H, T, T]
        cost[layers] += replay_costs(stacked, grid, sinks, recent).reshape(len(layers), h, -1) / windows.shape[0]
    return cost


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


def allocate_ratios(cost: torch.Tensor, base: torch.Tensor, floor: float = FLOOR, power: float = POWER,
                    ratios=RATIOS) -> torch.Tensor:
    """One ratio per (layer, head) [L, H]: on each head's cost curve (interpolate), the least summed
    cost**power whose mean is the mean of `base` [L] (each layer's ratio for all its heads), each head at
    least floor x its layer's ratio."""
    fine = torch.linspace(ratios[0], ratios[-1], 393, dtype=torch.float64)
    curve = interpolate(cost, fine, ratios).clamp_min(0) ** power  # [L, H, F]
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
    """cfg with head_shares in every layer sparse_h2o_layers names, and notes on the allocation."""
    layers = sparse_h2o_layers(cfg)
    if not layers:
        raise ConfigError(f"{cfg.name} has no full-precision H2O layer to give per-head budgets; calibrate an "
                          "H2O preset (h2o-25, h2o-50) or pass --no-head-budgets")
    seq_len = windows.shape[1]
    cost = eviction_costs(model, windows, cfg, layers)[layers]
    base = torch.tensor([layer_ratio(cfg.layers[i].sparsity, seq_len) for i in layers])
    chosen = allocate_ratios(cost, base)
    shares = chosen / base[:, None]
    new_layers = list(cfg.layers)
    for row, i in enumerate(layers):
        p = new_layers[i]
        new_layers[i] = replace(p, sparsity=replace(p.sparsity, head_shares=[round(float(s), 4) for s in shares[row]]))
    even = torch.stack([interpolate(cost[k:k + 1], base[k:k + 1])[0, :, 0] for k in range(len(layers))])
    allocated = torch.stack([interpolate(cost[k:k + 1], chosen[k])[0].diagonal() for k in range(len(layers))])
    notes = {"layers": layers, "windows": list(windows.shape), "floor": FLOOR, "power": POWER,
             "ratios": [[round(float(x), 4) for x in row] for row in chosen],
             # replayed attention mass missed, summed over the layers' heads: every head at its layer's ratio / allocated
             "missed_mass": {"even": round(float(even.sum()), 4), "allocated": round(float(allocated.sum()), 4)}}
    if log:
        log(f"per-head H2O budgets for {len(layers)} layers: head ratios {float(chosen.min()):.3f}-"
            f"{float(chosen.max()):.3f}, mean {float(chosen.mean()):.3f}")
    return KVCompressConfig(layout=cfg.layout, layers=new_layers, name=cfg.name, notes=dict(cfg.notes)), notes
