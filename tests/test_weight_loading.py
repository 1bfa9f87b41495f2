"""--load-in-4bit / --load-in-8bit on `eval` and `calibrate`: bitsandbytes weights need CUDA, and say so."""

import pytest
import torch
from click.testing import CliRunner

from kvcompress.cli import main
from kvcompress.models import ModelLoadError, weight_quantization_kwargs


def test_no_flag_means_no_quantization_kwargs():
    assert weight_quantization_kwargs(False, False) == {}


def test_both_flags_are_refused():
    with pytest.raises(ModelLoadError, match="choose one"):
        weight_quantization_kwargs(True, True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where CUDA is missing")
@pytest.mark.parametrize("command", [["eval", "--no-passkey", "--context", "64"], ["calibrate", "--out", "x.safetensors"]])
@pytest.mark.parametrize("flag", ["--load-in-4bit", "--load-in-8bit"])
def test_cli_flag_without_cuda_is_a_clear_error(command, flag, tmp_path):
    with CliRunner().isolated_filesystem(temp_dir=tmp_path):
        out = CliRunner().invoke(main, [command[0], "smollm2-135m", flag, *command[1:]])
        assert out.exit_code != 0
        assert "need a CUDA GPU" in out.output and not (tmp_path / "x.safetensors").exists()


def test_loading_bars_stay_out_of_a_log(capfd):
    """Where stderr is not a terminal (a log; pytest's capture), loading SmolLM2 writes none of
    transformers' bars, whose redraws fill a log with carriage-return lines; asked for, they are drawn, and
    the GGUF reader's own tqdm is put back after the load."""
    import transformers.modeling_gguf_pytorch_utils as gguf

    from kvcompress.models import load_model

    bar = gguf.tqdm
    load_model("smollm2-135m")
    quiet = capfd.readouterr().err
    assert "Converting and de-quantizing" not in quiet and "Loading weights" not in quiet
    assert gguf.tqdm is bar
    load_model("smollm2-135m", progress=True)
    shown = capfd.readouterr().err
    assert "Converting and de-quantizing" in shown and "Loading weights" in shown
