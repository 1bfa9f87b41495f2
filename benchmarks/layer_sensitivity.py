"""Do calibration's per-layer sensitivities rank what each layer costs the model? SmolLM2-135M, CPU.

For every full-attention layer and stream (keys, values) this compresses only that stream of that layer
with a preset's codec (default nuq3: the mixed allocation's middle choice) and measures the KL divergence of
the model's next-token distributions from the uncompressed cache's, end to end: windows of eval.txt, the
first half prefilled, the rest fed in chunks of CHUNK tokens (a chunk attends to its own tokens exactly and
to the held ones as stored, as decoding does). It then computes, from the probe `kvcompress calibrate` uses
(calib.txt's first window, `collect` and `output_fisher`), three per-layer losses and reports how well each
ranks the end-to-end KL (Spearman over layer-streams, and the Pearson correlation of their logarithms):

  all stored      relative error of the attention output when every query reads every older token as
                  stored (the probe before decode masks);
  decode-masked   the same with each query reading the sinks and the tail of its own decode step exact
                  (sensitivity.decode_attention), the scored half only, without the Fisher;
  Fisher          what calibrate now uses (sensitivity.spec_sensitivity): the decode-masked error weighted
                  by the Fisher information of the attention output.

    OMP_NUM_THREADS=1 PYTHONPATH=. python benchmarks/layer_sensitivity.py [--preset nuq3] [--windows 2] \
        [--json OUT]
"""

from __future__ import annotations

import argparse
import importlib.resources
import json
import time
from dataclasses import replace

import torch

import kvcompress
from kvcompress.cache import CompressedCache
from kvcompress.calib.candidates import LayerFits
from kvcompress.calib.collect import CollectSettings, calibration_windows, collect
from kvcompress.calib.fisher import output_fisher
from kvcompress.calib.sensitivity import causal_attention, relative_error, spec_sensitivity, stored
from kvcompress.compat import with_cache
from kvcompress.config import KVCompressConfig, LayerPolicy, QuantSpec
from kvcompress.evaluation.perplexity import context_windows


def one_stream(policy: LayerPolicy, stream: str) -> LayerPolicy:
    """`policy` with the other stream exact."""
    exact = QuantSpec()
    return replace(policy, key=policy.key if stream == "key" else exact,
                   value=policy.value if stream == "value" else exact)


def end_to_end(model, config, windows, chunk: int):
    """Per window, the log-probabilities [N - N // 2, V] of the scored positions."""
    out = []
    for ids in windows:
        cache = CompressedCache(model.config, config)
        n = ids.shape[1]
        p = n // 2
        logits = [model(ids[:, :p], **with_cache(cache), logits_to_keep=1).logits[0, -1:]]
        for t in range(p, n - 1, chunk):
            logits.append(model(ids[:, t:min(t + chunk, n - 1)], **with_cache(cache)).logits[0])
        out.append(torch.cat(logits).double().log_softmax(-1))
    return out


def mean_kl(ref, got) -> float:
    return sum(float((r.exp() * (r - q)).sum(-1).mean()) for r, q in zip(ref, got)) / len(ref)


def ranks(x: torch.Tensor) -> torch.Tensor:
    return x.argsort().argsort().double()


def corr(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a - a.mean(), b - b.mean()
    return float((a * b).sum() / (a.norm() * b.norm()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nuq3")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--json")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    model, tok = kvcompress.load_model("smollm2-135m", dtype=torch.float32)
    preset = KVCompressConfig.from_preset(args.preset, model.config)
    calib = importlib.resources.files("kvcompress").joinpath("data/calib.txt").read_text()
    probe_window = calibration_windows(tok(calib, add_special_tokens=False)["input_ids"], 1, 1024)
    settings = CollectSettings(samples=1, seq_len=1024, batch_size=1, sample_tokens=64, weighting="none")
    stats = collect(model, probe_window, settings, progress=False)
    fisher = output_fisher(model, probe_window[:, :settings.probe_tokens])
    windows = context_windows(tok, args.context, args.windows)
    ref = end_to_end(model, KVCompressConfig.from_preset("none", model.config), windows, args.chunk)
    rows, start = {}, time.time()
    for i, policy in enumerate(preset.layers):
        s = stats[i]
        fits = LayerFits(replace(s, probe_fisher=fisher[i]))
        plain = LayerFits(s)
        for stream in ("key", "value"):
            spec = getattr(policy, stream)
            layers = [LayerPolicy() for _ in preset.layers]
            layers[i] = one_stream(policy, stream)
            cfg = KVCompressConfig(layout=preset.layout, layers=layers, name=f"{i}.{stream}")
            kl = mean_kl(ref, end_to_end(model, cfg, windows, args.chunk))
            k_hat, v_hat = stored(one_stream(policy, stream), s.probe_k, s.probe_v)
            want = causal_attention(s.probe_q, s.probe_k, s.probe_v, s.scaling)
            lossy = causal_attention(s.probe_q, k_hat.float(), v_hat.float(), s.scaling)
            all_stored = relative_error(lossy, want)
            rows[f"{i}.{stream}"] = {
                "kl": kl, "all stored": all_stored,
                "decode-masked": spec_sensitivity(plain, stream, spec, {}, like=policy),
                "Fisher": spec_sensitivity(fits, stream, spec, {}, like=policy),
            }
            print(i, stream, {k: f"{v:.3e}" for k, v in rows[f"{i}.{stream}"].items()},
                  f"{time.time() - start:.0f} s", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    kl = torch.tensor([r["kl"] for r in rows.values()], dtype=torch.float64)
    print(f"\n{args.preset} in one layer-stream at a time, {len(rows)} cases, "
          f"{args.windows} x {args.context} tokens")
    print("| loss | Spearman with end-to-end KL | Pearson of logs |\n|---|---|---|")
    for name in ("all stored", "decode-masked", "Fisher"):
        x = torch.tensor([r[name] for r in rows.values()], dtype=torch.float64)
        print(f"| {name} | {corr(ranks(kl), ranks(x)):.2f} | {corr(kl.log(), x.log()):.2f} |")


if __name__ == "__main__":
    main()
