"""KVCompressConfig files: a save -> load round trip is lossless (tensors included), every kind of bad
file is refused with a ConfigError that says what is wrong, loading never unpickles anything, and a
save that fails leaves nothing (or the previous file) behind."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import safetensors.torch
import torch
from transformers import LlamaConfig, Qwen3Config

from kvcompress import CompressedCache, ConfigError, KVCompressConfig
from kvcompress.cache import CompressedLayer
from kvcompress.config import LayerPolicy, QuantSpec

H, D = 2, 16


def llama_config(**overrides):
    kwargs = dict(
        vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=H
    )
    return LlamaConfig(**{**kwargs, **overrides})


def calibrated_nuq4(model_config) -> KVCompressConfig:
    """The nuq4 preset carrying calibrated tensors of several shapes and dtypes, different per layer."""
    cfg = KVCompressConfig.from_preset("nuq4", model_config)
    g = torch.Generator().manual_seed(0)
    for i in range(len(cfg.layers)):
        cfg = cfg.with_layer(
            i,
            tensors={
                "key.codebook": torch.sort(torch.randn(16, generator=g)).values,
                "key.channel_mean": torch.randn(H, D, generator=g),
                "key.channel_scale": torch.rand(H, D, generator=g) + 0.5,
                "value.codebook": torch.sort(torch.randn(H, 16, generator=g), dim=-1).values,
                "value.outlier_threshold": torch.rand(H, generator=g).to(torch.float16),
            },
        )
    cfg.notes = {"calibrated_on": "unit test", "tokens": 123}
    return cfg


@pytest.fixture
def saved(tmp_path):
    """(path, config) of a calibrated nuq4 config saved for the tiny Llama layout."""
    cfg = calibrated_nuq4(llama_config())
    path = tmp_path / "kv.safetensors"
    cfg.save(path)
    return str(path), cfg


def read_raw(path):
    """(metadata doc, tensors) of a saved config, read without kvcompress."""
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        return json.loads(f.metadata()["kvcompress"]), {k: f.get_tensor(k) for k in f.keys()}


def write_raw(path, doc, tensors):
    safetensors.torch.save_file(tensors, path, metadata={"kvcompress": json.dumps(doc)})


# -- round trip ------------------------------------------------------------------------------------------
def test_round_trip_is_equal_with_tensors(saved):
    path, cfg = saved
    loaded = KVCompressConfig.load(path)
    assert loaded == cfg
    assert loaded.name == "nuq4" and loaded.notes == cfg.notes and loaded.layout == cfg.layout
    for a, b in zip(loaded.layers, cfg.layers):
        assert a.tensors.keys() == b.tensors.keys()
        for k in a.tensors:
            assert a.tensors[k].dtype == b.tensors[k].dtype and torch.equal(a.tensors[k], b.tensors[k])
    # equality is not vacuous: one changed element makes the configs differ
    changed = loaded.layers[1].tensors["value.codebook"].clone()
    changed[0, 0] += 1e-3
    assert loaded.with_layer(1, tensors={**loaded.layers[1].tensors, "value.codebook": changed}) != cfg


@pytest.mark.compat  # reads the layout from a transformers config
def test_loaded_tensors_reach_the_codecs(saved):
    """CompressedCache(model_config, path) builds its codecs from the saved codebooks."""
    path, cfg = saved
    cache = CompressedCache(llama_config(), path)
    assert cache.kv_config == cfg
    for i, layer in enumerate(cache.layers):
        assert isinstance(layer, CompressedLayer)
        layer.update(torch.randn(1, H, 3, D), torch.randn(1, H, 3, D))
        assert torch.equal(layer.key_store.codec.codebook, cfg.layers[i].tensors["key.codebook"])
        assert torch.equal(layer.value_store.codec.codebook, cfg.layers[i].tensors["value.codebook"])


def test_round_trip_without_tensors(tmp_path):
    cfg = KVCompressConfig.from_preset("int4", llama_config())
    cfg.save(tmp_path / "int4.safetensors")
    assert KVCompressConfig.load(tmp_path / "int4.safetensors") == cfg


# -- bad files ---------------------------------------------------------------------------------------------
@pytest.mark.compat  # reads the layout from a transformers config
def test_config_for_another_model_is_refused(saved):
    path, _ = saved
    other = Qwen3Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=32,
    )
    with pytest.raises(ConfigError, match="different model") as e:
        CompressedCache(other, path)
    msg = str(e.value)
    assert "num_kv_heads" in msg and "key_head_dim" in msg and "calibrate" in msg
    with pytest.raises(ConfigError, match="num_layers"):
        CompressedCache(llama_config(num_hidden_layers=3), path)


@pytest.mark.parametrize("version", [2, 0, None, "1"])
def test_unknown_version_is_refused(saved, tmp_path, version):
    path, _ = saved
    doc, tensors = read_raw(path)
    doc["version"] = version
    bad = str(tmp_path / "bad.safetensors")
    write_raw(bad, doc, tensors)
    with pytest.raises(ConfigError, match="version .* not supported.*upgrade kvcompress"):
        KVCompressConfig.load(bad)


@pytest.mark.parametrize("keep", [0, 7, 100, "half", "all_but_one"])
def test_truncated_file_is_refused(saved, tmp_path, keep):
    path, _ = saved
    data = open(path, "rb").read()
    n = {"half": len(data) // 2, "all_but_one": len(data) - 1}.get(keep, keep)
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(data[:n])
    with pytest.raises(ConfigError, match="not a readable safetensors file.*truncated"):
        KVCompressConfig.load(bad)


def test_foreign_safetensors_file_is_refused(tmp_path):
    plain = str(tmp_path / "weights.safetensors")
    safetensors.torch.save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, plain)
    with pytest.raises(ConfigError, match="not a kvcompress config"):
        KVCompressConfig.load(plain)
    other_meta = str(tmp_path / "other.safetensors")
    safetensors.torch.save_file({"w": torch.zeros(2)}, other_meta, metadata={"format": "pt"})
    with pytest.raises(ConfigError, match="not a kvcompress config"):
        KVCompressConfig.load(other_meta)


class _Marker:
    """Unpickling this creates a file: proof that something was unpickled."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_non_safetensors_files_are_refused_without_unpickling(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a safetensors file\n")
    with pytest.raises(ConfigError, match="not a readable safetensors file"):
        KVCompressConfig.load(text)
    marker = tmp_path / "unpickled"
    for name, writer in [("pickle", pickle.dump), ("torch", torch.save)]:
        evil = tmp_path / f"{name}.safetensors"
        with open(evil, "wb") as f:
            writer({"kvcompress": _Marker(str(marker))}, f)
        with pytest.raises(ConfigError, match="not a readable safetensors file"):
            KVCompressConfig.load(evil)
        assert not marker.exists(), f"loading a {name} file unpickled it"
    with pytest.raises(ConfigError, match="no kvcompress config at"):
        KVCompressConfig.load(tmp_path / "missing.safetensors")
    # resolve_config only treats *.safetensors as a path; anything else is a preset name
    with pytest.raises(ConfigError, match="unknown preset"):
        CompressedCache(llama_config(), str(tmp_path / "kv.bin"))


