"""What the command line prints: full help at 80 columns, one error style, filtered third-party noise, the
peak/total report, a too-small memory budget refused before compiling."""

import ast
import logging
import re
from pathlib import Path

import pytest
from train_helper import run_cli

from poros_fx.models.tiny import tiny_config

COMMANDS = ("demo", "doctor", "check", "dump", "train", "eval", "export", "exactness", "bench")
ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("columns", ["80", "200"])
def test_help_is_whole_at_any_width(capsys, monkeypatch, columns):
    monkeypatch.setenv("COLUMNS", columns)
    for command in COMMANDS:
        code, out, err = run_cli(capsys, command, "--help")
        assert code == 0 and not err, (command, err)
        assert "…" not in out and "╭" not in out, command  # nothing cut off, no boxes
        assert max(len(line) for line in out.splitlines()) <= int(columns), command
    _, out, _ = run_cli(capsys, "train", "--help")
    words = " ".join(out.split())
    assert "docs/exactness.md" in words and "--max-grad-norm" in words and "--save-total-limit" in words


def test_one_error_style(capsys, tmp_path):
    """Bad input exits with 2 and one `error:` line on stderr, whoever found it: click (a bad value), a
    callback, poros-fx's own checks."""
    cases = [("train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out", str(tmp_path / "a"), "--epochs", "0"),
             ("train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out", str(tmp_path / "a"), "--schedule",
              "sometimes"),
             ("train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out", str(tmp_path / "a"), "--lr", "fast"),
             ("check", "qwen2.5-7b", "--prefetch", "two"),
             ("check", "no/such-model-anywhere"),
             ("train", "--resume", str(tmp_path / "nothing-here")),
             ("check",)]
    for args in cases:
        code, out, err = run_cli(capsys, *args)
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, out, err)
        assert "Traceback" not in err and "╭" not in err
    assert not (tmp_path / "a").exists()


def test_one_command_line():
    """The package declares one console script, and no module of it but poros_fx/__main__.py (which runs that
    script's app) has a `__main__` block: every command, benchmark workers included, goes through `poros-fx`."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10
        import tomli as tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    assert project["scripts"] == {"poros-fx": "poros_fx.cli:main"}

    def main_blocks(path: Path) -> bool:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and \
                    any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators):
                return True
        return False

    modules = sorted((ROOT / "poros_fx").rglob("*.py")) + sorted((ROOT / "passes").rglob("*.py"))
    assert len(modules) > 50
    with_main = [str(p.relative_to(ROOT)) for p in modules if main_blocks(p)]
    assert with_main == ["poros_fx/__main__.py"]


def test_bitsandbytes_cpu_kernel_line_is_filtered(caplog):
    with caplog.at_level(logging.WARNING):
        logger = logging.getLogger("bitsandbytes.backends.cpu.ops")
        logger.warning("Failed to load CPU gemm_4bit_forward from kernels-community: %s. Please make sure ...", "x")
        logger.warning("another bitsandbytes warning")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["another bitsandbytes warning"]


def test_peak_is_reported_against_what_the_blocks_copy(tmp_path, capsys):
    """Tied embeddings and a block of both layers: every block is on the device at once, and the layers are
    copied as arena spans (alignment gaps included), so the peak exceeds the tensors' own bytes. The summary
    compares it with what the blocks copy; it never says 'X of Y' with X > Y."""
    tiny_config("qwen2", layers=2, tie_word_embeddings=True).save_pretrained(tmp_path / "cfg")
    code, out, err = run_cli(capsys, "train", "--from-config", str(tmp_path / "cfg"), "--data", "demo", "--out",
                             str(tmp_path / "o"), "--steps", "1", "--block-size", "2", "--seq-len", "16", "--device",
                             "cpu", "--quantization", "bf16", "--lora-r", "2")
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("poros: peak resident base"))
    sizes = re.findall(r"([\d.]+) (KiB|MiB|GiB|bytes)", line)
    scale = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}
    peak, copied, tensors = (float(n) * scale[u] for n, u in sizes[:3])
    assert peak <= copied and peak > tensors and "that all blocks copy at once" in line


def test_a_too_small_memory_budget_is_refused_before_compiling(tmp_path, capsys):
    tiny_config("qwen2", layers=2).save_pretrained(tmp_path / "cfg")
    code, out, err = run_cli(capsys, "train", "--from-config", str(tmp_path / "cfg"), "--data", "demo", "--out",
                             str(tmp_path / "o"), "--steps", "1", "--seq-len", "16", "--device", "cpu",
                             "--memory-budget", "1KiB")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert "--memory-budget 1KiB (1.0 KiB) is below the streamed base window" in err and "poros-fx check" in err
    assert "step 1/1" not in out and not (tmp_path / "o" / "adapter_model.safetensors").exists()
