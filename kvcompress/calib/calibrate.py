"""The calibration pipeline: text -> statistics -> fitted tensors -> (sensitivities -> allocation) -> config.

    cfg = calibrate(model, tokenizer, text, CalibrationSettings(preset="nuq4"))
    cfg = calibrate(model, tokenizer, text, CalibrationSettings(target_bits=3.5))
    cfg.save("smollm2.safetensors")

Without a budget, the base preset keeps its per-layer methods and gets calibrated tensors (NUQ
codebooks, key channel statistics, the queries' channel weights that pick key page outliers, outlier
thresholds, static FP8 scales); per-token nuq values are fitted, or rotated onto Gaussian levels where the
probe's attention error says so (calib/value_choice.py). With --target-bits or
--memory-budget every full-attention layer's keys and values each get one of fp8 / nuq4 / nuq3 / nuq2,
chosen by the allocation so the all-in bits per element at `context` tokens meet the budget with the
least total sensitivity (calib/mixed.py): each stream's expected KL divergence, its probe's attention
error weighted by the Fisher information of the attention output (calib/fisher.py, calib/sensitivity.py);
with `keep_ratios` a layer may also evict with H2O, keeping that ratio of its tokens. Every stream gets
static FP8 scales, so any config can be exported. A base preset with full-precision H2O layers (h2o-25,
h2o-50, ...) gets per-kv-head budgets fitted on `head_windows` of the windows: the least expected KL
divergence of H2O's replayed evictions for the preset's total of tokens (calib/head_budgets.py).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import asdict, dataclass, replace

import torch

from kvcompress.calib.bits import uncompressed_layer_bytes
from kvcompress.calib.candidates import LayerFits, with_fp8_scales
from kvcompress.calib.collect import CollectSettings, calibration_windows, collect
from kvcompress.calib.fisher import output_fisher
from kvcompress.calib.head_budgets import fit_head_shares, sparse_h2o_layers
from kvcompress.calib.mixed import mixed_layers
from kvcompress.calib.value_choice import choose_values
from kvcompress.config import FP8_SHIFT_DEFAULT, FP8_SHIFTS, ConfigError, KVCompressConfig, LayerPolicy
from kvcompress.evaluation.progress import progress_display
from kvcompress.layout.arch import ModelLayout
from kvcompress.presets import build_preset, preset_names


@dataclass
class CalibrationSettings:
    """What `kvcompress calibrate` was asked for (stored in the config's notes).

    target_bits: all-in bits per element to meet; memory_budget: bytes (> 1) or a ratio of the
    uncompressed cache in the model dtype (<= 1), at `context` tokens and `batch` sequences.
    """

    preset: str = "nuq4"
    samples: int = 32
    seq_len: int = 1024
    batch_size: int = 4
    target_bits: float | None = None
    memory_budget: float | None = None
    context: int = 4096
    batch: int = 1
    per_head: bool = True
    # "none" measured better than "attention" on held-out attention error for SmolLM2 (calib_results.md)
    weighting: str = "none"
    outlier_fraction: float = 0.01
    sample_tokens: int = 4096
    # FP8 streams shifted by their channel means before coding: "none", "keys" or "both" (BENCHMARKS.md,
    # "Calibrated FP8 shifted per channel": the shift cleans the attention error, perplexity disagrees)
    fp8_shift: str = FP8_SHIFT_DEFAULT
    # H2O keep ratios the allocation may give a layer besides keeping everything (a budget only; a config
    # that evicts needs `kvcompress.enable(model)`). Off by default: on SmolLM2, H2O over nuq4 lost more
    # perplexity per bit saved than lower bit widths at 4-5 bits (BENCHMARKS.md, issue 6)
    keep_ratios: tuple[float, ...] = ()
    # keys on calibrated widths per channel ("cwB") among a budget's choices. They cut the 3.5-bit config's KL
    # 41 % on SmolLM2, but only the general fused kernel reads them (several times slower than bf16 on a GPU,
    # BENCHMARKS.md); without them every nuq layer stays on the phase kernel
    key_widths: bool = True
    # per-kv-head H2O budgets (SparsitySpec.head_shares): None fits them where the config has full-precision
    # H2O layers, True requires such layers, False never fits them
    head_budgets: bool | None = None
    head_windows: int = 8  # calibration windows the head budgets replay (about 15 s each for SmolLM2 at 1024, 2 cores)

    def __post_init__(self):
        if self.target_bits is not None and self.memory_budget is not None:
            raise ConfigError("give either a target in bits (--target-bits) or a memory budget, not both")
        if self.target_bits is not None and self.target_bits <= 0:
            raise ConfigError(f"--target-bits must be > 0, got {self.target_bits}")
        if self.memory_budget is not None and self.memory_budget <= 0:
            raise ConfigError(f"--memory-budget must be > 0, got {self.memory_budget}")
        if self.context < 1 or self.batch < 1:
            raise ConfigError("the budget's context and batch must be >= 1")
        self.keep_ratios = tuple(float(r) for r in self.keep_ratios)
        if any(not 0.0 < r <= 1.0 for r in self.keep_ratios):
            raise ConfigError(f"keep ratios must be in (0, 1], got {list(self.keep_ratios)}")
        if self.keep_ratios and not self.has_budget:
            raise ConfigError("keep ratios are choices of the budget's allocation: give --target-bits or "
                              "--memory-budget with them")
        if self.preset not in preset_names():  # before minutes of collection, not after
            raise ConfigError(f"unknown preset {self.preset!r} to calibrate; available: {', '.join(preset_names())}")
        if self.head_windows < 1:
            raise ConfigError(f"head_windows must be >= 1, got {self.head_windows}")
        if self.fp8_shift not in FP8_SHIFTS:
            raise ConfigError(f"fp8_shift must be one of {', '.join(FP8_SHIFTS)}, got {self.fp8_shift!r}")

    @property
    def has_budget(self) -> bool:
        return self.target_bits is not None or self.memory_budget is not None

    def collect_settings(self) -> CollectSettings:
        return CollectSettings(
            samples=self.samples, seq_len=self.seq_len, batch_size=self.batch_size,
            sample_tokens=self.sample_tokens, weighting=self.weighting,
        )


def target_bits_for(settings: CalibrationSettings, layout: ModelLayout, dtype: torch.dtype) -> float:
    """The all-in bits per element a budget stands for."""
    if settings.target_bits is not None:
        return float(settings.target_bits)
    dtype_bits = torch.finfo(dtype).bits
    if settings.memory_budget <= 1.0:
        return settings.memory_budget * dtype_bits
    elements = sum(
        uncompressed_layer_bytes(layout, i, settings.context, settings.batch, dtype) for i in range(layout.num_layers)
    ) / (dtype_bits / 8)
    return settings.memory_budget * 8 / elements


def calibrate(model, tokenizer, text: str, settings: CalibrationSettings | None = None, progress: bool = True,
              log=None) -> KVCompressConfig:
    """A calibrated KVCompressConfig for `model` from `text` (see the module docstring)."""
    settings = settings or CalibrationSettings()
    log = log or (lambda msg: None)
    start = time.perf_counter()
    layout = ModelLayout.from_model_config(model.config)
    if settings.head_budgets and (settings.has_budget or not sparse_h2o_layers(build_preset(settings.preset, layout))):
        # before minutes of collection, not after
        raise ConfigError(f"per-kv-head budgets (--head-budgets) need full-precision H2O layers, and "
                          f"{'a bits budget quantizes every layer' if settings.has_budget else settings.preset + ' has none'}"
                          "; calibrate an H2O preset (-p h2o-25, h2o-50) or drop --head-budgets")
    dtype = next(model.parameters()).dtype
    token_ids = tokenizer(text, add_special_tokens=False)["input_ids"] if text.strip() else []
    windows = calibration_windows(token_ids, settings.samples, settings.seq_len)
    log(f"calibrating on {windows.shape[0]} x {windows.shape[1]} tokens (the text has {len(token_ids)} tokens)")
    collect_settings = settings.collect_settings()
    stats = collect(model, windows, collect_settings, progress=progress)
    if any(s.probe_q is not None for s in stats):
        # the probe's attention outputs weighted by what they matter to the model's output (calib/fisher.py);
        # the probe is the first window's first tokens (collect)
        probe = windows[:1, : min(collect_settings.probe_tokens, windows.shape[1])]
        fisher = output_fisher(model, probe, seed=collect_settings.seed)
        for i, f in fisher.items():
            if stats[i].probe_q is not None and f.shape[2] == stats[i].probe_q.shape[2]:
                stats[i].probe_fisher = f
    notes = {
        "calibration": {
            **asdict(settings),
            "keep_ratios": list(settings.keep_ratios),  # as the JSON metadata reads it back
            "model_dtype": str(dtype).removeprefix("torch."),
            "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
            "text_tokens": len(token_ids),
            "windows": list(windows.shape),
            "weighting_used": "attention" if stats[0].key_weight is not None else "none",
            # sensitivities in expected KL per position (Fisher-weighted) or relative attention error
            "sensitivity_unit": "kl" if any(s.probe_fisher is not None for s in stats) else "relative",
            "seconds": {"collect": round(time.perf_counter() - start, 1)},
        }
    }
    cfg = config_from_stats(stats, layout, dtype, settings, notes, progress)
    if settings.head_budgets or (settings.head_budgets is None and sparse_h2o_layers(cfg)):
        t0 = time.perf_counter()
        # windows spread over the text, not its first few (the collection's windows overlap on a short text)
        spread = torch.linspace(0, windows.shape[0] - 1, min(settings.head_windows, windows.shape[0])).round().long()
        cfg, cfg.notes["head_budgets"] = fit_head_shares(model, windows[spread], cfg, log)
        cfg.notes["calibration"]["seconds"]["head_budgets"] = round(time.perf_counter() - t0, 1)
    cfg.notes["calibration"]["seconds"]["total"] = round(time.perf_counter() - start, 1)
    log(f"calibrated in {time.perf_counter() - start:.0f} s")
    return cfg


def config_from_stats(stats, layout: ModelLayout, dtype: torch.dtype, settings: CalibrationSettings,
                      notes: dict | None = None, progress: bool = False) -> KVCompressConfig:
    """The config for `settings` from collected statistics (one collection can serve several settings)."""
    notes = dict(notes or {})
    fits = [LayerFits(s, settings.outlier_fraction, settings.per_head, settings.fp8_shift) for s in stats]
    if settings.has_budget:
        target = target_bits_for(settings, layout, dtype)
        n_full = sum(not layout.is_sliding(i) for i in range(layout.num_layers))
        with progress_display(progress) as bar:
            task = bar.add_task("sensitivity", total=n_full) if bar is not None else None
            step = (lambda: bar.advance(task, 1)) if bar is not None else None
            layers, notes["allocation"] = mixed_layers(fits, layout, settings, target, dtype, step)
        name = f"calibrated-mixed-{target:.2f}b"
    else:
        layers, notes["value_choice"] = _preset_layers(fits, layout, settings.preset)
        name = f"calibrated-{settings.preset}"
    return KVCompressConfig(layout=layout, layers=layers, name=name, notes=notes)


def _preset_layers(fits: list[LayerFits], layout: ModelLayout, preset: str) -> tuple[list[LayerPolicy], dict]:
    """The base preset's policies with calibrated tensors for every stream that takes them, nuq values fitted
    or rotated per layer (value_choice.py); and per layer what was chosen, with the probe's two losses."""
    base = build_preset(preset, layout)
    layers, chosen = [], {}
    for i, policy in enumerate(base.layers):
        values = fits[i].spec_tensors(policy.value, "value")
        policy, values, choice, losses = choose_values(policy, fits[i], values)
        if losses:
            chosen[str(i)] = {"values": choice, **{k: float(f"{v:.4g}") for k, v in losses.items()}}
        tensors = {**fits[i].spec_tensors(policy.key, "key"), **values}
        layers.append(with_fp8_scales(replace(policy, tensors=tensors), fits[i]))
    return layers, chosen
