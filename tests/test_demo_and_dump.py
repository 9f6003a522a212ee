"""The demo (`poros-fx demo`), the adapter it writes, and the graph dumps."""

import pytest
import torch
from train_helper import run_cli

import poros_fx
from poros_fx.models.tiny import demo_batches, tiny_lora_model


def test_main_job_writes_a_standard_adapter(tmp_path, capsys):
    out = tmp_path / "adapter"
    code, printed, err = run_cli(capsys, "demo", "--steps", "3", "--layers", "2", "--out", str(out))
    assert code == 0, err
    assert "EXACT: torch.equal" in printed
    assert "loss=0.00e+00  weights=0.00e+00  grad_norms=0.00e+00  optimizer=0.00e+00" in printed
    assert (out / "adapter_model.safetensors").exists() and (out / "adapter_config.json").exists()

    import peft
    from safetensors.torch import load_file

    saved = load_file(out / "adapter_model.safetensors")
    fresh = tiny_lora_model("qwen2", layers=2, seed=0).get_base_model()  # an ordinary, unprepared model
    loaded = peft.PeftModel.from_pretrained(fresh, str(out))
    state = loaded.state_dict()
    for key, value in saved.items():
        match = [k for k in state if k.endswith(key.replace(".weight", ".default.weight").split("base_model.model.")[-1])]
        assert match and torch.equal(state[match[0]], value)
    loaded(**demo_batches(1)[0], use_cache=False)  # and it runs


def test_dump_writes_graphs_and_schedule(tmp_path):
    model = tiny_lora_model("llama", layers=2)
    poros_fx.prepare(model, device="cpu", block_size=2, prefetch=0)
    step_model = torch.compile(model, backend="poros", options={"dump": str(tmp_path)})
    step_model(**demo_batches(1)[0], use_cache=False).loss.backward()
    (folder,) = tmp_path.iterdir()
    names = sorted(p.name for p in folder.iterdir())
    assert names[0] == "00_joint.py" and "schedule.txt" in names
    for phase in ("forward", "backward"):
        for p in ("rng", "lower_rng", "prefetch", "residency"):
            assert any(n.endswith(f"_{phase}_{p}.py") for n in names), (phase, p, names)
    backward = next(folder.glob("*_backward_residency.py")).read_text()
    assert "run_with_rng_state_cpu" in backward and "load" in backward and "evict" in backward
    assert "higher_order" not in backward  # the RNG wrappers run as plain functions (passes/lower_rng.py)
    assert "cpu" in backward  # devices shown
    table = (folder / "schedule.txt").read_text()
    assert "layers.0-1" in table and "head" in table and "rng_slots" in table
    assert (folder / "timeline.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_timeline_data_follows_the_schedule_and_the_environment_asks_for_a_dump(tmp_path, monkeypatch):
    from poros_fx.prepare import get_store
    from poros_fx.compiler.timeline import build

    monkeypatch.setenv("POROS_FX_DUMP", str(tmp_path))  # a dump without the option
    model = tiny_lora_model("qwen2", layers=3)
    poros_fx.prepare(model, device="cpu", prefetch=1)
    torch.compile(model, backend="poros")(**demo_batches(1)[0], use_cache=False).loss.backward()
    assert (next(tmp_path.iterdir()) / "schedule.txt").exists()
    (schedule,) = get_store(model).schedules
    tl = build(schedule)
    assert len(tl.loads) == poros_fx.stats(model)["loads"]  # one step: every load the ledger saw is drawn
    assert len(tl.evicts) == poros_fx.stats(model)["evictions"]
    assert min(tl.memory) >= 0
    assert tl.peak[1] == max(tl.memory) > 0
    kinds = {k for _, k, _, _ in tl.spans}
    assert kinds == {"forward", "recompute", "backward"}
    # in the backward, layer blocks are recomputed in reverse order
    starts = {b: s for b, k, s, _ in sorted(tl.spans, key=lambda x: -x[2]) if k == "recompute"}
    assert starts[3] < starts[2] < starts[1]


def test_compiling_says_where_it_is(caplog):
    """A first step compiles for minutes at 32B: the phases are logged on the "poros_fx" logger."""
    import logging

    model = poros_fx.prepare(tiny_lora_model(layers=1), device="cpu")
    torch._dynamo.reset()
    with caplog.at_level(logging.INFO, logger="poros_fx"):
        torch.compile(model, backend="poros")(**demo_batches(1)[0], use_cache=False).loss.backward()
    text = caplog.text
    assert "Dynamo captured" in text and "host tensors" in text
    assert "joint graph of" in text and "min-cut (recompute per block)" in text
    assert "partitioned in" in text and "forward" in text and "backward" in text


def test_main_job_lists_its_options(capsys):
    code, out, err = run_cli(capsys, "demo", "--help")
    assert code == 0 and not err
    for flag in ("--family", "--nf4", "--layers", "--steps", "--accumulate", "--block-size", "--prefetch", "--device",
                 "--codegen", "--out"):
        assert flag in out, flag


@pytest.mark.parametrize("args,option,says", [
    (["--steps", "0"], "--steps", "greater than or equal to 1"),
    (["--accumulate", "0"], "--accumulate", "greater than or equal to 1"),
    (["--layers", "0"], "--layers", "greater than or equal to 1"),
    (["--block-size", "-2"], "--block-size", "greater than or equal to 1"),
    (["--steps", "ten"], "--steps", "valid integer"),
    (["--prefetch", "-1"], "--prefetch", "must be an integer >= 0"),
    (["--device", "tpu"], "--device", "must be cpu or cuda"),
    (["--codegen", "fast"], "--codegen", "must be inductor or eager"),
    (["--family", "gpt2"], "--family", "must be one of"),
])
def test_main_job_refuses_bad_options(args, option, says, capsys):
    """Refused before anything is built: exit 2 and one `error:` line naming the option."""
    code, out, err = run_cli(capsys, "demo", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: "), (args, err)
    assert f"'{option}'" in lines[0] and says in lines[0], lines[0]
    assert "parse_prefetch" not in err and "Traceback" not in err and "steps in" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a build or machine without CUDA")
def test_main_job_refuses_cuda_without_cuda(capsys):
    code, _, err = run_cli(capsys, "demo", "--device", "cuda")
    assert code == 2
    assert "'cuda' was asked for but torch sees no CUDA device" in err
