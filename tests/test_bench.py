"""The benchmark harness on CPU with the tiny model: outputs, merging, failing rows, the no-GPU exit.

Only the shape of the results is checked; no timing is ever asserted.
"""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from train_helper import run_cli

from poros_fx import bench
from poros_fx.handles import get_store

TINY = {"models": "tiny", "seqs": "32", "accums": "1", "steps": 2, "warmup": 1, "device": "cpu"}
ROW_KEYS = {"model", "method", "block_size", "seq", "accum", "s_per_step", "peak_gb", "h2d_gbps", "floor_s",
            "compile_s", "ratio_vs_peft_resident", "error"}


@pytest.fixture(autouse=True)
def _one_thread():
    # the test machine's cores are shared: OpenMP's spinning threads make a tiny model ~100x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _run(tmp_path: Path, methods: str = "peft_resident,poros", extra: dict | None = None, **kwargs) -> dict:
    options = {**TINY, "block_sizes": "1", **kwargs}
    known = {**bench.METHODS, **(extra or {})}
    config = bench.make_config(methods=methods, json_path=tmp_path / "bench.json", command="test", known_methods=known,
                               **options)
    lines: list[str] = []
    doc = bench.run(config, methods=known, log=lines.append)
    doc["log"] = lines
    return doc


def _rows(doc: dict) -> dict:
    return {(r["method"], r["block_size"], r["seq"], r["accum"]): r for r in doc["rows"]}


