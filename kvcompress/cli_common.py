"""Pieces the command modules share."""

from __future__ import annotations

import click


def load_model_or_exit(model: str, device: str | None, load_in_4bit: bool = False, load_in_8bit: bool = False):
    """(model, tokenizer) for a command; a load problem becomes a one-line error naming the fix."""
    from kvcompress.models import ModelLoadError, load_model, weight_quantization_kwargs

    try:
        kwargs = weight_quantization_kwargs(load_in_4bit, load_in_8bit)
        return load_model(model, device=None if kwargs else device, **kwargs)
    except ModelLoadError as e:
        raise click.ClickException(str(e))
