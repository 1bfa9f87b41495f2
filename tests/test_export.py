"""Serving-engine exports: written, parsed back (vLLM's with compressed-tensors), refused when they would lie."""

from __future__ import annotations

import json
import os

import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import load_file

from kvcompress import KVCompressConfig, ModelLayout
from kvcompress.export.common import ExportError, fp8_scales_for_export
from kvcompress.export.sglang import export_sglang
from kvcompress.export.trtllm import export_trtllm
from kvcompress.export.vllm import export_vllm

LAYOUT = ModelLayout("llama", 3, 2, 64, 64, ("full_attention",) * 3, num_query_heads=4)


def _scales(i: int, stream: int) -> torch.Tensor:
    return torch.tensor([0.01 * (i + 1) + 0.001 * stream, 0.02 * (i + 1) + 0.001 * stream])  # [H]


def fp8_config() -> KVCompressConfig:
    """An FP8 config with static scales and no shift (a hand-written one)."""
    cfg = KVCompressConfig.from_preset("fp8", LAYOUT)
    for i in range(LAYOUT.num_layers):
        cfg = cfg.with_layer(i, tensors={"key.scale": _scales(i, 0), "value.scale": _scales(i, 1)})
    return cfg


def nuq4_config(with_scales: bool) -> KVCompressConfig:
    cfg = KVCompressConfig.from_preset("nuq4", LAYOUT)
    if with_scales:
        for i in range(LAYOUT.num_layers):
            cfg = cfg.with_layer(i, tensors={"key.fp8_scale": _scales(i, 0), "value.fp8_scale": _scales(i, 1)})
    return cfg


def shifted_fp8_config() -> KVCompressConfig:
    """An FP8 config as `calibrate --preset fp8` writes it: streams shifted per channel, static scales of
    the shifted streams ("scale"), and of the unshifted ones ("fp8_scale", what an engine takes)."""
    cfg = KVCompressConfig.from_preset("fp8", LAYOUT)
    d = LAYOUT.key_head_dim
    for i in range(LAYOUT.num_layers):
        t = {}
        for s, stream in enumerate(("key", "value")):
            t[f"{stream}.shift"] = torch.full((2, d), 0.5)
            t[f"{stream}.scale"] = _scales(i, s) / 4
            t[f"{stream}.fp8_scale"] = _scales(i, s)
        cfg = cfg.with_layer(i, tensors=t)
    return cfg


def _no_temp_files(d):
    assert not [f for f in os.listdir(d) if f.startswith(".kvcompress-")]


def test_vllm_export_parses_with_compressed_tensors(tmp_path):
    from compressed_tensors import QuantizationConfig
    from compressed_tensors.quantization import QuantizationStrategy, QuantizationType

    res = export_vllm(fp8_config(), str(tmp_path))
    # the fp8 preset's exact sinks and window are the only thing the engine does not reproduce
    assert res.not_mapped and all("the engine stores them in FP8" in line for line in res.not_mapped)
    doc = json.loads((tmp_path / "config.json").read_text())
    qc = QuantizationConfig.model_validate(doc["quantization_config"])
    kv = qc.kv_cache_scheme
    assert kv.num_bits == 8 and kv.type == QuantizationType.FLOAT and kv.symmetric and not kv.dynamic
    assert kv.strategy == QuantizationStrategy.TENSOR
    t = load_file(str(tmp_path / "kv_cache_scales.safetensors"))
    assert len(t) == 2 * LAYOUT.num_layers
    for i in range(LAYOUT.num_layers):
        k, v = t[f"model.layers.{i}.self_attn.k_scale"], t[f"model.layers.{i}.self_attn.v_scale"]
        assert k.dtype == torch.float32 and k.shape == ()
        assert float(k) == float(_scales(i, 0).max()) and float(v) == float(_scales(i, 1).max())
    _no_temp_files(tmp_path)


def test_shifted_fp8_exports_the_scales_of_the_unshifted_streams(tmp_path):
    """An engine's FP8 cache has no shift: it gets the scales of the streams as they are, and the shift is
    reported as not reproduced without blocking the export."""
    res = export_vllm(shifted_fp8_config(), str(tmp_path))
    assert any("shifted per channel" in line for line in res.not_mapped)
    t = load_file(str(tmp_path / "kv_cache_scales.safetensors"))
    for i in range(LAYOUT.num_layers):
        assert float(t[f"model.layers.{i}.self_attn.k_scale"]) == float(_scales(i, 0).max())
        assert float(t[f"model.layers.{i}.self_attn.v_scale"]) == float(_scales(i, 1).max())


def test_vllm_per_head_export_and_merge_into_model_config(tmp_path):
    from compressed_tensors import QuantizationConfig
    from compressed_tensors.quantization import QuantizationStrategy

    model_cfg = tmp_path / "model_config.json"
    model_cfg.write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    out = tmp_path / "out"
    export_vllm(fp8_config(), str(out), per_head=True, model_config=str(model_cfg))
    doc = json.loads((out / "config.json").read_text())
    assert doc["model_type"] == "llama"
    assert QuantizationConfig.model_validate(doc["quantization_config"]).kv_cache_scheme.strategy == (
        QuantizationStrategy.ATTN_HEAD)
    t = load_file(str(out / "kv_cache_scales.safetensors"))
    assert torch.equal(t["model.layers.2.self_attn.v_scale"], _scales(2, 1))