def test_smoke_run_writes_json_markdown_and_plot(tmp_path):
    doc = _run(tmp_path)
    on_disk = json.loads((tmp_path / "bench.json").read_text())
    assert on_disk["rows"] == doc["rows"]
    env = on_disk["env"]
    for key in ("device", "gpu", "torch", "transformers", "peft", "bitsandbytes", "pinned_h2d_gbps", "pinned_d2h_gbps",
                "commands"):
        assert key in env
    assert env["device"] == "cpu" and env["gpu"] is None and env["pinned_h2d_gbps"] is None and env["pinned_d2h_gbps"] is None
    rows = _rows(doc)
    assert set(rows) == {("peft_resident", None, 32, 1), ("poros", 1, 32, 1)}
    for r in doc["rows"]:
        assert ROW_KEYS <= set(r)
        assert r["error"] is None and r["model"] == "tiny" and r["steps"] == 2
        assert r["s_per_step"] > 0 and r["peak_gb"] is None and r["floor_s"] is None and r["wall_s"] is not None
        assert r["streamed_gb"] <= r["base_gb"]  # the embedding table is gathered, not streamed
        assert 0 < r["host_rss_gb"] <= r["host_peak_rss_gb"]  # this process's, the host store's pinned pages in it
    assert "tiny" in env["runs"][-1]["build_s"]
    peft, poros = rows[("peft_resident", None, 32, 1)], rows[("poros", 1, 32, 1)]
    assert peft["ratio_vs_peft_resident"] == 1.0
    assert poros["ratio_vs_peft_resident"] == pytest.approx(poros["s_per_step"] / peft["s_per_step"], rel=1e-3)
    assert peft["h2d_gbps"] is None and peft["compile_s"] is None
    assert poros["h2d_gbps"] is not None and poros["compile_s"] is not None
    # where the first step's seconds went: Dynamo's frame compile (which holds our region trace) and ours
    phases = poros["first_step_phases"]
    # (the region trace may be 0 here: conftest keeps traced regions for the session, and an earlier test
    # may have traced this structure; the warm process below always traces)
    assert phases["dynamo"]["entire_frame_compile"] >= phases["poros"]["region_trace_s"] >= 0
    assert phases["dynamo"]["entire_frame_compile"] > 0
    assert phases["poros"]["joint_trace_s"] > 0 and phases["poros"]["backward_first_run_s"] > 0
    assert "first_step_phases" not in peft
    md = (tmp_path / "bench.md").read_text()
    assert "| tiny | poros | 1 | 32 | 1 |" in md and "| tiny | peft_resident | - | 32 | 1 |" in md and "test" in md
    png = (tmp_path / "bench.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def _raise(model, block_size):
    raise RuntimeError("injected failure\nsecond line not recorded")


def test_merge_and_failing_row(tmp_path):
    """A second run replaces rows with the same key and adds new ones; a method that raises is recorded
    with its error and the rows after it still run."""
    _run(tmp_path, methods="peft_resident")
    boom = bench.Method("boom", "prepared", _raise)
    second = _run(tmp_path, methods="boom,peft_resident", extra={"boom": boom}, seqs="32,16")
    rows = _rows(second)
    assert len(second["rows"]) == 4  # the (peft_resident, 32, 1) row replaced, not duplicated
    assert set(rows) == {("peft_resident", None, 32, 1), ("peft_resident", None, 16, 1), ("boom", None, 32, 1),
                         ("boom", None, 16, 1)}
    assert rows[("boom", None, 32, 1)]["error"] == "RuntimeError: injected failure"
    assert rows[("boom", None, 32, 1)]["failed_at"][-1].endswith(" _raise")  # where it failed, innermost last
    assert rows[("boom", None, 32, 1)]["host_available_gb_at_failure"] > 0  # the host's memory then (Linux)
    assert second["env"]["runs"][-1]["host_ram_gb"] >= second["env"]["runs"][-1]["host_available_gb"] > 0
    assert rows[("boom", None, 32, 1)]["s_per_step"] is None and rows[("boom", None, 32, 1)]["ratio_vs_peft_resident"] is None
    assert rows[("peft_resident", None, 16, 1)]["error"] is None
    assert rows[("peft_resident", None, 16, 1)]["ratio_vs_peft_resident"] == 1.0
    assert json.loads((tmp_path / "bench.json").read_text())["env"]["commands"] == ["test"]
    assert {r["run"] for r in second["rows"]} == {2}  # every row of the matrix now comes from run 2
    assert "RuntimeError: injected failure" in (tmp_path / "bench.md").read_text()


def test_ratio_is_against_the_same_runs_baseline_or_marked():
    """A row's ratio divides by its own run's peft_resident; a row kept from an older run (its
    baseline since replaced) is divided by the newer one and marked, in the JSON and the markdown."""
    def row(method, run, s, block_size=None, model="m"):
        return {"model": model, "method": method, "block_size": block_size, "seq": 512, "accum": 1, "s_per_step": s,
                "peak_gb": None, "h2d_gbps": None, "floor_s": None, "compile_s": None, "error": None, "run": run}
    rows = [row("peft_resident", 3, 0.5), row("poros", 3, 1.0, 1), row("poros", 1, 2.0, 2), row("poros", 2, 1.0, 1, "n")]
    bench.ratios(rows)
    assert [r["ratio_vs_peft_resident"] for r in rows] == [1.0, 2.0, 4.0, None]
    assert [r.get("ratio_cross_run", False) for r in rows] == [False, False, True, False]
    md = bench.markdown({"env": {"runs": [{"command": "a"}, {"command": "b"}, {"command": "c"}]}, "rows": rows})
    assert "    [3] c" in md
    assert "| m | poros | 2 | 512 | 1 | 2.000 | - | - | - | - | - | - | 4.00* | 1 |  |" in md
    assert "| m | poros | 1 | 512 | 1 | 1.000 | - | - | - | - | - | - | 2.00 | 3 |  |" in md


def test_time_budget_stops_before_new_rows(tmp_path):
    doc = _run(tmp_path, time_budget=0.0)
    assert doc["rows"] == []
    assert any("time budget" in line for line in doc["log"])
    assert "time budget of 0 s exceeded" in doc["env"]["runs"][-1]["stopped"]
    assert "Run 1 stopped early: time budget" in (tmp_path / "bench.md").read_text()
    assert (tmp_path / "bench.png").exists()


def test_plan_grid_and_restrictions():
    config = bench.make_config(models="0.5b,qwen2.5-72b", methods="poros,peft_resident", seqs="512,2048",
                               accums="1,4", compiled_resident=True)
    assert bench.shapes(config) == [(512, 1), (2048, 1), (512, 4)]
    specs, notes = bench.plan(config)
    assert notes == ["compiled_resident skipped for qwen2.5-72b (only tiny, qwen2.5-0.5b, qwen2.5-7b)"]
    small = [s for s in specs if s.model == "qwen2.5-0.5b"]
    assert len(small) == 3 * (3 + 1 + 1)  # per pair: poros x 3 block sizes, peft_resident, compiled_resident
    assert len([s for s in specs if s.model == "qwen2.5-72b"]) == 3 * 4
    full = bench.make_config(seqs="512,2048", accums="1,4", grid="full")
    assert len(bench.shapes(full)) == 4
    with pytest.raises(ValueError, match="unknown model"):
        bench.make_config(models="13b")
    with pytest.raises(ValueError, match="unknown method"):
        bench.make_config(methods="nope")


def test_no_gpu_exits_2(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = run_cli(capsys, "bench")  # the command, in this process (a subprocess costs ~8 s of imports)
    assert code == 2
    assert "needs a CUDA GPU; use --device cpu --models tiny for a smoke run" in out + err


def test_compile_warm_runs_the_row_again_in_a_second_process(tmp_path, monkeypatch):
    """--compile-warm: the row's first step in a fresh Inductor cache (cold), then the same row in a second
    process with that cache (warm); both in the JSON and the markdown. (Inductor's cache hits across
    processes: tests/test_compile_cache.py.)"""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the second process imports this checkout
    doc = _run(tmp_path, methods="peft_resident,poros_eager", compile_warm=True)
    rows = _rows(doc)
    row = rows[("poros_eager", 1, 32, 1)]
    assert row["error"] is None and row["warm_process"]["error"] is None
    assert row["first_step_cold_s"] == row["first_step_s"] and row["compile_cold_s"] == row["compile_s"]
    assert row["first_step_warm_s"] > 0 and row["compile_warm_s"] is not None
    assert row["warm_process"]["s_per_step"] > 0 and "compile_cache" in row
    assert row["warm_process"]["first_step_phases"]["poros"]["region_trace_s"] > 0  # traced again: a new process
    assert "first_step_warm_s" not in rows[("peft_resident", None, 32, 1)]  # not compiled: one process
    md = (tmp_path / "bench.md").read_text()
    assert f"| {row['first_step_warm_s']:.1f} / {row['compile_warm_s']:.1f} |" in md and "--compile-warm" in md


def test_every_option_has_its_one_help_and_is_listed(capsys):
    """`poros-fx bench` is the one entry point: each option's help is bench.HELP's (one text per option), and
    --help lists every option but the hidden worker's."""
    import typer

    from poros_fx.cli import app as cli_module

    command = typer.main.get_command(cli_module.app).commands["bench"]
    helps = {p.opts[0].removeprefix("--").replace("-", "_"): p.help for p in command.params}
    assert helps == bench.HELP
    code, out, err = run_cli(capsys, "bench", "--help")
    assert code == 0 and not err
    flags = {o for p in command.params if not p.hidden for o in p.opts}
    assert {"--nproc", "--rows", "--layers", "--quantization", "--row-timeout", "--batch", "--memory-budget"} <= flags
    assert all(flag in out for flag in flags) and "--worker" not in out


@pytest.mark.parametrize("args,says", [
    (("--grid", "diagonal"), "--grid must be star or full"),
    (("--methods", "nope"), "unknown method(s) ['nope']"),
    (("--steps", "0"), "'--steps'"),
    (("--layers", "2"), "--layers applies to the multi-GPU rows only: give --nproc N too"),
    (("--batch", "2", "--rows", "poros:1"), "--rows and --batch apply to the multi-GPU rows only"),
    (("--nproc", "2", "--methods", "peft_resident"), "unknown multi-GPU method(s) ['peft_resident']"),
    (("--nproc", "2", "--rows", "poros:0"), "--rows: 'poros:0' is not method:nproc"),
    (("--nproc", "2", "--compile-warm"), "--compile-warm does not apply to the multi-GPU rows (--nproc)"),
    (("--worker", "other"), "--worker must be one of multi-gpu, unsloth"),
    (("--device-memory-cap", "24GB"), "--device-memory-cap caps CUDA memory; leave it out with --device cpu"),
    (("--nproc", "2", "--sequence-chunks", "4"), "--sequence-chunks does not apply to the multi-GPU rows"),
    (("--expert-lora",), "--expert-lora adapts a mixture of experts' experts; none of tiny has any"),
])
def test_a_bad_option_is_one_error_line(capsys, args, says):
    code, out, err = run_cli(capsys, "bench", "--device", "cpu", "--models", "tiny", *args)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], (args, err)
    assert "bench:" not in out  # refused before any row


def test_saved_activation_rows_run(tmp_path):
    """poros_saved (every layer block keeps its activations) and poros_budget_saved (and a budget keeps the
    blocks): rows without errors, the second copying less once its plan is made."""
    doc = _run(tmp_path, methods="poros_saved,poros_budget_saved", memory_budget="1GB", steps=3)
    rows = _rows(doc)
    saved, kept = rows[("poros_saved", 1, 32, 1)], rows[("poros_budget_saved", 1, 32, 1)]
    assert saved["error"] is None and kept["error"] is None
    # tiny: 1GB keeps every block, copied once after the plan is made; streamed, every step copies
    assert kept["resident_blocks"] > 0 and kept["copies_per_step"] < saved["copies_per_step"]


def test_sequence_chunk_rows_trace_chunked_layers_and_give_the_model_back_whole(tmp_path):
    """--sequence-chunks K: the streamed rows' layers run in K token chunks (the row says so), the resident
    rows and the next run see the layers whole again."""
    config = bench.make_config(**{**TINY, "block_sizes": "1"}, methods="poros,peft_resident", sequence_chunks=2,
                               json_path=tmp_path / "bench.json", command="test")
    seen = []
    chunks_of = lambda model: get_store(model).sequence_chunks if get_store(model) is not None else None  # noqa: E731

    def peft_watching(model, block_size):
        seen.append(("resident", chunks_of(model)))
        return bench.METHODS["peft_resident"].setup(model, block_size)

    def poros_watching(model, block_size):
        seen.append(("streamed", chunks_of(model)))
        return bench.METHODS["poros"].setup(model, block_size)

    methods = {"poros": dataclasses.replace(bench.METHODS["poros"], setup=poros_watching),
               "peft_resident": dataclasses.replace(bench.METHODS["peft_resident"], setup=peft_watching)}
    doc = bench.run(config, methods=methods, log=lambda s: None)
    rows = _rows(doc)
    assert rows[("poros", 1, 32, 1)]["error"] is None and rows[("poros", 1, 32, 1)]["sequence_chunks"] == 2
    assert "sequence_chunks" not in rows[("peft_resident", None, 32, 1)]
    assert seen == [("streamed", 2), ("resident", None)]
    assert "| tiny | poros (chunks 2) | 1 | 32 | 1 |" in bench.markdown(doc)


def test_a_bf16_row_runs_on_a_bf16_build_after_the_nf4_models_rows(tmp_path):
    """peft_resident_bf16 (a mixture of experts' bf16 experts, say): its rows come after every NF4 row of the
    model and run on a model built with a bf16 base; each row says its base."""
    config = bench.make_config(models="0.5b", methods="peft_resident_bf16,poros,peft_resident", seqs="512,2048",
                               accums="1", block_sizes="1")
    specs, _ = bench.plan(config)
    assert [s.method for s in specs][-2:] == ["peft_resident_bf16"] * 2
    assert "peft_resident_bf16" not in [s.method for s in specs][:-2]
    doc = _run(tmp_path, methods="peft_resident,peft_resident_bf16")
    rows = _rows(doc)
    assert rows[("peft_resident", None, 32, 1)]["quantization"] == "nf4"
    assert rows[("peft_resident_bf16", None, 32, 1)]["quantization"] == "bf16"
    assert rows[("peft_resident_bf16", None, 32, 1)]["error"] is None
    assert [line for line in doc["log"] if line.startswith("building")] == [
        "building tiny (random-init nf4, from_config) on cpu", "building tiny (random-init bf16, from_config) on cpu"]
