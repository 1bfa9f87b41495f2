"""Choose each stream's quantizer so a memory budget is met with the least total sensitivity.

A multiple-choice knapsack: every (layer, stream) item takes exactly one option (cost in bytes, loss);
the total cost must not exceed the budget. Solved by dynamic programming over the budget cut into
`resolution` units, each option's cost rounded *up* to whole units, so the chosen set never exceeds the
budget as stated (the exact cost is re-added afterwards and checked).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvcompress.config import ConfigError


@dataclass
class Option:
    name: str
    cost: float  # bytes
    loss: float


@dataclass
class Allocation:
    choices: list[str]  # one option name per item
    cost: float  # bytes, exact sum of the chosen options
    loss: float


def allocate(items: list[list[Option]], budget: float, resolution: int = 4000) -> Allocation:
    """Pick one option per item, total cost <= budget, least total loss.

    Raises ConfigError when even the cheapest options overflow the budget.
    """
    if not items:
        return Allocation([], 0.0, 0.0)
    cheapest = sum(min(o.cost for o in opts) for opts in items)
    if cheapest > budget:
        raise ConfigError(
            f"the budget ({budget:.0f} bytes) is below what the cheapest choice of every layer needs "
            f"({cheapest:.0f} bytes); raise --target-bits / --memory-budget"
        )
    unit = budget / resolution
    inf = float("inf")
    best = torch.zeros(resolution + 1, dtype=torch.float64)  # best[u]: least loss of the items so far within u units
    picks = []
    for opts in items:
        new = torch.full_like(best, inf)
        arg = torch.full((resolution + 1,), -1, dtype=torch.long)
        for j, o in enumerate(opts):
            c = math.ceil(o.cost / unit - 1e-9)
            if c > resolution:
                continue
            cand = torch.full_like(best, inf)
            cand[c:] = best[: resolution + 1 - c] + o.loss
            better = cand < new
            new = torch.where(better, cand, new)
            arg = torch.where(better, torch.full_like(arg, j), arg)
        best = new
        picks.append(arg)
    if not math.isfinite(float(best[resolution])):
        # the rounding up of costs left no room: fall back to the cheapest options, which fit (checked above)
        return _cheapest(items)
    u, chosen = resolution, []
    for opts, arg in zip(reversed(items), reversed(picks)):
        j = int(arg[u])
        chosen.append(opts[j])
        u -= math.ceil(opts[j].cost / unit - 1e-9)
    chosen.reverse()
    cost = sum(o.cost for o in chosen)
    assert cost <= budget * (1 + 1e-12), f"allocation overflows its budget: {cost} > {budget}"
    return Allocation([o.name for o in chosen], cost, sum(o.loss for o in chosen))


def _cheapest(items: list[list[Option]]) -> Allocation:
    chosen = [min(opts, key=lambda o: (o.cost, o.loss)) for opts in items]
    return Allocation([o.name for o in chosen], sum(o.cost for o in chosen), sum(o.loss for o in chosen))
