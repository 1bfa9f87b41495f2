"""What a value codec costs attention, layer by layer, on SmolLM2-135M's own activations (CPU).

One forward of the uncompressed model over a window of eval.txt (and a passkey prompt) records every
layer's queries (the calibration's scoped recorder, `record_queries`; the last NQ positions are scored) and
its keys and values (the DynamicCache it filled).
Each value variant then codes the layer's body (the tokens after 4 sinks and before a 16-token tail, the
nuq4 preset's exact parts) and attention is re-run with the exact keys and softmax weights: the output's
error energy over its energy is the codec's cost to attention, per layer, with nothing compounding through
later layers. Perplexity deltas of one window scatter by +-0.6 % on this model, and one passkey trial's
answer log-probability moves by half a nat when only the rounding of an offset changes, so neither
separates value codecs of the same bits; this does.

Variants (4-bit codes, per-token FP8 e5m2 scales, as the nuq4 preset; "per-channel bias" is the rms over
channels of the mean error over tokens, relative to the rms error, 1/sqrt(tokens) for independent errors):
  nuq4          the nuq4 preset's values: Student-t levels on each token's rms;
  rotated       randomized Hadamard rotation onto Gaussian levels (as the nuq3 / nuq2 presets hold values);
  centred       each channel's mean over the body subtracted before coding, added back after;
  centred-token the same where it lowers the token's rms, per token (a one-bit choice per token);
  fp8           FP8 e4m3 with a per-token scale (the fp8 preset's values);
  --config F    a saved config's values, with its calibrated levels per layer (`kvcompress calibrate`).

    OMP_NUM_THREADS=1 python benchmarks/value_attention_error.py [--length 4096] [--dtype bfloat16]
        [--config FILE ...]
"""

from __future__ import annotations

import argparse
import math
from dataclasses import replace

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress.calib.collect import record_queries
from kvcompress.calib.sensitivity import relative_error
from kvcompress.compat import with_cache
from kvcompress.config import KVCompressConfig, QuantSpec
from kvcompress.evaluation.passkey import passkey_key, passkey_prompt
from kvcompress.evaluation.perplexity import context_ids
from kvcompress.quant.factory import make_codec

NQ = 64  # query positions scored per layer: the window's last ones, which see the whole body
SINKS, TAIL, PAGE = 4, 16, 32  # the nuq4 preset's exact parts and page size


def record(model, ids) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, float]]:
    """Per layer: queries of the last NQ positions [1, Hq, NQ, D], keys and values [1, H, T, D] (float32), and
    the attention scaling, from one uncompressed forward over ids [1, T]."""
    queries, cache = {}, DynamicCache(config=model.config)
    sink = lambda i, q, k, s: queries.__setitem__(i, (q[:, :, -NQ:].float(), s))  # noqa: E731
    with record_queries(model, sink), torch.inference_mode():
        model(ids, **with_cache(cache))
    return [(queries[i][0], layer.keys.float(), layer.values.float(), queries[i][1])
            for i, layer in enumerate(cache.layers)]


def variants(model_config, config_files=()) -> dict[str, tuple[QuantSpec, list[dict]]]:
    """name -> (value spec, calibrated value tensors per layer: empty dicts but for config files)."""
    n = model_config.num_hidden_layers
    nuq4 = KVCompressConfig.from_preset("nuq4", model_config).layers[0].value
    out = {name: (spec, [{}] * n) for name, spec in (
        ("nuq4", nuq4), ("rotated", replace(nuq4, rotation=True, codebook="gaussian")), ("centred", nuq4),
        ("centred-token", nuq4), ("fp8", QuantSpec(method="fp8")))}
    for path in config_files:  # e.g. `kvcompress calibrate --preset nuq4`: its value levels fitted per layer
        cfg = KVCompressConfig.load(path)
        out[cfg.name] = (cfg.layers[0].value, [p.stream_tensors("value") for p in cfg.layers])
    return out


def coded(name: str, spec: QuantSpec, tensors: dict, body: torch.Tensor, seed: int) -> torch.Tensor:
    """body [1, H, N, D] (model dtype) -> its decoded copy, float32, as variant `name` codes it."""
    codec = make_codec(spec, page_size=PAGE, head_dim=body.shape[-1], num_heads=body.shape[1],
                       dtype=body.dtype, tensors=tensors, seed=seed)
    x = body.float()
    shift = torch.zeros_like(x[:, :, :1])
    if name.startswith("centred"):
        shift = x.mean(2, keepdim=True)
        if name == "centred-token":  # centred only where that lowers the token's rms
            lower = (x - shift).pow(2).mean(-1, keepdim=True) < x.pow(2).mean(-1, keepdim=True)
            shift = shift * lower
    row = codec.prepare(x - shift)
    return codec.decode(codec.encode(x - shift, row), row, torch.float32) + shift


def layer_errors(model_config, records, dtype, config_files=()) -> dict[str, list[tuple[float, float]]]:
    """Per variant and layer: (attention output error energy / output energy, per-channel bias); the body is
    coded from its `dtype` copy, as the model hands it over."""
    out: dict[str, list[tuple[float, float]]] = {}
    specs = variants(model_config, config_files)
    for li, (q, k, v, scaling) in enumerate(records):
        t = k.shape[2]
        n = (t - SINKS - TAIL) // PAGE * PAGE
        g = q.shape[1] // k.shape[1]
        s = q @ k.repeat_interleave(g, 1).transpose(-1, -2) * scaling
        future = torch.arange(t)[None, :] > torch.arange(t - NQ, t)[:, None]
        p = s.masked_fill(future, float("-inf")).softmax(-1)
        want = p @ v.repeat_interleave(g, 1)
        body = v[:, :, SINKS:SINKS + n].to(dtype)
        for name, (spec, tensors) in specs.items():
            vh = coded(name, spec, tensors[li], body, seed=2 * li + 1)  # a CompressedLayer's value seed
            e = vh - body.float()
            bias = float(e.mean(2).pow(2).mean().sqrt() / e.pow(2).mean().sqrt())
            vq = torch.cat([v[:, :, :SINKS], vh, v[:, :, SINKS + n:]], 2)
            got = p @ vq.repeat_interleave(g, 1)
            out.setdefault(name, []).append((relative_error(got, want), bias))
    return out


def db(ratio: float) -> float:
    return 10 * math.log10(1 / ratio)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--config", action="append", default=[],
                    help="also a saved config's value codec (repeatable)")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    model, tok = kvcompress.load_model("smollm2-135m", dtype=dtype)
    texts = {"eval.txt": context_ids(tok, args.length),
             "passkey": passkey_prompt(tok, args.length, 0.5, passkey_key(args.length, 0.5, 0))}
    for text, ids in texts.items():
        records = record(model, ids)
        errs = layer_errors(model.config, records, dtype, args.config)
        print(f"\n{text}, {ids.shape[1]} tokens, {args.dtype}: attention output SNR (dB, of the relative "
              f"error energy averaged over the {len(records)} layers) and per-channel bias (mean over "
              "layers)")
        print("| variant | SNR | bias | per layer vs nuq4 (dB, layers 0..29) |")
        print("|---|---|---|---|")
        base = errs["nuq4"]
        for name, e in errs.items():
            snr = db(sum(r for r, _ in e) / len(e))
            bias = sum(b for _, b in e) / len(e)
            gains = " ".join(f"{db(r) - db(r0):+.1f}" for (r, _), (r0, _) in zip(e, base))
            print(f"| {name} | {snr:.2f} | {bias:.3f} | {gains} |")


if __name__ == "__main__":
    main()
