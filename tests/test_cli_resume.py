"""``poros-fx train --resume``, ``--save-every`` and Ctrl-C, through the installed script on a tiny config.

The reference is always an uninterrupted run with the same settings: a resumed run must end with the
same adapter, optimizer state, RNG state and per-step losses, bit for bit.
"""

import json
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from cli_helper import SCRIPT, cli
from safetensors import safe_open
from train_helper import run_cli, run_cli_redirected

from poros_fx.training.run_state import STATE_FILE
from poros_fx.models.tiny import tiny_config

# dropout > 0 so the RNG state matters; 2 micro-batches per step so the data position does
FAST = ("--data", "demo", "--seq-len", "24", "--batch-size", "2", "--accumulate", "2", "--device", "cpu",
        "--quantization", "bf16", "--lora-r", "4", "--lora-dropout", "0.1", "--log-every", "1")
STEPS = 4


def read(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(path, "pt") as f:
        meta = f.metadata() or {}
        return {k: f.get_tensor(k) for k in f.keys()}, meta  # noqa: SIM118 (safe_open is not a mapping)


def state(folder: Path) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, meta = read(folder / STATE_FILE)
    return tensors, json.loads(meta["poros_fx_train_state"])


def assert_equal_files(a: Path, b: Path) -> None:
    ta, _ = read(a)
    tb, _ = read(b)
    assert ta.keys() == tb.keys() and ta
    differ = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not differ, differ


@pytest.fixture(scope="module")
def config_file(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("cfg")
    tiny_config("qwen2", layers=2).save_pretrained(folder)
    return folder / "config.json"


@pytest.fixture(scope="module")
def whole(config_file, tmp_path_factory) -> tuple[Path, str]:
    """The uninterrupted run, saving every 2 steps on the way: in this process (a subprocess costs ~8 s of
    imports), so the resumed and the interrupted runs below, processes of their own, are compared across
    processes. Its stdout with lines rejoined (this process's console is 80 columns wide)."""
    out = tmp_path_factory.mktemp("whole") / "adapter"
    code, stdout, err = run_cli_redirected("train", "--from-config", str(config_file), "--out", str(out), "--steps",
                                           str(STEPS), "--save-every", "2", *FAST)
    assert code == 0, err
    return out, " ".join(stdout.split())


def test_resume_is_bit_exact(config_file, whole, tmp_path, capsys):
    reference, stdout = whole
    assert f"step 2: adapter and resume state saved to {reference}/" in stdout  # --save-every 2
    assert not list(reference.glob(".poros-save-*"))  # the temporary folder of each save is gone
    out = tmp_path / "adapter"
    # the first half in this process (a subprocess costs ~8 s of imports), the resume in a process of its own:
    # what carries over is the saved state alone
    code, _, err = run_cli(capsys, "train", "--from-config", str(config_file), "--out", str(out), "--steps", "2", *FAST)
    assert code == 0, err
    _, first = state(out)
    assert first["step"] == 2 and len(first["losses"]) == 2
    res = cli("train", "--resume", str(out), "--steps", str(STEPS), "--log-every", "1")  # nothing else repeated
    assert "resuming after step 2" in res.stdout and "step 3/4" in res.stdout and "step 1/4" not in res.stdout

    assert_equal_files(out / "adapter_model.safetensors", reference / "adapter_model.safetensors")
    assert_equal_files(out / STATE_FILE, reference / STATE_FILE)  # adapter, AdamW moments and steps, RNG
    (tensors, meta), (_, ref_meta) = state(out), state(reference)
    assert meta["losses"] == ref_meta["losses"] and len(meta["losses"]) == STEPS  # per-step losses, exactly
    assert meta["step"] == STEPS and meta["micro_batches"] == 2 * STEPS
    assert any(k.startswith("optimizer/") and k.endswith("/exp_avg_sq") for k in tensors) and "rng/cpu" in tensors


def test_resume_refusals(config_file, whole, tmp_path, capsys):
    # refused before anything trains: in this process (a poros-fx subprocess costs ~8 s of imports each)
    reference, _ = whole
    code, _, err = run_cli(capsys, "train", "--resume", str(reference), "--lr", "1e-3", "--seed", "3")
    assert code == 2
    assert "--lr 0.001 (the run has 0.0002)" in err and "--seed 3 (the run has 0)" in err
    code, _, err = run_cli(capsys, "train", "--resume", str(reference))
    assert code == 2 and f"has finished its {STEPS} steps; pass --steps N" in err
    code, _, err = run_cli(capsys, "train", "--resume", str(tmp_path))
    assert code == 2 and f"has no {STATE_FILE}, so it cannot be resumed" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / STATE_FILE).write_bytes((reference / STATE_FILE).read_bytes()[:1000])
    code, _, err = run_cli(capsys, "train", "--resume", str(broken))
    assert code == 2 and f"{broken / STATE_FILE}: truncated" in err
    assert "Traceback" not in err


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def test_ctrl_c_saves_the_last_finished_step(config_file, whole, tmp_path):
    reference, _ = whole
    out = tmp_path / "adapter"
    proc = subprocess.Popen([str(SCRIPT), "train", "--from-config", str(config_file), "--out", str(out), "--steps",
                             "500", *FAST], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={"COLUMNS": "200", "PATH": str(SCRIPT.parent), "HF_HUB_OFFLINE": "1"},
                            # a shell that starts jobs in the background (CI) leaves SIGINT ignored, and
                            # Python then never raises KeyboardInterrupt: give the child the default, and
                            # unblock it (a mask is inherited through exec; one CI run ignored the signal)
                            preexec_fn=_default_sigint)
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("step 3/500") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout + stderr
    tensors, meta = state(out)
    done = meta["step"]
    assert 3 <= done < 500 and len(meta["losses"]) == done
    assert f"interrupted: step {done}/500 saved to {out}/" in stderr and f"poros-fx train --resume {out}" in stderr
    assert "Traceback" not in stderr
    # what was saved is the uninterrupted run's state at that step (the data order does not depend on --steps)
    _, ref_meta = state(reference)
    n = min(done, STEPS)
    assert meta["losses"][:n] == ref_meta["losses"][:n]
    adapter, _ = read(out / "adapter_model.safetensors")
    assert len(adapter) == sum(k.startswith("adapter/") for k in tensors)
    if done == STEPS:
        assert_equal_files(out / "adapter_model.safetensors", reference / "adapter_model.safetensors")
