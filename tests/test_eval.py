"""`kvcompress eval` and kvcompress.evaluation on the real SmolLM2-135M (short contexts).

What these prove: the CLI runs end to end and writes its rows; the uncompressed perplexity on the
shipped text is plausible; each row's KL divergence from the reference is the KL of the bucketed
distributions, 0 for a second uncompressed run and a close lower bound of the full-vocabulary KL for a
lossy cache; the lossless preset is token-identical to DynamicCache (delta exactly 0);
a text too short for the context fails with a message naming its token count; passkey retrieval
finds the key through an uncompressed cache on a short prompt; the progress reaches a log that is not
a terminal (where rich draws nothing).
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from click.testing import CliRunner
from transformers import DynamicCache

from kvcompress.cache import CompressedCache
from kvcompress.cli import main
from kvcompress.evaluation import TextTooShortError, context_ids, passkey_accuracy, perplexity
from kvcompress.evaluation.runner import add_deltas


@pytest.fixture
def cli_uses_loaded_model(smollm2, monkeypatch):
    """The CLI gets the session's already loaded model instead of loading it again."""
    import kvcompress.models

    monkeypatch.setattr(kvcompress.models, "load_model", lambda name, device=None: smollm2)


def test_cli_eval_end_to_end(cli_uses_loaded_model, tmp_path):
    out = tmp_path / "out.json"
    args = ["eval", "smollm2-135m", "--preset", "fp8", "--preset", "int4", "--context", "256", "--no-passkey",
            "--no-progress", "--json", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["name"] for r in rows] == ["uncompressed", "fp8", "int4"]
    ref = rows[0]
    assert math.isfinite(ref["ppl"]) and 1.0 < ref["ppl"] < 100.0, ref["ppl"]
    assert ref["n_tokens"] == 128 and ref["ppl_delta_pct"] == 0.0
    # fp8 keeps ~3 significant bits per element more than int4 of the body; both stay near the reference
    for r in rows[1:]:
        assert abs(r["ppl_delta_pct"]) < 5.0, (r["name"], r["ppl_delta_pct"])
    fp8 = rows[1]
    assert fp8["compression_ratio"] > 2.0 and fp8["bits_per_element"] < 16.0
    assert fp8["tokens_held"] == 255
    assert "uncompressed" in res.output and "fp8" in res.output
    # every row is held to the reference's distributions: the reference is KL 0, top-1 100 %
    assert ref["kl_divergence"] == 0.0 and ref["top1_agreement"] == 1.0
    for r in rows[1:]:
        assert 0.0 < r["kl_divergence"] < 0.1 and 0.5 < r["top1_agreement"] <= 1.0, r
    assert "KL" in res.output and "top-1" in res.output


