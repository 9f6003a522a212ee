"""A tiny checkpoint with a real tokenizer and chat template, and the CLI run in-process (shared by the
training-loop, data and CLI-hygiene tests). Nothing is downloaded."""

import sys
from pathlib import Path

import pytest
import torch
import transformers

from poros_fx.tools import cli as cli_module
from poros_fx.tools.tiny import tiny_config
from poros_fx.tools.tiny_tokenizer import tiny_tokenizer

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


def run_cli(capsys, *args: str) -> tuple[int, str, str]:
    """``poros-fx ARGS`` in this process (``cli.main``, as the script runs it): (exit code, stdout, stderr)."""
    argv = sys.argv
    sys.argv = ["poros-fx", *args]
    capsys.readouterr()
    try:
        cli_module.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv = argv
    out, err = capsys.readouterr()
    return code, out, err
