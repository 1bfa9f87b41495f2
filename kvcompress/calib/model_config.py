"""A model's cache layout from what the user names: a config.json, a checkpoint folder, the embedded
"smollm2-135m", or a hub id whose config is available (cached or online). No weights are loaded."""

from __future__ import annotations

import json
import os

from kvcompress.config import ConfigError
from kvcompress.layout.arch import ModelLayout


def load_model_config(name_or_path: str):
    """A transformers PretrainedConfig for `name_or_path` (see the module docstring)."""
    from transformers import AutoConfig

    from kvcompress.models import _EMBEDDED, smollm2_gguf_path

    if name_or_path.lower() in _EMBEDDED:
        folder, fname = os.path.split(smollm2_gguf_path())
        return AutoConfig.from_pretrained(folder, gguf_file=fname)
    if os.path.isfile(name_or_path):
        with open(name_or_path) as f:
            doc = json.load(f)
        if "model_type" not in doc:
            raise ConfigError(f"{name_or_path} has no 'model_type'; pass a transformers config.json")
        model_type = doc.pop("model_type")
        return AutoConfig.for_model(model_type, **doc)
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except (OSError, ValueError) as e:
        raise ConfigError(
            f"no model config for {name_or_path!r} ({e.__class__.__name__}: {str(e).splitlines()[0]}); pass a "
            "config.json path, a checkpoint folder, smollm2-135m, or a hub id available offline"
        ) from e


def layout_for(name_or_path: str) -> ModelLayout:
    return ModelLayout.from_model_config(load_model_config(name_or_path))
