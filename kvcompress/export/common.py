"""What every serving-engine export shares: reading the FP8 scales a config carries, deciding what an
engine can express, and writing files atomically.

Engines (vLLM, SGLang, TensorRT-LLM) keep the KV cache in FP8 E4M3 with static scales (dequant =
fp8 * scale) per tensor, vLLM also per kv head; calibration's scales are 2 x amax / 448, a binade of
headroom over the calibration text's largest element (calib/fit.py, FP8_HEADROOM says why). They have
no slot for NUQ codebooks, KIVI integers, outliers, exact sinks or residual windows, sparsity, or layers left in the
model dtype. An export therefore maps the calibrated FP8 scales and lists everything else; if anything
the config asks for would be lost, it refuses unless `allow_partial` is set, in which case the engine
runs FP8 with the calibrated scales on every layer and the lost parts are listed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvcompress.atomic import write_json, write_safetensors
from kvcompress.config import KVCompressConfig, LayerPolicy


class ExportError(ValueError):
    """The config cannot be exported as asked; the message says why and what to do."""


@dataclass
class Fp8Scales:
    """Per layer, the K and V static scales [H] float32 an engine gets, and what was / was not mapped."""

    key: list[torch.Tensor]
    value: list[torch.Tensor]
    mapped: list[str] = field(default_factory=list)
    not_mapped: list[str] = field(default_factory=list)

    def per_tensor(self, stream: str) -> list[float]:
        """One scale per layer: the largest over kv heads (no head's values clip)."""
        return [float(s.max()) for s in (self.key if stream == "key" else self.value)]


def _stream_scale(policy: LayerPolicy, stream: str) -> torch.Tensor | None:
    """Static FP8 scales of the stream as it is: an engine's FP8 cache has no per-channel shift, so the
    scales of a shifted stream ("<stream>.scale" beside "<stream>.shift") are not the engine's."""
    spec = policy.key if stream == "key" else policy.value
    if f"{stream}.fp8_scale" in policy.tensors:
        return policy.tensors[f"{stream}.fp8_scale"].float()
    if spec.method == "fp8" and f"{stream}.scale" in policy.tensors and f"{stream}.shift" not in policy.tensors:
        return policy.tensors[f"{stream}.scale"].float()
    return None


def _describe(policy: LayerPolicy, stream: str) -> str | None:
    """What the engine would not reproduce for one stream of a layer (None: FP8 E4M3, fully expressed)."""
    spec = policy.key if stream == "key" else policy.value
    if spec.method == "fp8" and spec.fp8_format == "e4m3":
        return None
    if spec.method == "none":
        return "kept in the model dtype (the engine would store it as FP8)"
    if spec.method == "nuq":
        extra = f", {spec.outlier_fraction:.1%} exact outliers" if spec.outlier_fraction else ""
        widths = policy.tensors.get(f"{stream}.channel_widths")
        what = f"nuq{spec.bits} codebook" if widths is None else \
            f"nuq codes of {float(widths.float().mean()):.3g} bits a channel on average"
        return f"{what}{extra} (the engine stores FP8 instead)"
    if spec.method == "fp8":
        return f"fp8 {spec.fp8_format} (engines take static scales for e4m3 only)"
    return f"{spec.method}{spec.bits} (the engine stores FP8 instead)"


def _ranges(idx: list[int]) -> str:
    """[0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    out, run = [], []
    for i in idx:
        if run and i == run[-1] + 1:
            run.append(i)
        else:
            if run:
                out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
            run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def fp8_scales_for_export(cfg: KVCompressConfig, allow_partial: bool = False) -> Fp8Scales:
    """The calibrated FP8 scales of every layer, or an ExportError naming what cannot be expressed."""
    if cfg.layout.attention == "mla":
        raise ExportError(
            "MLA configs (latent caches) are not exported: engines scale the MLA latent with their own "
            "per-tensor convention, which kvcompress does not map yet"
        )
    missing = [i for i, p in enumerate(cfg.layers) if _stream_scale(p, "key") is None or _stream_scale(p, "value") is None]
    if missing:
        raise ExportError(
            f"the config {cfg.name!r} has no calibrated FP8 scales for layer(s) {_ranges(missing)}; engines would "
            "fall back to a scale of 1.0. Create one with `kvcompress calibrate MODEL --preset fp8 --out FILE` "
            "(any calibrated config carries FP8 scales)."
        )
    lost: dict[str, list[int]] = {}
    # Exact windows and per-channel shifts are the same FP8 cache made more accurate: the engine stores those
    # tokens in FP8 too, or the stream without its shift, which the exported scales (of the unshifted
    # stream) describe correctly, so they are reported as not mapped but do not block the export.
    windows: dict[str, list[int]] = {}
    for i, p in enumerate(cfg.layers):
        for stream in ("key", "value"):
            d = _describe(p, stream)
            if d:
                lost.setdefault(f"{stream}s: {d}", []).append(i)
            if f"{stream}.shift" in p.tensors and not d:
                windows.setdefault(
                    f"{stream}s shifted per channel before FP8 (the engine stores them unshifted, with the scales "
                    f"of the unshifted {stream}s)", []
                ).append(i)
        if p.sinks and not p.is_lossless:
            windows.setdefault(f"first {p.sinks} tokens kept exact (sinks; the engine stores them in FP8)", []).append(i)
        if p.residual and not p.is_lossless:
            windows.setdefault(
                f"newest {p.residual} tokens kept exact (residual window; the engine stores them in FP8)", []
            ).append(i)
        if p.sparsity.method != "none":
            lost.setdefault(f"sparsity {p.sparsity.method}", []).append(i)
    if any(p.key.method == "fp8" and p.key.fp8_format != "e4m3" for p in cfg.layers) or any(
        p.value.method == "fp8" and p.value.fp8_format != "e4m3" for p in cfg.layers
    ):
        raise ExportError("the config stores FP8 E5M2; engines take static scales for E4M3 only "
                          "(run E5M2 with the engine's own --kv-cache-dtype fp8_e5m2 and no scales)")
    not_mapped = [f"layers {_ranges(idx)}: {what}" for what, idx in lost.items()]
    if not_mapped and not allow_partial:
        raise ExportError(
            "this config asks for more than the engine can express:\n  - " + "\n  - ".join(not_mapped)
            + "\nThe engine would run FP8 E4M3 with the calibrated scales instead. Pass --allow-partial to export "
            "that anyway, or calibrate an FP8 config (`kvcompress calibrate MODEL --preset fp8`)."
        )
    not_mapped += [f"layers {_ranges(idx)}: {what}" for what, idx in windows.items()]
    n = len(cfg.layers)
    return Fp8Scales(
        key=[_stream_scale(p, "key") for p in cfg.layers],
        value=[_stream_scale(p, "value") for p in cfg.layers],
        mapped=[f"FP8 E4M3 static scales (calibrated: 2 x amax / 448, a binade of headroom) for the keys and "
                f"values of layers 0-{n - 1}"],
        not_mapped=not_mapped,
    )


def write_json_atomic(path: str, doc: dict) -> None:
    write_json(path, doc)


def write_safetensors_atomic(path: str, tensors: dict[str, torch.Tensor], metadata: dict | None = None) -> None:
    write_safetensors(path, tensors, metadata)


@dataclass
class ExportResult:
    files: list[str]
    mapped: list[str]
    not_mapped: list[str]
    notes: list[str] = field(default_factory=list)
