"""Run every cache on the same text and collect one row per cache: the engine behind `kvcompress eval`.

    rows = evaluate(model, tokenizer, presets=["fp8", "nuq4"], context=2048)

The uncompressed reference is transformers' `DynamicCache`; every other row's perplexity change is
relative to it, and so are its KL divergence and top-1 agreement (divergence.py), from the reference's
recorded distributions. A row is a flat dict (JSON-ready); see `ROW_KEYS`.
"""

from __future__ import annotations

import math
import os
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from kvcompress.evaluation.baselines import (
    BaselineUnavailable,
    baseline_factory,
    parse_baselines,
    tensor_memory,
)
from kvcompress.evaluation.divergence import ReferenceLogprobs
from kvcompress.evaluation.passkey import passkey_accuracy
from kvcompress.evaluation.perplexity import context_windows, perplexity
from kvcompress.evaluation.progress import progress_display
from kvcompress.integration import enabled as kvcompress_enabled

UNCOMPRESSED = "uncompressed"
ROW_KEYS = (
    "name", "kind", "context", "ppl", "nll", "ppl_delta_pct", "kl_divergence", "top1_agreement", "n_tokens",
    "passkey", "passkey_logprob",
    "passkey_trials",
    "held_bytes", "uncompressed_bytes", "compression_ratio", "bits_per_element", "tokens_held",
    "tokens_read", "bytes_read", "read_share", "ms_per_token",
)


@dataclass
class CacheEntry:
    """One cache to evaluate: a row name, its kind (uncompressed | preset | config | baseline), a factory."""

    name: str
    kind: str
    factory: Callable[[], object]
    needs_attention: bool = False  # run it under `kvcompress.enabled(model)` (H2O, SnapKV, Quest)


def cache_entries(model, presets=(), configs=(), baselines="", include_uncompressed=True, log=print):
    """The caches to run, in order: uncompressed, presets, config files, baselines that can be built.

    A baseline whose backend is not installed is left out with a note (naming the pip command) sent to `log`.
    """
    from transformers import DynamicCache

    from kvcompress.cache import CompressedCache
    from kvcompress.config import KVCompressConfig

    cfg = model.config
    entries = []
    if include_uncompressed:
        entries.append(CacheEntry(UNCOMPRESSED, "uncompressed", lambda: DynamicCache(config=cfg)))
    for name in presets:
        cache = CompressedCache(cfg, name)  # fail early on an unknown preset
        entries.append(CacheEntry(name, "preset", lambda name=name: CompressedCache(cfg, name),
                                  cache.kv_config.needs_attention))
    for path in configs:
        kv = KVCompressConfig.load(path)
        CompressedCache(cfg, kv)  # fail early on a config made for another model
        label = f"{kv.name} ({os.path.basename(path)})"
        entries.append(CacheEntry(label, "config", lambda kv=kv: CompressedCache(cfg, kv), kv.needs_attention))
    specs = parse_baselines(baselines) if isinstance(baselines, str) else list(baselines)
    for spec in specs:
        try:
            entries.append(CacheEntry(spec.name, "baseline", baseline_factory(spec, cfg)))
        except BaselineUnavailable as e:
            log(f"skipped {spec.name}: {e}")
    return entries


