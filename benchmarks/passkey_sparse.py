"""Passkey retrieval with the sparse policies at 2K / 4K / 6K tokens, needle at 10 / 50 / 90 % depth
(SmolLM2-135M, plain template, greedy 8 tokens). Budgets: a quarter of the context.

    python benchmarks/passkey_sparse.py 2048,4096,6144 uncompressed,quest-25%,h2o-25%,streaming-25% [OUT_JSON]

A name that is not one of those four is taken as a preset (quest-25, nuq4+quest-1024, ...).
"""
import sys

import torch

import kvcompress
from kvcompress import CompressedCache, KVCompressConfig, LayerPolicy, ModelLayout, SparsitySpec
from kvcompress.atomic import write_json
from kvcompress.evaluation.passkey import passkey_accuracy

torch.set_num_threads(1)
lengths = tuple(int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "2048,4096,6144").split(","))
model, tok = kvcompress.load_model()
layout = ModelLayout.from_model_config(model.config)


def config(name, spec):
    return KVCompressConfig(layout=layout, layers=[LayerPolicy(sparsity=spec) for _ in range(layout.num_layers)],
                            name=name)


CACHES = {
    "uncompressed": None,
    "quest-25%": config("quest-25%", SparsitySpec("quest", ratio=0.25, page_size=8, dense_layers=2)),
    "h2o-25%": config("h2o-25%", SparsitySpec("h2o", ratio=0.25, page_size=16)),
    "streaming-25%": config("streaming-25%", SparsitySpec("streaming", ratio=0.25, sinks=4, page_size=16)),
}
only = sys.argv[2].split(",") if len(sys.argv) > 2 else list(CACHES)
out_json = sys.argv[3] if len(sys.argv) > 3 else "passkey_sparse.json"
out = {}
for name in only:
    cfg = CACHES[name] if name in CACHES else KVCompressConfig.from_preset(name, layout)
    if cfg is None:
        from transformers import DynamicCache
        factory = DynamicCache
    else:
        factory = lambda cfg=cfg: CompressedCache(model.config, cfg)  # noqa: E731
    with torch.no_grad(), kvcompress.enabled(model):
        if cfg is None:
            kvcompress.disable(model)
        res = passkey_accuracy(model, tok, factory, lengths=lengths, depths=(0.1, 0.5, 0.9))
    out[name] = [(t.length, t.depth, t.found, t.output) for t in res.trials]
    print(name, res.accuracy, [(t.length, t.depth, t.found) for t in res.trials], flush=True)
    write_json(out_json, out)
