"""Perplexity of hand-written layer policies (the search that chose the nuq/fp8 presets).

    python benchmarks/policy_ppl.py 1024 CANDIDATES.py

CANDIDATES.py is a Python file defining CANDIDATES = {name: LayerPolicy(...)}, with `LayerPolicy` and `Q`
(QuantSpec) already in scope, e.g. CANDIDATES = {"fp8-s4-r32": LayerPolicy(key=Q(method="fp8"),
value=Q(method="fp8"), page_size=16, sinks=4, residual=32)}. Every layer gets the same policy. Protocol as `kvcompress eval`: the first N tokens of the
shipped eval.txt, prefill N/2, decode the rest one token at a time, perplexity over the decoded half.
"""

import runpy
import sys
import time

import torch
from transformers import DynamicCache

import kvcompress
from kvcompress import CompressedCache, KVCompressConfig, LayerPolicy, QuantSpec
from kvcompress.evaluation.perplexity import context_ids, perplexity


def main(n: int, path: str) -> None:
    torch.set_num_threads(1)
    model, tok = kvcompress.load_model()
    ids = context_ids(tok, n)
    candidates = runpy.run_path(path, init_globals={"LayerPolicy": LayerPolicy, "Q": QuantSpec})["CANDIDATES"]
    base = perplexity(model, tok, lambda: DynamicCache(config=model.config), ids).ppl
    print(f"uncompressed ppl {base:.4f}", flush=True)
    layout = KVCompressConfig.from_preset("none", model.config).layout
    for name, policy in candidates.items():
        t = time.time()
        cfg = KVCompressConfig(layout=layout, layers=[policy] * layout.num_layers, name=name)
        r = perplexity(model, tok, lambda: CompressedCache(model.config, cfg), ids)
        print(f"{name:20s} ppl {r.ppl:.4f} delta {100 * (r.ppl / base - 1):+.3f}% "
              f"bits {r.memory['bits_per_element']:.3f} ({time.time() - t:.0f} s)", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
