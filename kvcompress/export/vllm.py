"""vLLM / compressed-tensors: `config.json` with `quantization_config.kv_cache_scheme` and a safetensors
file of fp32 `model.layers.{i}.self_attn.k_scale` / `v_scale` (per tensor: a scalar; per kv head: [H]).

vLLM loads these names from a checkpoint folder (and remaps them onto its attention layers); the
scheme says FP8 (8-bit float, E4M3), static (dynamic false), symmetric, strategy "tensor" or
"attn_head". Without the model's own config.json (`model_config`, or a config.json already in the output
folder, which is merged into and never replaced), config.json holds only the `quantization_config` block,
to be merged into the model's config.json.
"""

from __future__ import annotations

import json
import os

from kvcompress.config import KVCompressConfig
from kvcompress.export.common import (
    ExportError,
    ExportResult,
    fp8_scales_for_export,
    write_json_atomic,
    write_safetensors_atomic,
)

SCALES_FILE = "kv_cache_scales.safetensors"


def kv_cache_scheme(per_head: bool) -> dict:
    return {"num_bits": 8, "type": "float", "strategy": "attn_head" if per_head else "tensor",
            "dynamic": False, "symmetric": True}


def quantization_config(per_head: bool) -> dict:
    """A compressed-tensors config whose only quantization is the KV cache (weights left dense)."""
    return {
        "quant_method": "compressed-tensors",
        "format": "dense",
        "quantization_status": "frozen",
        "config_groups": {},
        "ignore": [],
        "kv_cache_scheme": kv_cache_scheme(per_head),
    }


def merged_quantization_config(existing: dict | None, per_head: bool, source: str | None) -> dict:
    """The model's quantization_config with the KV cache scheme set: ours where it has none; a
    compressed-tensors one (quantized weights) keeps its weight groups and gains kv_cache_scheme; any other
    method is refused, as vLLM reads kv_cache_scheme from compressed-tensors configs only."""
    if existing is None:
        return quantization_config(per_head)
    if existing.get("quant_method") == "compressed-tensors":
        return {**existing, "kv_cache_scheme": kv_cache_scheme(per_head)}
    raise ExportError(
        f"{source} already has a quantization_config of method {existing.get('quant_method')!r}; vLLM reads "
        "kv_cache_scheme from compressed-tensors configs only, and replacing it would drop the weights' "
        "quantization. Export to another folder and use the engine's own FP8 KV cache with the scales file "
        "(or quantize the weights with compressed-tensors)"
    )


def export_vllm(cfg: KVCompressConfig, out_dir: str, *, per_head: bool = False, allow_partial: bool = False,
                model_config: str | None = None) -> ExportResult:
    scales = fp8_scales_for_export(cfg, allow_partial)
    os.makedirs(out_dir, exist_ok=True)
    tensors = {}
    for i in range(len(cfg.layers)):
        for stream, short in (("key", "k"), ("value", "v")):
            s = (scales.key if stream == "key" else scales.value)[i].float()
            tensors[f"model.layers.{i}.self_attn.{short}_scale"] = s.clone() if per_head else s.max().reshape(())
    config_path = os.path.join(out_dir, "config.json")
    if not model_config and os.path.exists(config_path):
        model_config = config_path  # exporting into the model's folder: merge into its config, never replace it
    doc = {}
    if model_config:
        with open(model_config) as f:
            doc = json.load(f)
    doc["quantization_config"] = merged_quantization_config(doc.get("quantization_config"), per_head, model_config)
    scales_path = os.path.join(out_dir, SCALES_FILE)
    write_safetensors_atomic(scales_path, tensors, {"producer": "kvcompress", "source_config": cfg.name})
    write_json_atomic(config_path, doc)
    notes = [f"scales are {'per kv head (strategy attn_head; FlashAttention backend)' if per_head else 'per tensor (max over kv heads)'}"]
    if model_config and os.path.abspath(model_config) == os.path.abspath(config_path):
        notes.append(f"merged quantization_config into the existing {config_path}")
    if not model_config:
        notes.append("config.json holds only quantization_config: merge it into the model's config.json "
                     "(or pass --model-config), and put the scales file in the model folder (list it in "
                     "model.safetensors.index.json if the folder has one)")
    mapped = scales.mapped + [f"kv_cache_scheme {json.dumps(kv_cache_scheme(per_head))}"]
    return ExportResult([config_path, scales_path], mapped, scales.not_mapped, notes)
