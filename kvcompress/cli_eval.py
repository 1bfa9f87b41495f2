"""`kvcompress eval`: perplexity, passkey retrieval, memory and decode time of KV caches, one table."""

from __future__ import annotations

import click

from kvcompress.cli_common import dtype_option, load_model_or_exit


def _lengths(ctx, param, value: str) -> tuple[int, ...]:
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"expected comma-separated token counts like 1024,2048, got {value!r}")
    if not out or min(out) < 64:
        raise click.BadParameter("passkey lengths must be token counts of at least 64")
    return out


def _check_caches(presets, configs) -> None:
    """Unknown preset names and unreadable config files are refused before the model loads."""
    from kvcompress.config import ConfigError, KVCompressConfig
    from kvcompress.presets import preset_names

    names = preset_names()
    unknown = [p for p in presets if p not in names]
    if unknown:
        raise click.ClickException(f"unknown preset {', '.join(map(repr, unknown))}; available: {', '.join(names)}")
    for path in configs:
        try:
            KVCompressConfig.load(path)
        except ConfigError as e:
            raise click.ClickException(str(e))


@click.command("eval")
@click.argument("model", default="smollm2-135m")
@click.option("--preset", "-p", "presets", multiple=True, help="Preset to evaluate (repeatable). Default: fp8, int4, nuq4.")
@click.option("--config", "-c", "configs", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Saved kvcompress config (.safetensors) to evaluate (repeatable).")
@click.option("--context", default=2048, show_default=True, type=click.IntRange(4, 1_000_000),
              help="Tokens of the text: the first half is prefilled, the second half decoded and scored.")
@click.option("--windows", default=1, show_default=True, type=click.IntRange(1, 1000),
              help="Score this many disjoint consecutive windows of --context tokens; Δppl is their mean, "
                   "shown with its [min, max] over the windows.")
@click.option("--text", "text_file", type=click.Path(exists=True, dir_okay=False),
              help="UTF-8 text to score (default: the shipped kvcompress/data/eval.txt).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False), help="Write the rows as JSON (atomically).")
@click.option("--plot", "plot_out", type=click.Path(dir_okay=False), help="Save Δppl vs bits/element (needs matplotlib).")
@click.option("--passkey/--no-passkey", default=True, show_default=True, help="Run passkey retrieval too.")
@click.option("--passkey-lengths", default="1024,2048", show_default=True, callback=_lengths,
              help="Passkey prompt lengths in tokens, comma-separated.")
@click.option("--passkey-seeds", default=1, show_default=True, type=click.IntRange(1, 100),
              help="Passkey trials per (length, depth): seeds 0..N-1.")
@click.option("--passkey-template", type=click.Choice(["plain", "chat"]), default="plain", show_default=True,
              help="Passkey prompt as a chat turn or as plain text.")
@click.option("--baselines", default="", help="transformers QuantizedCache baselines: quanto,hqq (int4 and int2 each).")
@click.option("--device", default=None, help="cpu, cuda, ... (default: where the model loads)")
@click.option("--load-in-4bit", is_flag=True, help="Load the weights in 4 bits (bitsandbytes NF4; CUDA).")
@click.option("--load-in-8bit", is_flag=True, help="Load the weights in 8 bits (bitsandbytes LLM.int8; CUDA).")
@dtype_option
@click.option("--progress/--no-progress", default=True, show_default=True, help="Show a progress bar.")
def eval_command(model, presets, configs, context, windows, text_file, json_out, plot_out, passkey, passkey_lengths,
                 passkey_seeds, passkey_template, baselines, device, progress, load_in_4bit=False, load_in_8bit=False,
                 dtype="auto"):
    """Compare the uncompressed cache with presets / configs / baselines on the same text.

    Prints one table: perplexity and its change vs uncompressed, the mean KL divergence (nats) of each
    scored prediction from the uncompressed cache's and how often both rank the same token first, passkey
    accuracy and the answer's mean log-probability (nats, teacher-forced after the prompt), KV bytes held
    and compression ratio, all-in bits per element, tokens held / read per step, ms per decode token.
    """
    from rich.console import Console

    from kvcompress.config import ConfigError
    from kvcompress.evaluation.perplexity import TextTooShortError
    from kvcompress.evaluation.runner import evaluate
    from kvcompress.evaluation.table import print_results, write_json

    if plot_out:
        from kvcompress.evaluation.plot import PLOT_HINT

        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise click.ClickException(f"--plot needs matplotlib; install it with: {PLOT_HINT}")
    if not presets and not configs:
        presets = ("fp8", "int4", "nuq4")
    _check_caches(presets, configs)
    text = None
    if text_file:
        with open(text_file, encoding="utf-8") as f:
            text = f.read()
    console = Console(stderr=True)
    m, tok = load_model_or_exit(model, device, load_in_4bit, load_in_8bit, dtype)
    try:
        rows = evaluate(
            m, tok, presets=presets, configs=configs, baselines=baselines, context=context, windows=windows, text=text,
            passkey=passkey, passkey_lengths=passkey_lengths, passkey_seeds=tuple(range(passkey_seeds)),
            passkey_template=passkey_template, progress=progress, log=lambda msg: console.print(f"[yellow]{msg}"),
        )
    except (TextTooShortError, ConfigError) as e:  # a config made for another model, a preset it cannot take
        raise click.ClickException(str(e))
    over = f"the last {context - context // 2} tokens" + (f" of each of {windows} windows" if windows > 1 else "")
    title = f"{model} ({m.dtype}): context {context}, ppl over {over}, device {m.device}"
    print_results(rows, title=title)
    if json_out:
        meta = {"model": model, "context": context, "windows": windows, "text": text_file or "kvcompress/data/eval.txt",
                "device": str(m.device), "dtype": str(m.dtype),
                "passkey_lengths": list(passkey_lengths) if passkey else [],
                "passkey_template": passkey_template}
        write_json(json_out, {"meta": meta, "rows": rows})
        click.echo(f"wrote {json_out}")
    if plot_out:
        from kvcompress.evaluation.plot import plot_results

        plot_results(rows, plot_out)
        click.echo(f"wrote {plot_out}")