def test_vllm_export_into_the_model_folder_merges_its_config_json(tmp_path):
    """Exporting into a folder that holds the model's config.json keeps every key of it (it was replaced by
    one holding only quantization_config); a compressed-tensors weight config keeps its groups and gains
    the KV scheme; another quantization method is refused and the file left as it was."""
    from compressed_tensors import QuantizationConfig

    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 3}))
    export_vllm(fp8_config(), str(folder))
    doc = json.loads((folder / "config.json").read_text())
    assert doc["model_type"] == "llama" and doc["num_hidden_layers"] == 3
    assert QuantizationConfig.model_validate(doc["quantization_config"]).kv_cache_scheme.num_bits == 8

    weights = {"quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
               "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 8, "type": "float"}}}}
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "quantization_config": weights}))
    export_vllm(fp8_config(), str(folder))
    qc = json.loads((folder / "config.json").read_text())["quantization_config"]
    assert qc["config_groups"] == weights["config_groups"] and qc["ignore"] == ["lm_head"]
    assert qc["kv_cache_scheme"]["num_bits"] == 8

    awq = json.dumps({"model_type": "llama", "quantization_config": {"quant_method": "awq", "bits": 4}})
    (folder / "config.json").write_text(awq)
    with pytest.raises(ExportError, match="'awq'.*compressed-tensors"):
        export_vllm(fp8_config(), str(folder))
    assert (folder / "config.json").read_text() == awq


def test_sglang_export(tmp_path):
    export_sglang(fp8_config(), str(tmp_path), tp_size=2)
    doc = json.loads((tmp_path / "kv_cache_scales.json").read_text())
    assert doc["kv_cache"]["dtype"] == "float8_e4m3fn"
    sf = doc["kv_cache"]["scaling_factor"]
    assert set(sf) == {"0", "1"} and sf["0"] == sf["1"]
    expected = max(float(_scales(1, 0).max()), float(_scales(1, 1).max()))
    assert sf["0"]["1"] == pytest.approx(expected, rel=1e-7)
    assert len(sf["0"]) == LAYOUT.num_layers
    _no_temp_files(tmp_path)


def test_trtllm_export(tmp_path):
    export_trtllm(fp8_config(), str(tmp_path))
    doc = json.loads((tmp_path / "hf_quant_config.json").read_text())
    assert doc["quantization"]["kv_cache_quant_algo"] == "FP8"
    t = load_file(str(tmp_path / "kv_cache_scales.safetensors"))
    assert float(t["model.layers.0.self_attn.k_proj.k_scale"]) == pytest.approx(float(_scales(0, 0).max()))
    assert float(t["model.layers.2.self_attn.v_proj.v_scale"]) == pytest.approx(float(_scales(2, 1).max()))


def test_export_without_calibrated_scales_is_refused(tmp_path):
    with pytest.raises(ExportError, match="no calibrated FP8 scales"):
        export_vllm(KVCompressConfig.from_preset("fp8", LAYOUT), str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


def test_nuq_config_is_refused_unless_partial_export_is_allowed(tmp_path):
    cfg = nuq4_config(with_scales=True)
    with pytest.raises(ExportError, match="more than the engine can express") as e:
        export_sglang(cfg, str(tmp_path / "refused"))
    assert "nuq4 codebook" in str(e.value)
    assert not (tmp_path / "refused").exists()
    res = export_sglang(cfg, str(tmp_path / "partial"), allow_partial=True)
    assert any("nuq4 codebook" in line for line in res.not_mapped)
    assert (tmp_path / "partial" / "kv_cache_scales.json").exists()


def test_mla_and_e5m2_are_refused():
    mla = ModelLayout("deepseek_v3", 2, 1, 512, 64, ("full_attention",) * 2, attention="mla", num_query_heads=4,
                      extra={"qk_nope_head_dim": 128, "v_head_dim": 128})
    cfg = KVCompressConfig.from_preset("fp8", mla)
    with pytest.raises(ExportError, match="MLA"):
        fp8_scales_for_export(cfg)
    e5 = KVCompressConfig.from_preset("fp8-e5m2", LAYOUT)
    for i in range(3):
        e5 = e5.with_layer(i, tensors={"key.scale": _scales(i, 0), "value.scale": _scales(i, 1)})
    with pytest.raises(ExportError, match="E5M2"):
        fp8_scales_for_export(e5, allow_partial=True)


def test_cli_export_prints_mapped_and_not_mapped(tmp_path):
    from kvcompress.cli import main

    path = tmp_path / "nuq.safetensors"
    nuq4_config(with_scales=True).save(path)
    runner = CliRunner()
    refused = runner.invoke(main, ["export", str(path), "--format", "vllm", "--out", str(tmp_path / "a")])
    assert refused.exit_code != 0 and "--allow-partial" in refused.output
    ok = runner.invoke(main, ["export", str(path), "--format", "trtllm", "--out", str(tmp_path / "b"),
                              "--allow-partial"])
    assert ok.exit_code == 0, ok.output
    assert "mapped:" in ok.output and "not mapped" in ok.output and "nuq4 codebook" in ok.output