def test_cli_eval_over_windows(cli_uses_loaded_model, tmp_path):
    """--windows 2: each row's ppl is over both windows' scored tokens, its Δppl the mean of the two
    per-window deltas, its KL the mean over both windows' tokens; too many windows for the text is a clear
    error."""
    out = tmp_path / "out.json"
    args = ["eval", "--preset", "int4", "--context", "128", "--windows", "2", "--no-passkey", "--no-progress",
            "--json", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    ref, int4 = json.loads(out.read_text())["rows"]
    assert ref["windows"] == 2 and ref["n_tokens"] == 128 and len(ref["ppl_windows"]) == 2
    assert ref["ppl_windows"][0] != ref["ppl_windows"][1]  # two different windows of text
    assert math.isclose(math.log(ref["ppl"]), sum(math.log(p) for p in ref["ppl_windows"]) / 2, rel_tol=1e-9)
    per = [100 * (a / b - 1) for a, b in zip(int4["ppl_windows"], ref["ppl_windows"])]
    assert int4["ppl_delta_pct_windows"] == pytest.approx(per)
    assert int4["ppl_delta_pct"] == pytest.approx(sum(per) / 2)
    # each window is held to its own reference recording; the row's KL is over both windows' tokens
    assert ref["kl_divergence_windows"] == [0.0, 0.0] and len(int4["kl_divergence_windows"]) == 2
    assert int4["kl_divergence"] == pytest.approx(sum(int4["kl_divergence_windows"]) / 2)
    assert min(int4["kl_divergence_windows"]) >= 0
    assert "[" in res.output  # the per-window range is shown
    res = CliRunner().invoke(main, ["eval", "--preset", "int4", "--context", "4096", "--windows", "50", "--no-passkey"])
    assert res.exit_code != 0 and "--windows 50" in res.output and "fit" in res.output


def test_cli_eval_in_bfloat16(smollm2, monkeypatch, tmp_path):
    """--dtype bfloat16 loads the model in bf16: the uncompressed cache then holds 16 bits per element and
    a compressed cache's exact windows are bf16 too; the JSON says which dtype ran."""
    import copy

    import torch

    import kvcompress.models

    asked = {}

    def load(name, device=None, dtype=None):
        asked["dtype"] = dtype
        model, tok = smollm2
        return (copy.deepcopy(model).to(dtype) if dtype is not None else model), tok

    monkeypatch.setattr(kvcompress.models, "load_model", load)
    out = tmp_path / "out.json"
    args = ["eval", "-p", "nuq4", "--context", "128", "--no-passkey", "--no-progress", "--dtype", "bfloat16",
            "--json", str(out)]
    res = CliRunner().invoke(main, args)
    assert res.exit_code == 0, res.output
    assert asked["dtype"] is torch.bfloat16
    data = json.loads(out.read_text())
    assert data["meta"]["dtype"] == "torch.bfloat16"
    ref, nuq4 = data["rows"]
    assert ref["bits_per_element"] == 16.0 and math.isfinite(ref["ppl"])
    assert 4.0 < nuq4["bits_per_element"] < 16.0
    res = CliRunner().invoke(main, ["eval", "--dtype", "int8", "--no-passkey"])
    assert res.exit_code != 0 and "float32" in res.output  # the valid choices are named


def test_bucketed_kl_is_the_kl_of_the_bucketed_distributions():
    """kl_and_top1 on a reference that kept its top k: the exact KL of P and Q with every token outside P's
    top k merged into one outcome; with k = the vocabulary, torch's own KL; top-1 compares the argmaxes."""
    from kvcompress.evaluation.divergence import ReferenceLogprobs, kl_and_top1

    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(50, generator=g) * 3, torch.randn(50, generator=g) * 3
    p, q = p_logits.double().softmax(-1), q_logits.double().softmax(-1)
    for k in (5, 50):
        ref = ReferenceLogprobs(k=k)
        ref.record(p_logits)
        kl, same = kl_and_top1(q_logits, ref.token_ids[0], ref.logprobs[0])
        top = p.topk(k).indices
        rest = torch.ones(50, dtype=torch.bool)
        rest[top] = False
        pb = torch.cat([p[top], p[rest].sum().view(1)])
        qb = torch.cat([q[top], q[rest].sum().view(1)])
        want = float((pb * (pb / qb).log()).nan_to_num().sum())
        assert abs(kl - want) < 1e-6, (k, kl, want)
        assert same == (int(p.argmax()) == int(q.argmax()))
    assert abs(kl - float(torch.nn.functional.kl_div(q.log(), p, reduction="sum"))) < 1e-6
    ref = ReferenceLogprobs()
    ref.record(p_logits)
    assert kl_and_top1(p_logits, ref.token_ids[0], ref.logprobs[0]) == (pytest.approx(0.0, abs=1e-9), True)


def test_kl_divergence_of_a_cache_on_smollm2(smollm2):
    """Through `perplexity`: a second uncompressed run is KL 0 with every top token the same; a lossy cache
    (int2) moves the distributions, and KL against the top-1024 recording is a lower bound of the KL over
    the whole vocabulary within 5 % of it (measured 2.5 % for int2, up to 4 % for fp8 / nuq4)."""
    from kvcompress.evaluation.divergence import ReferenceLogprobs

    model, tok = smollm2
    ids = context_ids(tok, 256)
    top, full = ReferenceLogprobs(), ReferenceLogprobs(k=model.config.vocab_size)
    perplexity(model, tok, lambda: DynamicCache(), ids, record=top)
    perplexity(model, tok, lambda: DynamicCache(), ids, record=full)
    again = perplexity(model, tok, lambda: DynamicCache(), ids, reference=top)
    assert again.kl < 1e-9 and again.top1 == 1.0
    lossy = [perplexity(model, tok, lambda: CompressedCache(model.config, "int2"), ids, reference=r)
             for r in (top, full)]
    kl_top, kl_full = lossy[0].kl, lossy[1].kl
    assert 1e-3 < kl_full and 0.95 * kl_full <= kl_top <= kl_full, (kl_top, kl_full)
    with pytest.raises(ValueError, match="reference holds 128 scored positions.*score 64"):
        perplexity(model, tok, lambda: DynamicCache(), context_ids(tok, 128), reference=top)


def test_none_preset_is_token_identical(smollm2):
    model, tok = smollm2
    ids = context_ids(tok, 64)
    ref = perplexity(model, tok, lambda: DynamicCache(config=model.config), ids)
    none = perplexity(model, tok, lambda: CompressedCache(model.config, "none"), ids)
    assert none.nll == ref.nll and none.n_tokens == ref.n_tokens == 32
    rows = add_deltas([{"name": "uncompressed", "kind": "uncompressed", "ppl": ref.ppl},
                       {"name": "none", "kind": "preset", "ppl": none.ppl}])
    assert rows[1]["ppl_delta_pct"] == 0.0


def test_too_short_text_names_its_token_count(smollm2, cli_uses_loaded_model, tmp_path):
    _, tok = smollm2
    with pytest.raises(TextTooShortError, match=r"only \d+ tokens, fewer than --context 512"):
        context_ids(tok, 512, text="A few words only.")
    short = tmp_path / "short.txt"
    short.write_text("A few words only.", encoding="utf-8")
    res = CliRunner().invoke(main, ["eval", "--preset", "fp8", "--context", "512", "--text", str(short), "--no-passkey"])
    assert res.exit_code != 0 and "only" in res.output and "--context 512" in res.output


def test_passkey_found_through_uncompressed_cache(smollm2):
    model, tok = smollm2
    res = passkey_accuracy(model, tok, lambda: DynamicCache(config=model.config), lengths=(256,), depths=(0.5,))
    trial = res.trials[0]
    assert res.accuracy == 1.0, trial
    assert 10000 <= trial.key <= 99999 and len(res.trials) == 1


def test_passkey_answer_logprob_is_the_teacher_forced_one_on_both_paths(smollm2):
    """A trial's answer log-probability equals one no-cache forward over prompt + answer (fp32), whether it
    is read off the greedy run (the output begins with the answer) or scored by a second, teacher-forced
    run (here forced by a greedy run too short to hold the answer)."""
    import torch

    from kvcompress.evaluation.passkey import answer_ids, passkey_prompt

    model, tok = smollm2
    kw = dict(lengths=(256,), depths=(0.5,))
    greedy = passkey_accuracy(model, tok, lambda: DynamicCache(config=model.config), **kw).trials[0]
    forced = passkey_accuracy(model, tok, lambda: DynamicCache(config=model.config), max_new_tokens=1, **kw).trials[0]
    answer = answer_ids(tok, greedy.key)
    assert greedy.found and not forced.found and len(answer) > 1
    ids = passkey_prompt(tok, 256, 0.5, greedy.key)
    with torch.inference_mode():
        logits = model(torch.cat([ids, torch.tensor([answer])], 1)).logits[0].float()
    logp = torch.log_softmax(logits[ids.shape[1] - 1 : -1], -1)  # [len(answer), V]: row i predicts answer[i]
    oracle = float(logp[torch.arange(len(answer)), torch.tensor(answer)].sum())
    assert oracle < 0.0
    assert greedy.answer_logprob == pytest.approx(oracle, abs=1e-3)
    assert forced.answer_logprob == pytest.approx(oracle, abs=1e-3)


def test_eval_runs_sparse_presets_under_the_kvcompress_attention(smollm2):
    """A sparse preset is evaluated inside `kvcompress.enabled(model)`, whether its policy needs the query
    (Quest), the attention weights (H2O) or neither (StreamingLLM, which evicts where that attention hands it
    the padding mask); the model is restored after."""
    from kvcompress.evaluation.runner import evaluate

    model, tok = smollm2
    before = model.config._attn_implementation
    names = ["quest-512", "h2o-20", "streaming"]
    rows = evaluate(model, tok, presets=names, context=96, passkey=False, progress=False)
    assert [r["name"] for r in rows] == ["uncompressed", *names]
    assert all(r["ppl"] == r["ppl"] and r["ppl"] < 1e4 for r in rows)
    assert model.config._attn_implementation == before


@pytest.mark.parametrize("preset", ["h2o-20", "streaming"])
def test_cli_generate_runs_a_sparse_preset(preset):
    """`kvcompress generate -p <sparse preset>`: the command switches the kvcompress attention on itself (a
    CLI user cannot call `kvcompress.enable`)."""
    prompt = "The KV cache grows with the context, so long prompts need memory. " * 8
    result = CliRunner().invoke(main, ["generate", "smollm2-135m", prompt, "-p", preset, "-n", "4", "--no-chat"])
    assert result.exit_code == 0, result.output
    assert "KV cache memory" in result.output


def test_line_progress_logs_each_phase_and_at_most_one_line_per_interval():
    """Where rich would draw nothing (not a terminal), the run still reports: a line when a phase
    starts, then at most one per interval, with the steps done, and a last line at the end."""
    import io

    from kvcompress.evaluation.progress import LineProgress, progress_display

    now = [0.0]
    out = io.StringIO()
    with LineProgress(out, every_s=30.0, clock=lambda: now[0]) as bar:
        task = bar.add_task("evaluating", total=100)
        bar.update(task, description="uncompressed: perplexity")
        for _ in range(50):  # 50 steps of 1 s: lines at 30 s only
            now[0] += 1.0
            bar.advance(task)
        bar.update(task, description="uncompressed: perplexity")  # same phase: no line
        bar.update(task, description="nuq4: perplexity")
        for _ in range(50):
            now[0] += 0.1  # 5 s in all: under the interval
            bar.advance(task)
    lines = out.getvalue().splitlines()
    assert lines == [
        "uncompressed: perplexity: 0/100 (0 %) after 0:00:00",
        "uncompressed: perplexity: 30/100 (30 %) after 0:00:30, about 0:01:10 left",
        "nuq4: perplexity: 50/100 (50 %) after 0:00:50, about 0:00:50 left",
        "nuq4: perplexity: 100/100 (100 %) after 0:00:55",
    ]
    out = io.StringIO()  # a last advance that drew its line is not repeated at the end
    with LineProgress(out, every_s=30.0, clock=lambda: now[0]) as bar:
        task = bar.add_task("calibrating: tokens", total=2)
        bar.advance(task)
        now[0] += 31.0
        bar.advance(task)
    assert out.getvalue().splitlines() == ["calibrating: tokens: 2/2 (100 %) after 0:00:31"]
    assert isinstance(progress_display(True, stream=io.StringIO()), LineProgress)
    with progress_display(False) as bar:
        assert bar is None


def test_eval_progress_reaches_a_log_that_is_not_a_terminal(smollm2, capsys):
    """`evaluate(progress=True)` with stderr captured (not a terminal) prints its phases there."""
    from kvcompress.evaluation.runner import evaluate

    model, tok = smollm2
    evaluate(model, tok, presets=["int4"], context=24, passkey=False, progress=True)
    err = capsys.readouterr().err
    assert "uncompressed: perplexity: 0/" in err and "int4: perplexity: 11/" in err
    assert err.rstrip().splitlines()[-1].startswith("int4: perplexity: 22/22 (100 %)")


def test_cli_eval_refuses_an_unknown_preset_before_loading_the_model(monkeypatch):
    import kvcompress.cli_eval as cli_eval

    def never(*a, **k):
        raise AssertionError("the model was loaded before the preset name was checked")

    monkeypatch.setattr(cli_eval, "load_model_or_exit", never)
    result = CliRunner().invoke(main, ["eval", "smollm2-135m", "-p", "nuq5", "--no-passkey"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    assert "unknown preset 'nuq5'" in result.output and "nuq4" in result.output


def test_cli_eval_refuses_a_config_made_for_another_model(tmp_path):
    """A config calibrated for another model ends in a message naming the mismatch, not a traceback."""
    from transformers import LlamaConfig

    from kvcompress.config import KVCompressConfig

    other = LlamaConfig(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=128)
    path = tmp_path / "other.safetensors"
    KVCompressConfig.from_preset("nuq4", other).save(path)
    result = CliRunner().invoke(main, ["eval", "smollm2-135m", "-c", str(path), "--context", "64", "--no-passkey",
                                       "--no-progress"])
    assert result.exit_code != 0 and isinstance(result.exception, SystemExit), result.output
    assert "made for a different model" in result.output and "model has 30" in result.output


def test_plot_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    """`eval --plot`: a PNG with one point per row that has bits; a save that fails midway leaves no file."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from kvcompress.evaluation.plot import plot_results

    rows = [{"name": "uncompressed", "context": 64, "bits_per_element": 16.0, "ppl_delta_pct": 0.0, "passkey": 1.0},
            {"name": "nuq4", "context": 64, "bits_per_element": 4.6, "ppl_delta_pct": 0.2, "passkey": None}]
    path = tmp_path / "q.png"
    plot_results(rows, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    def broken(self, fname, **kw):
        with open(fname, "wb") as f:
            f.write(b"\x89PNG partial")
        raise OSError("disk full")

    monkeypatch.setattr(Figure, "savefig", broken)
    with pytest.raises(OSError, match="disk full"):
        plot_results(rows, str(tmp_path / "r.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.png"]


def test_eval_runs_passkey_through_each_cache(smollm2):
    """The runner's passkey branch with a compressed cache, not only the reference: every row gets its
    trials at each (length, depth), and the compressed row's trials are its own (the nuq4 cache is built
    per trial: its answers' log-probabilities differ from the uncompressed ones)."""
    from kvcompress.evaluation.runner import evaluate

    model, tok = smollm2
    rows = evaluate(model, tok, presets=["nuq4"], context=64, passkey=True, passkey_lengths=(160,),
                    passkey_depths=(0.2, 0.8), progress=False)
    assert [r["name"] for r in rows] == ["uncompressed", "nuq4"]
    for r in rows:
        assert [(t["length"], t["depth"]) for t in r["passkey_trials"]] == [(160, 0.2), (160, 0.8)]
        assert r["passkey"] == sum(t["found"] for t in r["passkey_trials"]) / 2
        assert all(t["answer_logprob"] <= 0 for t in r["passkey_trials"])
    ref, nuq = ([t["answer_logprob"] for t in r["passkey_trials"]] for r in rows)
    assert ref != nuq
