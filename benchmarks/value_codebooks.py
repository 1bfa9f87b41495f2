"""nuq4 value codebooks with heavier tails than the Gaussian, with and without outliers (SmolLM2-135M,
eval.txt, the `kvcompress eval` protocol; deltas against the uncompressed 2048-token reference 22.5251).

    OMP_NUM_THREADS=1 python benchmarks/value_codebooks.py 2048 [OUT_DIR]
"""
import math
import sys
from dataclasses import replace

import torch

import kvcompress
from kvcompress import KVCompressConfig
from kvcompress.atomic import write_json
from kvcompress.evaluation import evaluate
from kvcompress.quant.codebook import _lloyd

torch.set_num_threads(1)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
OUT = sys.argv[2] if len(sys.argv) > 2 else "."


def lloyd_max(pdf, bits=4, lim=16.0):
    grid = torch.linspace(-lim, lim, 64001, dtype=torch.float64)
    w = pdf(grid)
    start = torch.linspace(-2.5, 2.5, 2 ** bits, dtype=torch.float64)
    return _lloyd(grid, w, start, 300).to(torch.float32)


b = 1 / math.sqrt(2)
laplace = lloyd_max(lambda x: torch.exp(-x.abs() / b))
nu = 5.0
s = math.sqrt((nu - 2) / nu)
t5 = lloyd_max(lambda x: (1 + (x / s) ** 2 / nu) ** (-(nu + 1) / 2))
print("laplace", laplace.tolist())
print("t5", t5.tolist())
model, tok = kvcompress.load_model()
base = KVCompressConfig.from_preset("nuq4", model.config)
paths = []
for name, cb, kf, vf in (("lap-k1-v0", laplace, 0.01, 0.0), ("t5-k1-v0", t5, 0.01, 0.0),
                         ("lap-k0-v1", laplace, 0.0, 0.01), ("lap-k0-v0", laplace, 0.0, 0.0)):
    layers = []
    for p in base.layers:
        tensors = dict(p.tensors)
        tensors["value.codebook"] = cb.clone()
        layers.append(replace(p, key=replace(p.key, outlier_fraction=kf), value=replace(p.value, outlier_fraction=vf),
                              tensors=tensors))
    cfg = replace(base, layers=layers, name=name)
    path = f"{OUT}/{name}.safetensors"
    cfg.save(path)
    paths.append(path)
rows = evaluate(model, tok, configs=paths, context=ctx, passkey=False, progress=False, include_uncompressed=False)
for r in rows:
    print(r["name"], r["ppl"], r.get("bits_per_element"), flush=True)
write_json(f"{OUT}/value_codebooks_{ctx}.json", rows)
