"""`kvcompress calibrate`, `estimate`, `inspect` and `export`: the commands around a config file."""

from __future__ import annotations

import importlib.resources
import json
import os
import re

import click

from kvcompress.cli_common import dtype_option, load_model_or_exit
from kvcompress.config import FP8_SHIFT_DEFAULT, FP8_SHIFTS, ConfigError

_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_count(text: str) -> int:
    """"128k" -> 131072, "1m" -> 1048576, "4096" -> 4096 (k = 1024 tokens, as context lengths are quoted)."""
    m = _SIZE.match(str(text))
    if not m or m.group(3):
        raise click.BadParameter(f"{text!r} is not a count like 4096, 32k or 1m")
    return int(float(m.group(1)) * 1024 ** "_kmgt".index(m.group(2).lower() or "_"))


def parse_budget(text: str) -> float:
    """A ratio of the uncompressed cache ("0.25") or bytes ("2GiB", "1.5e9", "800MB")."""
    try:
        value = float(text)
    except ValueError:
        m = _SIZE.match(text)
        if not m or not m.group(2):
            raise click.BadParameter(f"{text!r} is neither a ratio (0.25) nor a size in bytes (2GiB, 800MB)")
        base = 1024 if m.group(3).lower().startswith("i") else 1000
        return float(m.group(1)) * base ** "_kmgt".index(m.group(2).lower())
    if value <= 0:
        raise click.BadParameter("the memory budget must be > 0")
    return value


def _fail(e: Exception):
    raise click.ClickException(str(e)) from e


