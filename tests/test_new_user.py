"""What a first-time user runs into with ``poros-fx train`` / ``eval`` and ``FineTuner``: settings refused in one
``error:`` line before any weight is read, outputs checked before anything heavy runs, SIGTERM handled as
Ctrl-C, and a stopped run's folder cleaned up on ``--resume``, ``--overwrite`` and a plain re-run.

The refusals run in this process and train nothing; one tiny subprocess is stopped with SIGTERM.
"""

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import transformers
from cli_helper import SCRIPT
from train_helper import FAST, checkpoint, run_cli  # noqa: F401 (checkpoint is a fixture)

import poros_fx
from poros_fx.models.tiny import lora_targets, tiny_config
from poros_fx.training.run_state import STATE_FILE, claim_out
from poros_fx.training.sources import seq_len_limit, split_targets, target_modules
from poros_fx.training.terminal import console


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


@pytest.fixture
def config_dir(tmp_path) -> Path:
    tiny_config("qwen2", layers=2).save_pretrained(tmp_path / "cfg")  # 256 positions
    return tmp_path / "cfg"


def test_seq_len_beyond_the_model_is_refused_before_loading(config_dir, checkpoint, tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", "--from-config", str(config_dir), "--data", "demo", "--out",
                             str(tmp_path / "o"), "--seq-len", "100000", "--device", "cpu")
    line = one_error(err)
    assert code == 2 and "--seq-len 100000" in line and "256" in line and "max_position_embeddings" in line
    assert "model:" not in out and not (tmp_path / "o").exists()
    code, out, err = run_cli(capsys, "eval", str(checkpoint), "--data", "demo", "--seq-len", "100000", "--device", "cpu")
    assert code == 2 and "256" in one_error(err) and "eval:" not in out
    # RoPE scaling extends the limit by its factor
    scaled = transformers.Qwen2Config(max_position_embeddings=256, rope_scaling={"rope_type": "linear", "factor": 4.0})
    assert seq_len_limit(scaled) == 1024 and seq_len_limit(tiny_config("qwen2", layers=2)) == 256
    yarn = transformers.Qwen2Config(max_position_embeddings=256, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    assert seq_len_limit(yarn) == 512


def test_unwritable_outputs_are_refused_before_loading(checkpoint, config_dir, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")  # a folder cannot be made under a file (root may write anywhere else)
    code, out, err = run_cli(capsys, "train", "--from-config", str(config_dir), "--data", "demo", "--out",
                             str(blocker / "run"), "--steps", "1", "--seq-len", "16", "--device", "cpu")
    assert code == 2 and str(blocker / "run") in one_error(err) and "model:" not in out
    code, out, err = run_cli(capsys, "eval", str(checkpoint), "--data", "demo", "--seq-len", "16", "--device", "cpu",
                             "--json", str(blocker / "result.json"))
    assert code == 2 and str(blocker / "result.json") in one_error(err) and "eval:" not in out
    # an existing --json file is kept unless --overwrite
    existing = tmp_path / "result.json"
    existing.write_text("{}")
    code, out, err = run_cli(capsys, "eval", str(checkpoint), "--data", "demo", "--seq-len", "16", "--device", "cpu",
                             "--json", str(existing))
    assert code == 2 and "--overwrite" in one_error(err) and existing.read_text() == "{}" and "eval:" not in out


def test_malformed_config_json_and_run_toml_name_the_file(config_dir, tmp_path, capsys):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "qwen2", "hidden_size": 64,,}')
    code, _, err = run_cli(capsys, "train", "--from-config", str(broken), "--data", "demo", "--out",
                           str(tmp_path / "o"), "--seq-len", "16")
    assert code == 2 and str(broken / "config.json") in one_error(err)
    code, _, err = run_cli(capsys, "train", str(broken), "--data", "demo", "--out", str(tmp_path / "o"), "--seq-len",
                           "16")
    assert code == 2 and str(broken / "config.json") in one_error(err)
    (broken / "config.json").write_text('{"hidden_size": 64}')  # no model_type
    code, _, err = run_cli(capsys, "train", "--from-config", str(broken), "--data", "demo", "--out",
                           str(tmp_path / "o"), "--seq-len", "16")
    assert code == 2 and str(broken / "config.json") in one_error(err) and "model_type" in err
    (broken / "config.json").write_text(json.dumps({**tiny_config("qwen2", layers=2).to_dict(), "hidden_size": "64x"}))
    code, _, err = run_cli(capsys, "train", "--from-config", str(broken), "--data", "demo", "--out",
                           str(tmp_path / "o"), "--seq-len", "16")
    line = one_error(err)
    assert code == 2 and str(broken / "config.json") in line and "hidden_size" in line
    toml = tmp_path / "run.toml"
    for text, key in (('steps = "six"', "steps"), ("lr = true", "lr"), ('target_modules = [1, 2]', "target_modules"),
                      ("pack = 1", "pack")):
        toml.write_text(f'from_config = "{config_dir}"\ndata = "demo"\n{text}\n')
        code, _, err = run_cli(capsys, "train", "--config", str(toml), "--out", str(tmp_path / "o"))
        line = one_error(err)
        assert code == 2 and str(toml) in line and key in line, line
    assert not (tmp_path / "o").exists()


def test_target_modules_that_match_nothing_are_refused(config_dir, tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", "--from-config", str(config_dir), "--data", "demo", "--out",
                             str(tmp_path / "o"), "--seq-len", "16", "--device", "cpu",
                             "--target-modules", "q_proj,nonexistent")
    line = one_error(err)
    assert code == 2 and "nonexistent" in line and "v_proj" in line and "down_proj" in line and "model:" not in out
    assert split_targets("all-linear") == ["all-linear"] and split_targets(["q_proj,v_proj", "o_proj"]) == [
        "q_proj", "v_proj", "o_proj"]
    assert target_modules("all-linear", "qwen2") == lora_targets("qwen2")
    tuner = poros_fx.FineTuner.from_pretrained(str(config_dir), quantization="bf16", device="cpu",
                                               target_modules="q_proj", lora_rank=2)
    assert tuner.session.targets == ["q_proj"]
    assert {n.split(".")[-4] for n, p in tuner.model.named_parameters() if p.requires_grad} == {"q_proj"}


def test_finetuner_save_writes_absolute_paths(checkpoint, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tuner = poros_fx.FineTuner.from_pretrained(os.path.relpath(checkpoint, tmp_path), quantization="bf16",
                                               device="cpu", lora_rank=2)
    tuner.save("saved")
    settings = dict(line.split(" = ", 1) for line in (tmp_path / "saved" / "run.toml").read_text().splitlines()
                    if " = " in line)
    assert json.loads(settings["model"]) == str(checkpoint.resolve())


def test_output_off_a_terminal_is_not_wrapped(capsys):
    console.print("word " * 40 + "end", highlight=False)
    assert capsys.readouterr().out.strip().count("\n") == 0


def test_a_folder_without_saved_state_is_not_a_run(config_dir, tmp_path, capsys):
    """What a kill before the first save leaves (metrics of the finished steps, a save's temporary folder):
    a plain re-run reuses the folder, --resume says to start again, and suggested commands are quoted."""
    stopped = tmp_path / "my run"
    (stopped / ".poros-save-abc").mkdir(parents=True)
    (stopped / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    code, _, err = run_cli(capsys, "train", "--resume", str(stopped))
    line = one_error(err)
    assert code == 2 and "before its first save" in line and "not written by" not in line
    claim_out(stopped, overwrite=False)
    assert not any(stopped.iterdir())
    # a folder of other files is still refused, its commands shell-quoted
    (stopped / "notes.txt").write_text("mine")
    code, _, err = run_cli(capsys, "train", "--from-config", str(config_dir), "--data", "demo", "--out", str(stopped),
                           "--seq-len", "16")
    assert code == 2 and f"--resume '{stopped}'" in one_error(err)
    _, out, _ = run_cli(capsys, "train", "--help")
    words = " ".join(out.split())
    assert "on Ctrl-C or SIGTERM" in words and "stopped before its first save" in words


def test_sigterm_saves_like_ctrl_c_and_resume_cleans_up(config_dir, tmp_path, capsys):
    """SIGTERM (a job scheduler's stop) saves the last finished step and exits 130, its message's command
    shell-quoted; --resume then cuts metrics.jsonl back to the saved step and removes stale temporary folders."""
    out = tmp_path / "my run"
    args = ("--from-config", str(config_dir), "--data", "demo", "--seq-len", "16", "--batch-size", "2", "--device",
            "cpu", "--quantization", "bf16", "--lora-r", "2", "--log-every", "1")
    env = {"COLUMNS": "200", "PATH": str(SCRIPT.parent), "HF_HUB_OFFLINE": "1",
           "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    if "PYTHONPATH" in os.environ:  # a checkout run without installing it
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    proc = subprocess.Popen([str(SCRIPT), "train", *args, "--out", str(out), "--steps", "300"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 300
        for line in proc.stdout:
            if line.startswith("step 2/300") or time.monotonic() > deadline:
                break
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout + stderr
    meta = json.loads(__import__("safetensors").safe_open(out / STATE_FILE, "pt").metadata()["poros_fx_train_state"])
    done = meta["step"]
    assert 2 <= done < 300 and f"interrupted: step {done}/300 saved to" in stderr
    assert f"poros-fx train --resume '{out}'" in stderr and "Traceback" not in stderr
    # as a kill after the save leaves it: metrics of steps past the save, a save's temporary folder
    with (out / "metrics.jsonl").open("a") as f:
        for step in range(done + 1, done + 4):
            f.write(json.dumps({"step": step, "loss": 1.0}) + "\n")
    (out / ".poros-save-stale").mkdir()
    code, _, err = run_cli(capsys, "train", "--resume", str(out), "--steps", str(done + 1))
    assert code == 0, err
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    # (the signal may come between a step's save and its metrics line: that line may be missing)
    assert steps == sorted(set(steps)) and steps[-1] == done + 1 and set(range(1, done)) <= set(steps)
    assert not list(out.glob(".poros-save-*"))
