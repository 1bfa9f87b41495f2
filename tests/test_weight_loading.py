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