def evaluate(
    model,
    tokenizer,
    presets: Sequence[str] = (),
    configs: Sequence[str] = (),
    *,
    baselines: str | Sequence = "",
    context: int = 2048,
    text: str | None = None,
    passkey: bool = True,
    passkey_lengths: Sequence[int] = (1024, 2048),
    passkey_depths: Sequence[float] = (0.1, 0.5, 0.9),
    passkey_seeds: Sequence[int] = (0,),
    passkey_template: str = "plain",
    include_uncompressed: bool = True,
    windows: int = 1,
    progress: bool = True,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Evaluate the uncompressed cache and each preset / config file / baseline; one row each.

    Args:
        model, tokenizer: an already loaded causal LM (e.g. `kvcompress.load_model(...)`).
        presets: preset names ("fp8", "nuq4", ...). configs: paths of saved `.safetensors` configs.
        baselines: "quanto,hqq" (transformers' QuantizedCache at int4 and int2) or BaselineSpec list.
        context: tokens of `text` (default: the shipped eval text) used for perplexity, see `perplexity`.
        passkey: also run passkey retrieval at `passkey_lengths` x `passkey_depths` x `passkey_seeds`.
        include_uncompressed: run the DynamicCache reference row (deltas are relative to it).
        windows: score that many disjoint consecutive windows of `context` tokens; a row's ppl is over all
            their scored tokens, its delta the mean of the per-window deltas (with their min and max).
        log: receives notes (skipped baselines).
    Returns: rows (dicts with ROW_KEYS), in run order, deltas filled in when the reference ran.
    """
    ids = context_windows(tokenizer, context, windows, text)
    entries = cache_entries(model, presets, configs, baselines, include_uncompressed, log)
    n_steps = len(entries) * windows * (context - context // 2 - 1)
    n_trials = len(entries) * len(passkey_lengths) * len(passkey_depths) * len(passkey_seeds) if passkey else 0
    rows, references = [], None
    with progress_display(progress) as bar:
        task = bar.add_task("evaluating", total=n_steps + n_trials) if bar else None
        advance = (lambda: bar.advance(task)) if bar else None
        for entry in entries:
            scope = kvcompress_enabled(model) if entry.needs_attention else nullcontext()
            with scope:
                if bar:
                    bar.update(task, description=f"{entry.name}: perplexity")
                if entry.kind == "uncompressed":  # the reference whose distributions the others are held to
                    references = [ReferenceLogprobs() for _ in ids]
                    row = perplexity_row(model, tokenizer, entry, ids, on_step=advance, record=references)
                else:
                    row = perplexity_row(model, tokenizer, entry, ids, on_step=advance, reference=references)
                if passkey:
                    if bar:
                        bar.update(task, description=f"{entry.name}: passkey")
                    pk = passkey_accuracy(
                        model, tokenizer, entry.factory, passkey_lengths, passkey_depths, passkey_seeds,
                        template=passkey_template, on_trial=advance,
                    )
            if passkey:
                row["passkey"] = pk.accuracy
                row["passkey_logprob"] = pk.mean_answer_logprob
                row["passkey_trials"] = [
                    {"length": t.length, "depth": t.depth, "seed": t.seed, "key": t.key, "output": t.output,
                     "found": t.found, "answer_logprob": t.answer_logprob} for t in pk.trials
                ]
            rows.append(row)
    return add_deltas(rows)


def perplexity_row(model, tokenizer, entry: CacheEntry, ids, on_step=None,
                   record: list[ReferenceLogprobs] | None = None,
                   reference: list[ReferenceLogprobs] | None = None) -> dict:
    """One row from perplexity runs over the windows `ids` (a [1, N] tensor or a list of them): quality
    over all their scored tokens, per-window perplexities, memory at the end of the last, decode time.
    record: one ReferenceLogprobs per window to fill (the row is then the reference: KL 0, top-1 1);
    reference: the recordings to hold this row's distributions to (KL divergence, top-1 agreement)."""
    windows = [ids] if isinstance(ids, torch.Tensor) else list(ids)
    runs = [
        perplexity(model, tokenizer, entry.factory, w, on_step=on_step,
                   record=record[i] if record is not None else None,
                   reference=reference[i] if reference is not None else None)
        for i, w in enumerate(windows)
    ]
    res = runs[-1]
    n_tokens = sum(r.n_tokens for r in runs)
    nll = sum(r.nll * r.n_tokens for r in runs) / n_tokens
    kl = top1 = kl_windows = None
    if record is not None:
        kl, top1, kl_windows = 0.0, 1.0, [0.0] * len(runs)
    elif reference is not None:
        kl = sum(r.kl * r.n_tokens for r in runs) / n_tokens
        top1 = sum(r.top1 * r.n_tokens for r in runs) / n_tokens
        kl_windows = [r.kl for r in runs]
    memory = res.memory if res.memory is not None else tensor_memory(res.cache, model.config)
    memory = memory or {}
    held = memory.get("tokens_held")
    # a cache without the method (DynamicCache, baselines) reads everything it holds each step
    read_bytes = res.bytes_read if res.bytes_read is not None else memory.get("held_bytes")
    return {
        "name": entry.name,
        "kind": entry.kind,
        "context": int(windows[0].shape[1]),
        "windows": len(windows),
        "ppl": math.exp(nll),
        "nll": nll,
        "ppl_windows": [r.ppl for r in runs],
        "ppl_delta_pct": None,
        "ppl_delta_pct_windows": None,
        "kl_divergence": kl,
        "kl_divergence_windows": kl_windows,
        "top1_agreement": top1,
        "n_tokens": n_tokens,
        "passkey": None,
        "passkey_logprob": None,
        "passkey_trials": [],
        "held_bytes": memory.get("held_bytes"),
        "uncompressed_bytes": memory.get("uncompressed_bytes"),
        "compression_ratio": memory.get("compression_ratio"),
        "bits_per_element": memory.get("bits_per_element"),
        "tokens_held": held,
        "tokens_read": res.tokens_read if res.tokens_read is not None else held,
        "bytes_read": read_bytes,
        "read_share": read_bytes / memory["uncompressed_bytes"] if read_bytes and memory.get("uncompressed_bytes")
        else None,
        "ms_per_token": 1000.0 * res.seconds_per_step,
    }


def add_deltas(rows: list[dict]) -> list[dict]:
    """Fill `ppl_delta_pct` (100 * (ppl / ppl_uncompressed - 1)) when an uncompressed row is present."""
    ref = next((r for r in rows if r["kind"] == "uncompressed"), None)
    if ref is None or not math.isfinite(ref["ppl"]):
        return rows
    for r in rows:
        per = r.get("ppl_windows") or [r["ppl"]]
        ref_per = ref.get("ppl_windows") or [ref["ppl"]]
        if len(per) == len(ref_per) and len(per) > 1:
            r["ppl_delta_pct_windows"] = [100.0 * (a / b - 1.0) for a, b in zip(per, ref_per)]
            r["ppl_delta_pct"] = sum(r["ppl_delta_pct_windows"]) / len(per)
        else:
            r["ppl_delta_pct"] = 100.0 * (r["ppl"] / ref["ppl"] - 1.0)
    return rows
