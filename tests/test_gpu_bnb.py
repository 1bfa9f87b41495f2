"""bitsandbytes on a CUDA GPU (skipped without one, or without bitsandbytes: CI has neither).

What is proved, on the GPU:
- the "bnb-nf4" / "bnb-fp4" codec runs on CUDA tensors through bitsandbytes' CUDA kernels; its CPU path
  decodes the CUDA codes to exactly the same values (one format on both devices), and the CUDA
  encoder's round trip is as accurate as the CPU encoder's (the two may round some values differently);
- a tiny Llama on the GPU generates through `CompressedCache(config, "bnb-nf4")` at 4.5 bits/element;
- `kvcompress eval MODEL --load-in-4bit` / `--load-in-8bit` and `kvcompress calibrate ... --load-in-4bit`
  load a local checkpoint's weights through bitsandbytes (the linear layers really are Linear4bit /
  Linear8bitLt) and run to the end with compressed caches.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from click.testing import CliRunner

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None,
                       reason='needs pip install "kvcompress[bnb]"'),
]


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bnb_codec_on_cuda_decodes_like_the_cpu_path(quant_type):
    from test_bnb import bnb_codec

    from quant_data import heavy_keys, sqnr_db

    codec = bnb_codec(quant_type, 64, 64, num_heads=2, page_size=64)
    x = heavy_keys((1, 2, 64, 64), seed=3)
    fc = codec.encode(x.cuda(), {})
    assert fc["codes"].is_cuda and fc["codes"].dtype == torch.uint8
    dec_cuda = codec.decode(fc, {}, torch.float32)
    dec_cpu = codec.decode({k: v.cpu() for k, v in fc.items()}, {}, torch.float32)
    assert dec_cuda.is_cuda
    torch.testing.assert_close(dec_cuda.cpu(), dec_cpu, rtol=1e-6, atol=0)  # one format on both devices
    f = codec.encode(x, {})
    same = (fc["codes"].cpu() == f["codes"]).float().mean().item()
    print(f"{quant_type}: codes equal to the CPU encoder's for {same:.4f} of the bytes")
    assert sqnr_db(x, dec_cuda.cpu()) > sqnr_db(x, codec.decode(f, {}, torch.float32)) - 0.1


def test_tiny_llama_generates_on_cuda_with_bnb_nf4(tiny_model):
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache

    model = tiny_model("llama", num_hidden_layers=2, head_dim=64).cuda()
    ids = torch.randint(5, 200, (2, 100), device="cuda")
    cache = CompressedCache(model.config, "bnb-nf4")
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=29, min_new_tokens=29,
                             do_sample=False, **with_cache(cache))
    assert out.shape == (2, 129)
    layer = cache.layers[0]
    assert layer.key_store.n_tokens == 128 and all(t.is_cuda for t in layer.key_store.data.values())
    assert cache.memory_report()["bits_per_element"] == 4.5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny random Llama (head dim 64) saved with a word-level tokenizer built here (no download)."""
    from conftest import make_tiny_model
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from kvcompress.evaluation.perplexity import default_eval_text

    words = sorted(set(default_eval_text().split()))[:250]
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{w: i + 3 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    model = make_tiny_model("llama", num_hidden_layers=2, head_dim=64, hidden_size=256, vocab_size=len(vocab),
                            pad_token_id=2, bos_token_id=1, eos_token_id=2)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(folder)
    fast.save_pretrained(folder)
    return str(folder)


@pytest.mark.parametrize("flag,layer_class",
                         [("--load-in-4bit", "Linear4bit"), ("--load-in-8bit", "Linear8bitLt")])
def test_eval_loads_weights_in_4_and_8_bits(checkpoint, flag, layer_class, tmp_path, monkeypatch):
    import kvcompress.cli_common as common
    from kvcompress.cli import main

    loaded = []
    real = common.load_model_or_exit

    def spy(*a, **k):
        model, tok = real(*a, **k)
        loaded.append(model)
        return model, tok

    monkeypatch.setattr("kvcompress.cli_eval.load_model_or_exit", spy)
    out_json = tmp_path / "rows.json"
    args = ["eval", checkpoint, flag, "-p", "bnb-nf4", "-p", "nuq4", "-p", "fp8", "--context", "256",
            "--no-passkey", "--no-progress", "--json", str(out_json)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    model = loaded[0]
    names = {type(m).__name__ for m in model.modules()}
    assert layer_class in names, names
    assert next(model.parameters()).is_cuda
    rows = json.loads(out_json.read_text())
    rows = rows["rows"] if isinstance(rows, dict) else rows
    assert len(rows) == 4  # the uncompressed cache and three presets
    for row in rows:
        ppl = row.get("ppl", row.get("perplexity"))
        assert ppl is not None and ppl == ppl and ppl < 1e6, row


def test_calibrate_loads_weights_in_4_bits(checkpoint, tmp_path):
    from kvcompress.cli import main

    out = tmp_path / "cal.safetensors"
    args = ["calibrate", checkpoint, "--load-in-4bit", "--out", str(out), "--samples", "2",
            "--seq-len", "128", "--device", "cuda", "--no-progress"]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert out.exists() and out.stat().st_size > 0