# -- calibrate -------------------------------------------------------------------------------------------
@click.command()
@click.argument("model", default="smollm2-135m")
@click.option("--out", "-o", required=True, type=click.Path(dir_okay=False), help="Config file to write (.safetensors).")
@click.option("--text", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Calibration text (default: the shipped calib.txt, never used for evaluation).")
@click.option("--samples", default=32, show_default=True, type=click.IntRange(1, 100_000), help="Windows of text.")
@click.option("--seq-len", default=1024, show_default=True, type=click.IntRange(32, 1_000_000), help="Tokens per window.")
@click.option("--batch-size", default=4, show_default=True, type=click.IntRange(1, 4096), help="Windows per forward.")
@click.option("--target-bits", type=click.FloatRange(0, None, min_open=True), default=None,
              help="Mix fp8/nuq4/nuq3/nuq2 per layer and stream to this all-in bits per element.")
@click.option("--memory-budget", default=None,
              help="Instead of --target-bits: bytes (2GiB) or a ratio of the uncompressed cache (0.25).")
@click.option("--context", "budget_context", default="4k", show_default=True,
              help="Context length at which the budget is met (sinks and tails are amortised over it).")
@click.option("--batch", "budget_batch", default=1, show_default=True, type=click.IntRange(1, None),
              help="Sequences the byte budget is shared by.")
@click.option("--keep-ratios", default=None,
              help="With a budget: H2O keep ratios a layer may get besides keeping every token (0.75,0.5); "
                   "a config that evicts runs under kvcompress.enable(model).")
@click.option("--key-widths/--no-key-widths", default=True, show_default=True,
              help="With a budget: offer keys on calibrated bits per channel (less loss at equal bits; "
                   "read by the general fused kernel, slower on a GPU than the nuq layers' phase kernel).")
@click.option("--preset", "-p", default="nuq4", show_default=True, help="Base preset to calibrate (without a budget).")
@click.option("--head-budgets/--no-head-budgets", default=None,
              help="Per-kv-head H2O budgets from the model's attention (default: for every full-precision H2O "
                   "layer of the preset, e.g. -p h2o-25).")
@click.option("--per-head/--per-layer", default=True, show_default=True, help="One codebook per kv head or per layer.")
@click.option("--weighting", type=click.Choice(["attention", "none"]), default="none", show_default=True,
              help="Weight the codebook fit by the attention each element gets (attention) or not (none).")
@click.option("--fp8-shift", type=click.Choice(FP8_SHIFTS), default=FP8_SHIFT_DEFAULT, show_default=True,
              help="FP8 streams shifted by their channel means before coding (static scales of the rest).")
@click.option("--device", default=None, help="cpu, cuda, ... (default: where the model loads).")
@click.option("--load-in-4bit", is_flag=True, help="Load the weights in 4 bits (bitsandbytes NF4; CUDA).")
@click.option("--load-in-8bit", is_flag=True, help="Load the weights in 8 bits (bitsandbytes LLM.int8; CUDA).")
@dtype_option
@click.option("--progress/--no-progress", default=True, show_default=True)
def calibrate(model, out, text, samples, seq_len, batch_size, target_bits, memory_budget, budget_context,
              budget_batch, preset, per_head, weighting, device, progress, load_in_4bit=False, load_in_8bit=False,
              fp8_shift=FP8_SHIFT_DEFAULT, dtype="auto", keep_ratios=None, key_widths=True, head_budgets=None):
    """Fit codebooks, key statistics, outlier thresholds and FP8 scales (and per-layer bits) for MODEL."""
    from kvcompress.calib.calibrate import CalibrationSettings
    from kvcompress.calib.calibrate import calibrate as run

    if text is None:
        text_str = (importlib.resources.files("kvcompress") / "data" / "calib.txt").read_text()
    else:
        with open(text, encoding="utf-8") as f:
            text_str = f.read()
    if not text_str.strip():
        raise click.ClickException(f"the calibration text {text or 'calib.txt'!r} is empty")
    try:
        settings = CalibrationSettings(
            preset=preset, samples=samples, seq_len=seq_len, batch_size=batch_size, target_bits=target_bits,
            memory_budget=parse_budget(memory_budget) if memory_budget else None,
            context=parse_count(budget_context), batch=budget_batch, per_head=per_head, weighting=weighting,
            fp8_shift=fp8_shift, keep_ratios=_ratios(keep_ratios), key_widths=key_widths,
            head_budgets=head_budgets,
        )
        m, tok = load_model_or_exit(model, device, load_in_4bit, load_in_8bit, dtype)
        cfg = run(m, tok, text_str, settings, progress=progress, log=click.echo)
        cfg.save(out)  # atomic: an interrupted run leaves no file behind
    except ConfigError as e:
        _fail(e)
    alloc = cfg.notes.get("allocation")
    if alloc:
        click.echo(f"all-in bits per element at {alloc['context']} tokens: {alloc['achieved_bits']:.3f} "
                   f"(target {alloc['target_bits']:.3f})")
    click.echo(f"wrote {out} ({cfg.name}, {len(cfg.layers)} layers); see it with `kvcompress inspect {out}`")


def _ratios(text: str | None) -> tuple[float, ...]:
    if not text:
        return ()
    try:
        return tuple(float(r) for r in text.split(","))
    except ValueError:
        raise click.BadParameter(f"{text!r}: give comma-separated ratios such as 0.75,0.5",
                                 param_hint="--keep-ratios") from None


# -- estimate ------------------------------------------------------------------------------------------------
@click.command()
@click.argument("model", required=False)
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False), default=None,
              help="A kvcompress config (its model fingerprint is used when MODEL is not given).")
@click.option("--preset", "-p", default=None, help="Estimate a preset instead of a config file.")
@click.option("--context", default="128k", show_default=True, help="Tokens per sequence (4096, 32k, 128k, 1m).")
@click.option("--batch", default=1, show_default=True, type=click.IntRange(1, None))
@click.option("--dtype", default="bfloat16", show_default=True, type=click.Choice(["bfloat16", "float16", "float32"]),
              help="The model dtype an uncompressed cache is kept in.")
