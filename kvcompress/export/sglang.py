"""SGLang: the `--quantization-param-path` JSON, one per-tensor FP8 scale per layer and tensor-parallel rank:
{"kv_cache": {"dtype": "float8_e4m3fn", "scaling_factor": {"<tp_rank>": {"<layer>": scale}}}}.

SGLang takes one scale per layer for both K and V there, so the larger of the two calibrated scales
is written (neither stream clips); per-tensor scales are the same on every rank.
"""

from __future__ import annotations

import os

from kvcompress.config import KVCompressConfig
from kvcompress.export.common import ExportResult, fp8_scales_for_export, write_json_atomic

PARAM_FILE = "kv_cache_scales.json"


def sglang_params(k: list[float], v: list[float], tp_size: int = 1) -> dict:
    per_layer = {str(i): max(a, b) for i, (a, b) in enumerate(zip(k, v))}
    return {"kv_cache": {"dtype": "float8_e4m3fn",
                         "scaling_factor": {str(rank): dict(per_layer) for rank in range(tp_size)}}}


def export_sglang(cfg: KVCompressConfig, out_dir: str, *, tp_size: int = 1, allow_partial: bool = False) -> ExportResult:
    scales = fp8_scales_for_export(cfg, allow_partial)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, PARAM_FILE)
    write_json_atomic(path, sglang_params(scales.per_tensor("key"), scales.per_tensor("value"), tp_size))
    notes = [f"one scale per layer (max of K and V, max over kv heads) for {tp_size} tensor-parallel rank(s); "
             f"serve with --kv-cache-dtype fp8_e4m3 --quantization-param-path {path}"]
    return ExportResult([path], scales.mapped, scales.not_mapped, notes)