def _tamper(doc, where, key, value):
    target = doc
    for part in where:
        target = target[part]
    target[key] = value


@pytest.mark.parametrize(
    "where, key",
    [
        ((), "extra"),
        (("layers", 0), "colour"),
        (("layers", 1, "key"), "bogus"),
        (("layers", 0, "sparsity"), "x"),
    ],
)
def test_unknown_fields_are_refused(saved, tmp_path, where, key):
    path, _ = saved
    doc, tensors = read_raw(path)
    _tamper(doc, where, key, 1)
    bad = str(tmp_path / "bad.safetensors")
    write_raw(bad, doc, tensors)
    with pytest.raises(ConfigError, match=rf"unknown field\(s\) \['{key}'\]"):
        KVCompressConfig.load(bad)


@pytest.mark.parametrize(
    "name",
    ["layers.0.key.evil", "layers.0.query.codebook", "layers.2.key.codebook", "model.embed_tokens.weight",
     "layers.x.key.codebook"],
)
def test_unexpected_tensor_keys_are_refused(saved, tmp_path, name):
    path, _ = saved
    doc, tensors = read_raw(path)
    tensors[name] = torch.zeros(3)
    bad = str(tmp_path / "bad.safetensors")
    write_raw(bad, doc, tensors)
    with pytest.raises(ConfigError, match=f"unexpected tensor '{name}'"):
        KVCompressConfig.load(bad)


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("fingerprint"),
        lambda d: d["fingerprint"].pop("layer_types"),
        lambda d: d["fingerprint"].update(num_layers="two"),
        lambda d: d.pop("layers"),
        lambda d: d.update(layers={"0": {}}),
        lambda d: d["layers"].pop(),
        lambda d: d["layers"][0].update(key="nuq"),
        lambda d: d["layers"][0]["key"].update(bits=5),
        lambda d: d["layers"][0]["key"].update(method="zip"),
        lambda d: d["layers"][0].update(page_size=0),
        lambda d: d["layers"][0].update(page_size="64"),
        lambda d: d["layers"][1]["value"].update(outlier_fraction="1%"),
        lambda d: d["layers"][0].pop("value"),
        lambda d: d.pop("name"),
        lambda d: d.update(format="other"),
    ],
    ids=[
        "no-fingerprint", "fingerprint-missing-field", "fingerprint-bad-type", "no-layers", "layers-not-list",
        "layer-count", "spec-not-object", "bad-bits", "bad-method", "bad-page-size", "page-size-type",
        "outlier-type", "no-value-spec", "no-name", "bad-format",
    ],
)
def test_malformed_metadata_is_a_config_error(saved, tmp_path, mutate):
    """Whatever is wrong in the metadata, the caller gets a ConfigError naming the file, not a KeyError."""
    path, _ = saved
    doc, tensors = read_raw(path)
    mutate(doc)
    bad = str(tmp_path / "bad.safetensors")
    write_raw(bad, doc, tensors)
    with pytest.raises(ConfigError) as e:
        KVCompressConfig.load(bad)
    assert str(e.value).strip()