@click.option("--json", "as_json", is_flag=True, help="Print the numbers as JSON.")
def estimate(model, config_path, preset, context, batch, dtype, as_json):
    """KV cache memory per layer and in total, uncompressed vs with a config or preset."""
    import torch

    from kvcompress.calib.estimate import estimate_memory, print_estimate
    from kvcompress.calib.model_config import layout_for
    from kvcompress.config import KVCompressConfig

    if model is None and config_path is None:
        raise click.UsageError("give MODEL (a config.json, a folder, smollm2-135m or an HF id) or --config FILE")
    if config_path and preset:
        raise click.UsageError("give --config or --preset, not both")
    try:
        cfg = KVCompressConfig.load(config_path) if config_path else None
        layout = layout_for(model) if model else cfg.layout
        if cfg is not None:
            cfg.check_model(layout)
        elif preset:
            cfg = KVCompressConfig.from_preset(preset, layout)
        result = estimate_memory(layout, cfg, parse_count(context), batch, getattr(torch, dtype))
    except (ConfigError, OSError) as e:
        _fail(e)
    if as_json:
        click.echo(json.dumps(result, indent=2))
    else:
        print_estimate(result)


# -- inspect -------------------------------------------------------------------------------------------------
@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--tensors", is_flag=True, help="Also list every tensor with its shape.")
def inspect(file, tensors):
    """A readable per-layer table of a config: policy, fingerprint, format version, calibration notes."""
    from kvcompress.calib.inspect import print_config
    from kvcompress.config import KVCompressConfig

    try:
        cfg = KVCompressConfig.load(file)
    except ConfigError as e:
        _fail(e)
    print_config(cfg, file, show_tensors=tensors)


# -- export --------------------------------------------------------------------------------------------------
@click.command()
@click.argument("file", type=click.Path(exists=True, dir_okay=False))
@click.option("--format", "fmt", required=True, type=click.Choice(["vllm", "sglang", "trtllm"]))
@click.option("--out", "-o", "out_dir", required=True, type=click.Path(file_okay=False), help="Folder to write into.")
@click.option("--allow-partial", is_flag=True,
              help="Export the FP8 scales even when the config asks for more (codebooks, sinks, sparsity) than the "
                   "engine can express; what is dropped is listed.")
@click.option("--per-head", is_flag=True, help="vLLM only: per-kv-head scales (strategy attn_head).")
@click.option("--tp-size", default=1, show_default=True, type=click.IntRange(1, None),
              help="SGLang only: tensor-parallel ranks to write scales for.")
@click.option("--model-config", type=click.Path(exists=True, dir_okay=False), default=None,
              help="vLLM only: the model's config.json, to write a merged copy.")
def export(file, fmt, out_dir, allow_partial, per_head, tp_size, model_config):
    """Write what vLLM, SGLang or TensorRT-LLM can load from a config: calibrated FP8 KV scales."""
    from kvcompress.config import KVCompressConfig
    from kvcompress.export.common import ExportError

    if per_head and fmt != "vllm":
        raise click.UsageError("--per-head is for --format vllm only (SGLang and TensorRT-LLM take per-tensor scales)")
    try:
        cfg = KVCompressConfig.load(file)
        if fmt == "vllm":
            from kvcompress.export.vllm import export_vllm

            res = export_vllm(cfg, out_dir, per_head=per_head, allow_partial=allow_partial, model_config=model_config)
        elif fmt == "sglang":
            from kvcompress.export.sglang import export_sglang

            res = export_sglang(cfg, out_dir, tp_size=tp_size, allow_partial=allow_partial)
        else:
            from kvcompress.export.trtllm import export_trtllm

            res = export_trtllm(cfg, out_dir, allow_partial=allow_partial)
    except (ConfigError, ExportError) as e:
        _fail(e)
    click.echo(f"exported {os.path.basename(file)} for {fmt}:")
    for f in res.files:
        click.echo(f"  wrote {f}")
    click.echo("mapped:")
    for line in res.mapped:
        click.echo(f"  + {line}")
    click.echo("not mapped (the engine has no slot for these):" if res.not_mapped else "not mapped: nothing")
    for line in res.not_mapped:
        click.echo(f"  - {line}")
    for line in res.notes:
        click.echo(f"note: {line}")

