"""Pieces the command modules share."""

from __future__ import annotations

import click


# --dtype choices: "auto" keeps the checkpoint's dtype (SmolLM2's GGUF gives float32).
DTYPES = ("auto", "float32", "bfloat16", "float16")


def dtype_option(f):
    """The shared `--dtype` option of the commands that load a model."""
    return click.option(
        "--dtype", type=click.Choice(DTYPES), default="auto", show_default=True,
        help="Weights and activations dtype; the exact windows of a cache are held in it (bfloat16 is what "
             "serving runs; auto keeps the checkpoint's, float32 for the embedded GGUF).",
    )(f)


def load_model_or_exit(model: str, device: str | None, load_in_4bit: bool = False, load_in_8bit: bool = False,
                       dtype: str = "auto"):
    """(model, tokenizer) for a command; a load problem becomes a one-line error naming the fix."""
    import torch

    from kvcompress.models import ModelLoadError, load_model, weight_quantization_kwargs

    try:
        kwargs = weight_quantization_kwargs(load_in_4bit, load_in_8bit)
        if dtype != "auto":
            kwargs["dtype"] = getattr(torch, dtype)
        return load_model(model, device=None if "quantization_config" in kwargs else device, **kwargs)
    except ModelLoadError as e:
        raise click.ClickException(str(e))
