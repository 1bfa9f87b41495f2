"""TensorRT-LLM / ModelOpt: `hf_quant_config.json` with kv_cache_quant_algo "FP8" and a safetensors file of
fp32 per-tensor scales `model.layers.{i}.self_attn.k_proj.k_scale` / `v_proj.v_scale` (ModelOpt's names).

quant_algo stays null: only the KV cache is quantized, the weights are left as they are.
"""

from __future__ import annotations

import os

import torch

from kvcompress import __version__
from kvcompress.config import KVCompressConfig
from kvcompress.export.common import (
    ExportResult,
    fp8_scales_for_export,
    write_json_atomic,
    write_safetensors_atomic,
)

SCALES_FILE = "kv_cache_scales.safetensors"


def hf_quant_config() -> dict:
    return {
        "producer": {"name": "kvcompress", "version": __version__},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8", "exclude_modules": ["lm_head"]},
    }


def export_trtllm(cfg: KVCompressConfig, out_dir: str, *, allow_partial: bool = False) -> ExportResult:
    scales = fp8_scales_for_export(cfg, allow_partial)
    os.makedirs(out_dir, exist_ok=True)
    k, v = scales.per_tensor("key"), scales.per_tensor("value")
    tensors = {}
    for i in range(len(cfg.layers)):
        tensors[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(k[i], dtype=torch.float32)
        tensors[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(v[i], dtype=torch.float32)
    scales_path = os.path.join(out_dir, SCALES_FILE)
    write_safetensors_atomic(scales_path, tensors, {"producer": "kvcompress", "source_config": cfg.name})
    config_path = os.path.join(out_dir, "hf_quant_config.json")
    write_json_atomic(config_path, hf_quant_config())
    notes = ["per-tensor scales (max over kv heads); put both files in the model folder before building the engine"]
    return ExportResult([config_path, scales_path], scales.mapped, scales.not_mapped, notes)