def test_metadata_that_is_not_json_is_refused(tmp_path):
    bad = str(tmp_path / "bad.safetensors")
    safetensors.torch.save_file({}, bad, metadata={"kvcompress": "{not json"})
    with pytest.raises(ConfigError, match="not valid JSON"):
        KVCompressConfig.load(bad)


# -- no pickle, atomic save --------------------------------------------------------------------------------
def test_load_never_unpickles(saved, monkeypatch):
    path, cfg = saved

    def forbidden(*args, **kwargs):
        raise AssertionError("KVCompressConfig.load must not unpickle")

    for mod, name in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(mod, name, forbidden)
    assert KVCompressConfig.load(path) == cfg


def _failing_save_file(tensors, filename, metadata=None):
    with open(filename, "wb") as f:
        f.write(b"partial")
    raise OSError("disk full")


def test_failed_save_leaves_nothing_behind(tmp_path, monkeypatch):
    cfg = calibrated_nuq4(llama_config())
    monkeypatch.setattr(safetensors.torch, "save_file", _failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        cfg.save(tmp_path / "kv.safetensors")
    assert os.listdir(tmp_path) == [], "a failed save left files behind"


def test_failed_save_keeps_the_previous_file(saved, monkeypatch):
    path, cfg = saved
    before = open(path, "rb").read()
    other = KVCompressConfig.from_preset("fp8", llama_config())
    monkeypatch.setattr(safetensors.torch, "save_file", _failing_save_file)
    with pytest.raises(OSError):
        other.save(path)
    monkeypatch.undo()
    assert open(path, "rb").read() == before
    assert KVCompressConfig.load(path) == cfg
    assert os.listdir(os.path.dirname(path)) == ["kv.safetensors"]


def test_save_replaces_atomically_and_leaves_no_temporary(saved):
    path, _ = saved
    other = KVCompressConfig.from_preset("fp8", llama_config())
    other.save(path)
    assert KVCompressConfig.load(path) == other
    assert os.listdir(os.path.dirname(path)) == ["kv.safetensors"]


def test_an_option_the_method_ignores_is_refused():
    """nuq has no channel groups: a group_size there would be silently ignored, so it is refused."""
    from kvcompress.config import QuantSpec

    with pytest.raises(ConfigError, match="group_size does not apply to method='nuq'"):
        QuantSpec(method="nuq", bits=4, group_size=32)
    assert QuantSpec(method="int", bits=4, group_size=32).group_size == 32


@pytest.mark.parametrize("method, option", [("quest", dict(recent=32)), ("snapkv", dict(recent=16)),
                                            ("streaming", dict(recent=8)), ("quest", dict(sinks=4)),
                                            ("snapkv", dict(sinks=4)), ("h2o", dict(budget_sharing="heads"))])
def test_a_sparsity_option_the_policy_ignores_is_refused(method, option):
    """Quest never read `recent` or `sinks` (it always reads the first and the newest page), SnapKV neither,
    and only Quest shares budgets: a spec that sets them for another policy is refused with the fix, where it
    would have run as if they were unset."""
    from kvcompress.config import SparsitySpec

    name = next(iter(option))
    with pytest.raises(ConfigError, match=f"{name}.*not to '{method}'.*drop {name}="):
        SparsitySpec(method, ratio=0.5, **option)
    assert SparsitySpec("h2o", ratio=0.5, recent=32, sinks=4).recent == 32
    assert SparsitySpec("streaming", ratio=0.5, sinks=4).sinks == 4
    assert SparsitySpec("quest", ratio=0.5, budget_sharing="heads").budget_sharing == "heads"


# -- options and shapes a codec cannot take ------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, named", [
    (dict(method="int", bits=4, outlier_fraction=0.01), "outlier_fraction=0.01"),
    (dict(method="int", bits=4, rotation=True), "rotation=True"),
    (dict(method="fp8", group_size=32), "group_size=32"),
    (dict(method="int", bits=4, codebook="laplace"), "codebook='laplace'"),
])
def test_options_the_method_never_reads_are_refused(kwargs, named):
    with pytest.raises(ConfigError, match=f"{named}.*remove"):
        QuantSpec(**kwargs)


