"""Per layer, the value codec a calibrated nuq preset keeps: its own levels fitted to the layer's values, or
the same bits Hadamard-rotated onto the Gaussian levels (TurboQuant; the nuq4-vrot preset's values),
whichever puts less error into the layer's attention output on the calibration probe (sensitivity.py).

Why: in a float32 SmolLM2 (4 windows of 1024 of eval.txt) nuq4's values carry about half of its KL
divergence from the uncompressed cache, and rotated values cut the whole KL by a third (BENCHMARKS.md,
"Key outliers picked by the queries' channel weights; nuq4's values chosen per layer"); the probe decides
layer by layer rather than taking that for every model.
"""

from __future__ import annotations

from dataclasses import replace

from kvcompress.calib.candidates import LayerFits, rotated_spec
from kvcompress.calib.sensitivity import spec_sensitivity
from kvcompress.config import LayerPolicy, QuantSpec


def rotated_value(policy: LayerPolicy) -> LayerPolicy | None:
    """The policy with its nuq values rotated onto Gaussian levels, or None where that is no alternative
    (values not nuq per token, or already rotated)."""
    spec = rotated_spec(policy.value)
    return None if spec is None else replace(policy, value=spec)


def rotated_loss(fits: LayerFits, spec: QuantSpec,
                 like: LayerPolicy | None = None) -> tuple[QuantSpec, float] | None:
    """(the rotated alternative to value spec `spec`, the probe's loss with it), or None where there is none;
    `like` gives the page layout (spec_sensitivity)."""
    alt = rotated_spec(spec)
    return None if alt is None else (alt, spec_sensitivity(fits, "value", alt, {}, like=like))


def choose_values(policy: LayerPolicy, fits: LayerFits, tensors: dict) -> tuple[LayerPolicy, dict, str, dict]:
    """(policy, its value tensors, "fitted" | "rotated", the two losses) for one layer; `tensors` are the
    fitted value tensors of `policy`'s own value spec."""
    rotated = rotated_loss(fits, policy.value, like=policy)
    if rotated is None:
        return policy, tensors, "fitted", {}
    losses = {"fitted": spec_sensitivity(fits, "value", policy.value, tensors, like=policy), "rotated": rotated[1]}
    if losses["rotated"] < losses["fitted"]:
        return replace(policy, value=rotated[0]), {}, "rotated", losses
    return policy, tensors, "fitted", losses
