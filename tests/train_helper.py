"""A tiny checkpoint with a real tokenizer and chat template, and the CLI run in-process (shared by the
training-loop, data and CLI-hygiene tests). Nothing is downloaded."""

import contextlib
import io
import sys
from pathlib import Path

import pytest
import torch
import transformers

from poros_fx.cli import app as cli_module
from poros_fx.models.tiny import tiny_config
from poros_fx.models.tiny_tokenizer import tiny_tokenizer

VOCAB = 320  # the tiny tokenizer has at most 300 tokens
# one optimizer step = 2 rows of 24 tokens: every run takes seconds
FAST = ("--seq-len", "24", "--batch-size", "2", "--device", "cpu", "--quantization", "bf16", "--lora-r", "4",
        "--lora-alpha", "8", "--log-every", "1")


def make_checkpoint(folder: Path) -> Path:
    """A tiny Qwen2 checkpoint (float32 safetensors) with the chat tokenizer, in ``folder``."""
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(tiny_config("qwen2", layers=2, vocab=VOCAB)).save_pretrained(folder)
    tiny_tokenizer().save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("tiny-chat-qwen2"))


def _main(*args: str) -> int:
    argv = sys.argv
    sys.argv = ["poros-fx", *args]
    try:
        cli_module.main()
        return 0
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``poros-fx ARGS`` in this process (``cli.main``, as the script runs it): (exit code, stdout, stderr)."""
    capsys.readouterr()
    code = _main(*args)
    out, err = capsys.readouterr()
    return code, out, err


def run_cli_redirected(*args: str) -> tuple[int, str, str]:
    """``run_cli`` without capsys, for a fixture wider than one test: sys.stdout and sys.stderr redirected."""
    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.redirect_stderr(io.StringIO()) as err:
        code = _main(*args)
    return code, out.getvalue(), err.getvalue()
