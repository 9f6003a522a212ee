"""The surfaces under several ranks (CPU, gloo, 2 processes): ``@poros_fx.step`` with a DDP module,
``PorosTrainer`` under torch.distributed, and ``torchrun -m poros_fx train``. Per rank streamed ==
``stream=False`` bit for bit, one adapter on every rank. Ranks are started as in test_distributed.py."""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from test_distributed import EQUAL, _ok, run_ranks
from train_helper import run_cli
from poros_fx.exactness.parity import compare, format_diffs

# a rank's prepared models, kept until it exits: its later models of the same structure take the region from
# a live one instead of tracing it again (~6 s a model), as stream=False does in every in-process parity test
LIVE: list[torch.nn.Module] = []


def _step_run(rank: int, stream: bool) -> Any:
    """A 2-micro-batch @poros_fx.step over a DDP module: its parity Trace."""
    import poros_fx
    from poros_fx import distributed
    from poros_fx.exactness.parity import Trace, adamw, optimizer_step
    from poros_fx.models.tiny import demo_batches, tiny_lora_model

    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1, seed=0)
    poros_fx.prepare(model, device="cpu")
    LIVE.append(model)
    ddp = distributed.data_parallel(model)

    @poros_fx.step(accumulate=2, stream=stream)
    def train_step(m, batch):
        loss = m(**batch, use_cache=False).loss / 2
        loss.backward()
        return loss.detach()

    torch.manual_seed(1234)
    trace, opt = Trace(), adamw(model)
    params = [p for p in model.parameters() if p.requires_grad]
    data = demo_batches(4, seq=16, seed=100 + rank)
    for i in range(0, 4, 2):
        trace.losses += train_step(ddp, data[i:i + 2])
        optimizer_step(trace, params, opt)
    return trace


def _trainer_run(rank: int, stream: bool, out: str) -> list[torch.Tensor]:
    import transformers

    from poros_fx.hf import PorosTrainer
    from poros_fx.models.tiny import tiny_lora_model

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (16, 16), generator=g)

    class Rows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(ids)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"input_ids": ids[i], "labels": ids[i]}

    args = transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
                                          report_to=[], save_strategy="no", use_cpu=True, seed=0, logging_steps=1,
                                          gradient_accumulation_steps=2, ddp_find_unused_parameters=False)
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1, seed=0)
    LIVE.append(model)  # PorosTrainer prepares it
    trainer = PorosTrainer(model=model, args=args, train_dataset=Rows(), poros_options={"stream": stream})
    trainer.train()
    return [p.detach().clone() for p in model.parameters() if p.requires_grad]


def _surfaces(rank: int, world: int, out: str) -> dict[str, Any]:
    _unprepared_ddp(rank, world)  # raises unless refused; in these ranks, as starting two more costs ~10 s
    steps = [_step_run(rank, stream) for stream in (True, False)]
    trainer = [_trainer_run(rank, stream, os.path.join(out, f"t{rank}{stream}")) for stream in (True, False)]
    return {"step": compare(*steps), "step_weights": steps[0].weights[-1], "trainer": trainer}


def test_step_and_trainer_on_two_ranks(tmp_path):
    """@poros_fx.step over a DDP module of a prepared model (and refused over an unprepared one), and
    PorosTrainer: per rank streamed == stream=False, and the ranks agree."""
    for r, res in enumerate(ranks := _ok(run_ranks(_surfaces, tmp_path, str(tmp_path)))):
        assert res["step"] == EQUAL, format_diffs(f"rank {r}: @step streamed vs stream=False", res["step"])
        streamed, resident = res["trainer"]
        assert all(torch.equal(a, b) for a, b in zip(streamed, resident)), f"rank {r}: PorosTrainer"
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["step_weights"], ranks[1]["step_weights"]))
    assert all(torch.equal(a, b) for a, b in zip(ranks[0]["trainer"][0], ranks[1]["trainer"][0]))


def _unprepared_ddp(rank: int, world: int) -> None:
    import poros_fx
    from poros_fx.errors import PorosConfigError
    from poros_fx.models.tiny import demo_batches, tiny_lora_model

    ddp = torch.nn.parallel.DistributedDataParallel(tiny_lora_model("qwen2", layers=2))

    @poros_fx.step
    def train_step(m, batch):
        return m(**batch, use_cache=False).loss

    with pytest.raises(PorosConfigError, match="over an unprepared model"):
        train_step(ddp, demo_batches(1, seq=8)[0])


def test_cli_train_under_torchrun(tmp_path, capsys):
    from poros_fx.models.tiny import tiny_config

    tiny_config("qwen2", layers=2).save_pretrained(tmp_path / "config")
    out = tmp_path / "adapter"
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          "-m", "poros_fx", "train", "--from-config", str(tmp_path / "config" / "config.json"),
                          "--data", "demo", "--out", str(out), "--steps", "2", "--seq-len", "32", "--device", "cpu"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "COLUMNS": "200"})
    assert res.returncode == 0, res.stdout + res.stderr
    assert (out / "adapter_model.safetensors").exists()
    assert res.stdout.count("step 2/2") == 1  # rank 0 speaks for the job
    # the saved run was 2 ranks: each rank's data position depends on that, so one process (this one) refuses it
    code, stdout, stderr = run_cli(capsys, "train", "--resume", str(out), "--steps", "3")
    assert code != 0 and "continues a run of 2 rank(s)" in stdout + stderr
