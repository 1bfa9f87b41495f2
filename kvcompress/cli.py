"""The `kvcompress` command line (also `python -m kvcompress.cli`)."""

from __future__ import annotations

import click

from kvcompress import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kvcompress")
def main():
    """Shrink the KV cache of transformer LLMs."""


@main.command()
@click.argument("model", default="smollm2-135m")
@click.argument("prompt", default="Explain in two sentences why the sky is blue.")
@click.option("--preset", "-p", default="none", show_default=True, help="Preset name or a config .safetensors file.")
@click.option("--max-new-tokens", "-n", default=64, show_default=True, type=click.IntRange(1, 100_000))
@click.option("--device", default=None, help="cpu, cuda, ... (default: where the model loads)")
@click.option("--chat/--no-chat", default=True, show_default=True, help="Wrap the prompt in the chat template.")
@click.option("--graph", is_flag=True,
              help="Decode through kvcompress.DecodeGraph: the fused kernels, each step replayed from one CUDA "
                   "graph (a GPU, and a quantization preset, alone or with H2O or Quest as in nuq4+h2o-20, "
                   "nuq4+quest-1024).")
def generate(model, prompt, preset, max_new_tokens, device, chat, graph):
    """Generate greedily with a CompressedCache and print the text, the decode time and the memory report."""
    import time

    import kvcompress
    from kvcompress.cache import CompressedCache
    from kvcompress.compat import with_cache
    from kvcompress.config import ConfigError
    from kvcompress.models import load_model
    from kvcompress.report import print_memory_report

    m, tok = load_model(model, device=device)
    if chat and tok.chat_template:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    inputs = tok(text, return_tensors="pt").to(m.device)
    cache = CompressedCache(m.config, preset)
    extra = {}
    if graph or cache.kv_config.needs_attention:  # a sparse preset runs under the kvcompress attention
        kvcompress.enable(m)
    if graph:
        extra["custom_generate"] = kvcompress.graph_generate
    start = time.perf_counter()
    try:
        out = m.generate(**inputs, **with_cache(cache), max_new_tokens=max_new_tokens, do_sample=False, **extra)
    except ConfigError as e:
        raise click.ClickException(str(e)) from e
    seconds = time.perf_counter() - start
    new_tokens = out.shape[1] - inputs["input_ids"].shape[1]
    click.echo(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))
    click.echo(f"[{new_tokens} tokens in {seconds:.2f} s, prefill included{', decode graph' if graph else ''}]")
    print_memory_report(cache.memory_report(), title=f"KV cache memory ({cache.kv_config.name})")


# The other commands live in their own modules.

from kvcompress.cli_calib import calibrate, estimate, export, inspect  # noqa: E402
from kvcompress.cli_eval import eval_command  # noqa: E402

for _command in (calibrate, eval_command, estimate, export, inspect):
    main.add_command(_command)


if __name__ == "__main__":
    main()
