"""Why static FP8 scales lose to dynamic per-token ones: attention-logit error of FP8 keys on SmolLM2-135M.

Runs N tokens of kvcompress/data/eval.txt through the model with an attention function that records
each layer's post-RoPE queries and keys, then quantizes the keys to E4M3 three ways and compares the
logits q.k with the exact ones (SQNR in dB, all layers, sinks excluded as the fp8 preset keeps them):
- dynamic: a scale per token and head, absmax / 448 (the fp8 preset), so each token's largest element
  lands exactly on the grid's top value;
- dynamic, offset: the same scale times 1.0437, so that element no longer lands on a grid point;
- static: one scale per (layer, kv head), twice the absmax over the text / 448 (an engine's static scale);
- static, shifted: the keys' channel means over the text removed first (and added back), then static
  scales of what is left (what `calibrate --preset fp8` gives; benchmarks/fp8_calibrated.py measures it
  out of sample).

    python benchmarks/fp8_scales.py [N]
"""
import importlib.resources as ir
import math
import sys

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import kvcompress

N = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
SINKS = 4
FMAX = 448.0
torch.set_num_threads(1)
model, tok = kvcompress.load_model()
model.eval()
text = (ir.files("kvcompress") / "data" / "eval.txt").read_text()
ids = tok(text, return_tensors="pt").input_ids[:, :N]

seen = []


def record(module, query, key, value, attention_mask, **kw):
    """sdpa, keeping this layer's queries [B, Hq, N, D] and keys [B, Hkv, N, D] (post-RoPE)."""
    seen.append((query.detach().float(), key.detach().float()))
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kw)


AttentionInterface.register("record_qk", record)
model.set_attn_implementation("record_qk")
with torch.inference_mode():
    model(ids)


def e4m3(x, scale):
    return (x / scale).clamp(-FMAX, FMAX).to(torch.float8_e4m3fn).float() * scale


err = {"dynamic": 0.0, "dynamic, offset": 0.0, "static": 0.0, "static, shifted": 0.0}
total = 0.0
for q, k in seen:
    g = q.shape[1] // k.shape[1]
    k = k[:, :, SINKS:]
    q = q[:, :, SINKS:]
    amax = k.abs().amax(-1, keepdim=True)
    mean = k.mean(2, keepdim=True)
    scales = {
        "dynamic": (amax / FMAX).half().float(),
        "dynamic, offset": (amax / FMAX).half().float() * 1.0437,
        "static": 2 * k.abs().amax((2, 3), keepdim=True) / FMAX,
        "static, shifted": 2 * (k - mean).abs().amax((2, 3), keepdim=True) / FMAX,
    }
    ref = q @ k.repeat_interleave(g, 1).transpose(2, 3)
    total += float(ref.pow(2).sum())
    for name, s in scales.items():
        kq = (e4m3(k - mean, s) + mean if name == "static, shifted" else e4m3(k, s)).repeat_interleave(g, 1)
        err[name] += float((q @ kq.transpose(2, 3) - ref).pow(2).sum())
print(f"SmolLM2-135M, {N} tokens of eval.txt, {len(seen)} layers: SQNR of the attention logits q.k with E4M3 keys")
for name, e in err.items():
    print(f"  {name:16s} {10 * math.log10(total / e):6.2f} dB")
