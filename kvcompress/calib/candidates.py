"""The per-stream choices calibration picks from (fp8 / nuq4 / nuq3 / nuq2), with their fitted tensors.

A LayerFits fits each choice of a layer once (codebooks are the slow part) and serves them to the
sensitivity measurement, the allocation and the final config. FP8 streams get static per-head scales
("<stream>.scale"), of the stream shifted by its channel means ("<stream>.shift") where `fp8_shift`
says so. Every stream also gets "<stream>.fp8_scale", static FP8 scales of the stream as it is, which is
what a serving engine's FP8 cache can take (exports).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvcompress.calib.collect import LayerStats
from kvcompress.calib.fit import fit_nuq_tensors, fp8_scales, fp8_shift_tensors
from kvcompress.calib.widths import channel_widths
from kvcompress.config import FP8_SHIFT_DEFAULT, ConfigError, LayerPolicy, QuantSpec
from kvcompress.presets import nuq_specs
from kvcompress.quant.codebook import default_codebook

CANDIDATES = ("fp8", "nuq4", "nuq3", "nuq2")
# Key choices also come with other shares of each page kept exact ("nuq3@0.005"): an outlier costs 32 bits
# (0.32 bits per key element per 1 %), and its worth varies by layer. On SmolLM2 at 3.5 bits all-in these
# shares took the allocation's predicted loss 18 % lower (most layers took 0.5 %; BENCHMARKS.md, "Layer
# sensitivities in the model's unit").
KEY_OUTLIER_SHARES = (0.0, 0.005, 0.01, 0.02)
# Key choices with calibrated bits per channel ("cw3.5": 3.5 bits per channel on average, calib/widths.py),
# each channel on its page range. On SmolLM2's probe "cw3" (3.5 bits per key element with its ranges) loses
# 22 % less than nuq3's keys (4.1 bits), and with these choices the 3.5-bit config's KL fell 41 %
# (BENCHMARKS.md, "Keys on calibrated widths per channel"). Only the general fused kernel reads them
# (`calibrate --no-key-widths` leaves them out).
KEY_WIDTHS = (2.0, 2.5, 3.0, 3.25, 3.5, 3.75, 4.0, 4.5)
KEY_WIDTH_SHARES = (0.0, 0.005)  # and with 0.5 % of each page exact ("cw3@0.005")
STREAMS = ("key", "value")
# Layers of a mixed-precision config share the nuq presets' page layout (fp8 streams ignore it).
MIXED_PAGE_SIZE = 32
MIXED_SINKS = 4
MIXED_RESIDUAL = 32


def rotated_spec(spec: QuantSpec) -> QuantSpec | None:
    """`spec` (nuq values per token) Hadamard-rotated onto the Gaussian levels (TurboQuant; the nuq4-vrot
    preset's values), or None where that is no alternative (not nuq per token, or already rotated)."""
    if spec.method != "nuq" or spec.axis != "token" or spec.rotation:
        return None
    return replace(spec, rotation=True, codebook="gaussian", outlier_fraction=0.0)


def key_choices(outlier_fraction: float, widths: bool = True) -> tuple[str, ...]:
    """The key choices a mixed allocation offers: CANDIDATES, each nuq width with the other shares of
    KEY_OUTLIER_SHARES kept exact ("nuq3@0.005"), and, with `widths`, widths per channel (KEY_WIDTHS,
    KEY_WIDTH_SHARES)."""
    extra = []
    for name in CANDIDATES[1:]:
        own = choice_spec(name, "key", outlier_fraction).outlier_fraction
        extra += [f"{name}@{share:g}" for share in KEY_OUTLIER_SHARES if share != own]
    if widths:
        extra += [f"cw{w:g}" + (f"@{share:g}" if share else "")
                  for w in KEY_WIDTHS for share in KEY_WIDTH_SHARES]
    return CANDIDATES + tuple(extra)


def width_choice(choice: str) -> float | None:
    """The average bits per channel of a channel-width key choice ("cw3.5" -> 3.5), else None."""
    if not choice.startswith("cw"):
        return None
    try:
        avg = float(choice[2:])
    except ValueError:
        avg = -1.0
    if not 0.0 < avg <= 8.0:
        raise ConfigError(f"calibration choice {choice!r}: write cwB with B the average bits per key channel in (0, 8]")
    return avg


def choice_spec(choice: str, stream: str, outlier_fraction: float) -> QuantSpec:
    """The QuantSpec of a named choice: the nuq presets' keys (each page's channel range, one-byte ranges,
    exact outliers; "nuqB@SHARE" keeps SHARE of each key page exact instead) or values (per token, nuq3 /
    nuq2 rotated), keys on calibrated widths per channel ("cwB", "cwB@SHARE"; the widths are LayerFits'),
    or FP8."""
    if choice == "fp8":
        return QuantSpec(method="fp8")
    name, at, share = choice.partition("@")
    avg = width_choice(name)
    if avg is not None:
        if stream != "key":
            raise ConfigError(f"calibration choice {choice!r}: channel widths apply to keys only")
        # bits: the nearest preset width, what the spec names; the codec reads the widths themselves
        key = value = QuantSpec(method="nuq", bits=min(4, max(2, round(avg))), axis="page", scale_format="e4m3")
    elif name in ("nuq4", "nuq3", "nuq2"):
        key, value = nuq_specs(int(name[3]), outlier_fraction)
    else:
        raise ConfigError(
            f"unknown calibration choice {choice!r}; use one of {CANDIDATES} (keys also nuqB@SHARE, cwB, cwB@SHARE)"
        )
    if not at:
        return key if stream == "key" else value
    try:
        fraction = float(share)
    except ValueError:
        fraction = -1.0
    if stream == "key" and 0.0 <= fraction < 1.0:
        return replace(key, outlier_fraction=fraction)
    raise ConfigError(f"calibration choice {choice!r}: an outlier share applies to keys only and must be "
                      "in [0, 1), e.g. 'nuq3@0.005'")


@dataclass
class LayerFits:
    """Fitted tensors of one layer's choices, computed on first use."""

    stats: LayerStats
    outlier_fraction: float = 0.01
    per_head: bool = True
    fp8_shift: str = FP8_SHIFT_DEFAULT
    # choices whose values this layer rotates onto Gaussian levels instead of fitting (mixed.py decides)
    rotated_values: set = field(default_factory=set)
    _cache: dict = field(default_factory=dict, repr=False)

    def fp8_scale(self, stream: str):
        amax = self.stats.key_amax if stream == "key" else self.stats.value_amax
        return fp8_scales(amax)

    def spec_tensors(self, spec: QuantSpec, stream: str) -> dict:
        """Calibrated tensors for one stream quantized as `spec` ({} where nothing is calibrated)."""
        if spec.method == "fp8":
            if self.fp8_shift == "both" or (self.fp8_shift == "keys" and stream == "key"):
                return {f"{stream}.{n}": t for n, t in fp8_shift_tensors(self.stats, stream, spec.fp8_format).items()}
            amax = self.stats.key_amax if stream == "key" else self.stats.value_amax
            return {f"{stream}.scale": fp8_scales(amax, spec.fp8_format)}
        # Rotated streams (the nuq3 / nuq2 values) keep the preset's Gaussian levels: levels fitted after the
        # rotation lost out of sample (SmolLM2, float32, 4 windows of 1024 of eval.txt: calibrated nuq3
        # +1.003 % against the preset's +0.780 %; BENCHMARKS.md, issue 6), as TurboQuant's argument for one
        # data-oblivious codebook after a rotation predicts.
        if spec.method == "nuq" and not spec.rotation:
            key = (stream, spec.bits, spec.axis, spec.outlier_fraction, spec.scale_format)
            if key not in self._cache:
                self._cache[key] = fit_nuq_tensors(
                    self.stats, stream, spec.bits, spec.outlier_fraction, self.per_head, axis=spec.axis,
                    scale_format=spec.scale_format, oblivious=default_codebook(spec.codebook, spec.bits),
                )
            return dict(self._cache[key])
        return {}

    def choice(self, choice: str, stream: str) -> tuple[QuantSpec, dict]:
        spec = choice_spec(choice, stream, self.outlier_fraction)
        name = choice.partition("@")[0]
        avg = width_choice(name)
        if avg is not None:
            if name not in self._cache:
                self._cache[name] = channel_widths(self.stats, avg, MIXED_PAGE_SIZE, MIXED_SINKS)
            return spec, {**self.spec_tensors(spec, stream), "key.channel_widths": self._cache[name]}
        if stream == "value" and choice in self.rotated_values:
            spec = rotated_spec(spec) or spec
        return spec, self.spec_tensors(spec, stream)

    def policy(self, key_choice: str, value_choice: str) -> LayerPolicy:
        """A mixed-precision layer: keys and values each as chosen, nuq page layout, FP8 scales kept."""
        kspec, kt = self.choice(key_choice, "key")
        vspec, vt = self.choice(value_choice, "value")
        return with_fp8_scales(
            LayerPolicy(key=kspec, value=vspec, page_size=MIXED_PAGE_SIZE, sinks=MIXED_SINKS,
                        residual=MIXED_RESIDUAL, tensors={**kt, **vt}),
            self,
        )


def with_fp8_scales(policy: LayerPolicy, fits: LayerFits) -> LayerPolicy:
    """The policy with "<stream>.fp8_scale" (static FP8 scales of the unshifted stream) for each stream."""
    tensors = dict(policy.tensors)
    for stream in ("key", "value"):
        tensors[f"{stream}.fp8_scale"] = fits.fp8_scale(stream)
    return replace(policy, tensors=tensors)