def test_int_keys_on_the_page_axis_are_coded_per_channel_within_each_page():
    """QuantSpec's docstring: for int, "page" means what "channel" does (it was coded per token)."""
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, H, 70, 16, generator=g) * torch.linspace(0.1, 8, 16)  # channels of very different ranges
    v = torch.randn(1, H, 70, 16, generator=g)
    held = {}
    for axis in ("page", "channel", "token"):
        policy = LayerPolicy(key=QuantSpec("int", bits=4, axis=axis), value=QuantSpec("int", bits=4, group_size=16),
                             page_size=16)
        layer = CompressedLayer(policy)
        layer.update(k, v)
        held[axis] = layer.dense()[0]
    assert torch.equal(held["page"], held["channel"])
    assert not torch.equal(held["page"], held["token"])


@pytest.mark.parametrize("preset", ["nuq3", "nuq2", "nuq4-rot", "nuq4-vrot"])
def test_a_rotated_preset_on_a_head_dim_that_is_no_power_of_two_is_refused_when_built(preset):
    """Head dim 96 (Phi-3's): a ConfigError naming the fix when the config is built, not an assertion at
    the first update."""
    with pytest.raises(ConfigError, match="power-of-two head dim.*96.*without rotation"):
        KVCompressConfig.from_preset(preset, llama_config(hidden_size=384, head_dim=96))


def test_int_presets_take_value_groups_that_divide_the_head_dim():
    """int4 on a head of 80 channels: value groups of 16 (32 does not divide 80), and the cache runs."""
    cfg = KVCompressConfig.from_preset("int4", llama_config(hidden_size=320, head_dim=80))
    assert cfg.layers[0].value.group_size == 16
    cache = CompressedCache(llama_config(hidden_size=320, head_dim=80), cfg)
    k = torch.randn(1, H, 40, 80)
    out_k, _ = cache.update(k, k.clone(), 0)
    assert out_k.shape == k.shape
    with pytest.raises(ConfigError, match="groups of 32 channels must divide the head dim 80"):
        KVCompressConfig(layout=cfg.layout, layers=[
            LayerPolicy(value=QuantSpec("int", bits=4, group_size=32)) for _ in cfg.layers])
