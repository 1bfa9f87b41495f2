"""Calibrated FP8 against dynamic per-token FP8, out of sample: attention error on SmolLM2-135M.

Takes a config from `kvcompress calibrate smollm2-135m --preset fp8` (fitted on the shipped calib.txt)
and runs N tokens of the shipped eval.txt through the model, recording each layer's post-RoPE queries,
keys and values. Keys and values are then quantized to E4M3 in three ways:
- dynamic: a scale per token and head, absmax / 448 (the fp8 preset);
- static: the config's engine scales ("fp8_scale": one per kv head, of the unshifted stream);
- static + shift: what the config's codec stores, x = fp8 * scale + shift (channel means as the shift).

For each, the SQNR of the logits q.k (keys alone), of the causal attention output with only the values
quantized, and of the output with both quantized. All layers; the first 4 tokens are left out, as the
fp8 presets keep them exact.

    python benchmarks/fp8_calibrated.py CONFIG [N]
"""
import importlib.resources as ir
import math
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvcompress
from kvcompress.config import KVCompressConfig

SINKS = 4
FMAX = 448.0


def e4m3(x, scale):
    return (x / scale).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).float() * scale


def dynamic(x, t, stream):
    return e4m3(x, (x.abs().amax(-1, keepdim=True) / FMAX).half().float())


def static(x, t, stream):
    return e4m3(x, t[f"{stream}.fp8_scale"].float().view(1, -1, 1, 1))


def shifted(x, t, stream):
    shift = t[f"{stream}.shift"].float()[None, :, None, :]
    return e4m3(x - shift, t[f"{stream}.scale"].float().view(1, -1, 1, 1)) + shift


WAYS = {"dynamic per token": dynamic, "static per head (engine scales)": static, "static + shift (the config)": shifted}


def main(path: str, n: int) -> None:
    torch.set_num_threads(1)
    cfg = KVCompressConfig.load(path)
    model, tok = kvcompress.load_model()
    text = (ir.files("kvcompress") / "data" / "eval.txt").read_text()
    ids = tok(text, return_tensors="pt").input_ids[:, :n]
    seen = []

    def record(module, query, key, value, attention_mask, **kw):
        seen.append((query.detach().float(), key.detach().float(), value.detach().float()))
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)

    AttentionInterface.register("record_qkv", record)
    model.set_attn_implementation("record_qkv")
    with torch.inference_mode():
        model(ids)

    def out(q, k, v, g, causal):
        s = q @ k.repeat_interleave(g, 1).transpose(2, 3)
        p = torch.softmax(torch.where(causal, s * q.shape[-1] ** -0.5, -math.inf), -1)
        return s, p, p @ v.repeat_interleave(g, 1)

    total = {"logits": 0.0, "out": 0.0}
    err = {(w, m): 0.0 for w in WAYS for m in ("logits", "values", "both")}
    for i, (q, k, v) in enumerate(seen):
        t = cfg.layers[i].tensors
        g = q.shape[1] // k.shape[1]
        q, k, v = q[:, :, SINKS:], k[:, :, SINKS:], v[:, :, SINKS:]
        causal = torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril()
        ref_s, ref_p, ref_o = out(q, k, v, g, causal)
        total["logits"] += float(ref_s.pow(2).sum())
        total["out"] += float(ref_o.pow(2).sum())
        for name, way in WAYS.items():
            kq, vq = way(k, t, "key"), way(v, t, "value")
            s, _, o = out(q, kq, vq, g, causal)
            err[(name, "logits")] += float((s - ref_s).pow(2).sum())
            err[(name, "values")] += float((ref_p @ vq.repeat_interleave(g, 1) - ref_o).pow(2).sum())
            err[(name, "both")] += float((o - ref_o).pow(2).sum())
    db = lambda num, e: 10 * math.log10(num / e)  # noqa: E731
    print(f"SmolLM2-135M, {n} tokens of eval.txt, {len(seen)} layers, E4M3; config {path}")
    print("| FP8 | logits q.k (keys) | output (values) | output (keys and values) |")
    print("|---|---|---|---|")
    for name in WAYS:
        print(f"| {name} | {db(total['logits'], err[(name, 'logits')]):.2f} dB | "
              f"{db(total['out'], err[(name, 'values')]):.2f} dB | {db(total['out'], err[(name, 'both')]):.2f} dB |")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 2048)
