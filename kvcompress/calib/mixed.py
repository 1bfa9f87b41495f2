"""Per-layer choices meeting an all-in bit budget with the least total sensitivity: each full-attention
layer's keys and values each get one of fp8 / nuq4 / nuq3 / nuq2 (nuq keys with 0-2 % of each page kept
exact, candidates.KEY_OUTLIER_SHARES; nuq values fitted or rotated, whichever the probe favours), and,
where `keep_ratios` offers them, H2O keeping a ratio of the tokens seen.

One knapsack item per layer whose options are (key choice, value choice, keep ratio); an option's cost is
the bytes the layer holds at `context` tokens under that policy, at most (calib/bits.py: pages, exact
sinks and tail, ROW statistics, codebooks, and for H2O the budget plus its pages of slack and the positions
and scores it keeps); its loss is the sum of the key and value streams' sensitivities (sensitivity.py) and
the eviction's own (sparse_sensitivity.py), each the expected KL it adds where the probe has a Fisher
(calib/fisher.py), so losses of different layers add. Sliding-window layers stay exact and are paid first.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import replace

import torch

from kvcompress.calib.allocate import Option, allocate
from kvcompress.calib.bits import config_bits_per_element, layer_bytes, uncompressed_layer_bytes
from kvcompress.calib.candidates import CANDIDATES, MIXED_SINKS, key_choices, with_fp8_scales
from kvcompress.calib.sensitivity import layer_sensitivity
from kvcompress.calib.sparse_sensitivity import eviction_sensitivity, h2o_spec
from kvcompress.calib.value_choice import rotated_loss
from kvcompress.config import ConfigError, LayerPolicy

# the layer whose eviction is measured: nuq4 keys and values, the mixed page layout (H2O evicts its pages)
EVICTION_PROBE = ("nuq4", "nuq4")


def mixed_layers(fits, layout, settings, target: float, dtype, on_layer=None):
    """(layers, notes): the mixed config's LayerPolicies and what the allocation chose and measured.
    on_layer: called with no argument after each full-attention layer's sensitivity is measured (progress)."""
    ctx, batch = settings.context, settings.batch
    itemsize = torch.finfo(dtype).bits / 8
    elements = sum(uncompressed_layer_bytes(layout, i, ctx, batch, dtype) for i in range(layout.num_layers)) / itemsize
    budget = target * elements / 8
    ratios = sorted({1.0, *settings.keep_ratios}, reverse=True)
    keys = key_choices(settings.outlier_fraction, settings.key_widths)
    fixed, items, full, sens, evict = 0.0, [], [], {}, {}
    for i in range(layout.num_layers):
        if layout.is_sliding(i):
            fixed += uncompressed_layer_bytes(layout, i, ctx, batch, dtype)
            continue
        full.append(i)
        sens[i] = layer_sensitivity(fits[i], keys, CANDIDATES)
        _rotate_values(fits[i], sens[i])
        evict[i] = _eviction(fits[i], ratios)
        opts = []
        for kc, vc, r in itertools.product(keys, CANDIDATES, ratios):
            policy = _policy(fits[i], kc, vc, r)
            loss = sens[i]["key"][kc] + sens[i]["value"][vc] + evict[i][r]
            if not math.isfinite(loss):
                continue
            opts.append(Option(_name(kc, vc, r), layer_bytes(policy, layout, i, ctx, batch, dtype), loss))
        items.append(opts)
        if on_layer is not None:
            on_layer()
    if fixed >= budget:
        raise ConfigError(
            f"--target-bits {target:.3f} is below what the sliding-window layers need at {ctx} tokens; raise "
            "the target or the budget's context"
        )
    try:
        alloc = allocate(items, budget - fixed)
    except ConfigError as e:
        hint = "" if min(ratios) < 1.0 else " or let layers evict (--keep-ratios 0.5,0.25; needs kvcompress.enable)"
        raise ConfigError(f"{e}{hint}") from None
    chosen = dict(zip(full, (_parse(n) for n in alloc.choices)))
    layers = []
    for i in range(layout.num_layers):
        layers.append(_policy(fits[i], *chosen[i]) if i in chosen else with_fp8_scales(LayerPolicy(), fits[i]))
    achieved = config_bits_per_element(layers, layout, ctx, batch, dtype)
    if achieved > target * (1 + 1e-9):
        raise AssertionError(f"allocation gives {achieved} bits per element, over the target {target}")
    notes = {
        "target_bits": target,
        "achieved_bits": achieved,
        "context": ctx,
        "batch": batch,
        "choices": {str(i): [c[0], c[1]] for i, c in chosen.items()},
        # per layer, the value choices rotated onto Gaussian levels rather than fitted
        "rotated_values": {str(i): sorted(fits[i].rotated_values) for i in full},
        "keep_ratios": {str(i): c[2] for i, c in chosen.items()},
        "sensitivity": {str(i): sens[i] for i in sens},
        "eviction_sensitivity": {str(i): {str(r): v for r, v in evict[i].items()} for i in evict},
        "total_loss": alloc.loss,
    }
    return layers, notes


def _rotate_values(fits, sens) -> None:
    """Where a choice fits its value levels (nuq4), rotate the values onto Gaussian levels instead if the
    probe says that loses less, as calibrated presets do (value_choice.py); `sens` takes the smaller loss.
    On SmolLM2 fitted nuq4 values lost about as much as rotated nuq3 ones, so without this the allocation
    saw no reason to give values a fourth bit."""
    for c in CANDIDATES:
        rotated = rotated_loss(fits, fits.choice(c, "value")[0])
        if rotated is not None and rotated[1] < sens["value"][c]:
            fits.rotated_values.add(c)
            sens["value"][c] = rotated[1]


def _eviction(fits, ratios) -> dict[float, float]:
    s = fits.stats
    if len(ratios) == 1 or s.probe_q is None:  # nothing to measure, or no queries (MLA): no eviction offered
        return {r: (0.0 if r >= 1.0 else float("inf")) for r in ratios}
    probe = fits.policy(*EVICTION_PROBE)
    return eviction_sensitivity(probe, s, ratios)


def _policy(fits, key_choice: str, value_choice: str, ratio: float) -> LayerPolicy:
    policy = fits.policy(key_choice, value_choice)
    return policy if ratio >= 1.0 else replace(policy, sparsity=h2o_spec(ratio, MIXED_SINKS))


def _name(kc: str, vc: str, r: float) -> str:
    return f"{kc}|{vc}|{r!r}"


def _parse(name: str) -> tuple[str, str, float]:
    kc, vc, r = name.split("|")
    return kc, vc, float(r)
