"""nuq4 with and without key / value outliers (SmolLM2-135M, eval.txt, the `kvcompress eval` protocol): what
the fused kernel's outlier corrections buy in quality.

    OMP_NUM_THREADS=1 python benchmarks/outlier_ablation.py 2048 [OUT_DIR]
"""
import sys
from dataclasses import replace

import torch

import kvcompress
from kvcompress import KVCompressConfig
from kvcompress.atomic import write_json
from kvcompress.evaluation import evaluate

torch.set_num_threads(1)
ctx = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
OUT = sys.argv[2] if len(sys.argv) > 2 else "."
model, tok = kvcompress.load_model()
base = KVCompressConfig.from_preset("nuq4", model.config)
paths = []
for name, kf, vf in (("nuq4-kout", 0.01, 0.0), ("nuq4-vout", 0.0, 0.01), ("nuq4-noout", 0.0, 0.0)):
    layers = [replace(p, key=replace(p.key, outlier_fraction=kf), value=replace(p.value, outlier_fraction=vf))
              for p in base.layers]
    cfg = replace(base, layers=layers, name=name)
    path = f"{OUT}/{name}.safetensors"
    cfg.save(path)
    paths.append(path)
rows = evaluate(model, tok, presets=["nuq4"], configs=paths, context=ctx, passkey=False, progress=False)
for r in rows:
    print(r["name"], r["ppl"], r.get("delta_pct"), r.get("bits_per_element"), flush=True)
write_json(f"{OUT}/outlier_ablation_{ctx}.json", [{k: v for k, v in r.items() if k != "passkey_trials"} for r in rows])
