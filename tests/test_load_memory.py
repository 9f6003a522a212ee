"""benchmarks/scripts/load_memory.py end to end on the CPU: a tiny checkpoint written, loaded and measured in child
processes, the JSON and markdown written."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "scripts" / "load_memory.py"


def test_load_memory_runs_on_cpu_with_a_tiny_shape(tmp_path):
    out, work = tmp_path / "out", tmp_path / "work"
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--shape", "tiny", "--cases", "ckpt-0.5b,config-32b",
           "--workdir", str(work), "--out", str(out), "--time-budget", "300"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert done.returncode == 0, done.stderr[-4000:]

    doc = json.loads((out / "load_memory.json").read_text())
    assert doc["env"]["torch"]
    assert doc["env"]["gpu_name"] is None
    rows = {r["case"]: r for r in doc["rows"]}
    assert list(rows) == ["ckpt-tiny", "config-tiny"], rows  # --shape tiny replaced both sizes
    for case, row in rows.items():
        assert row["status"] == "ok", (case, row.get("error"), row.get("traceback"))
        assert row["base_bytes"] > 0
        assert row["base_bytes"] == row["expected_base_bytes"]  # the loader's estimate is exact
        assert row["layer_bytes"] > 0
        assert row["rss_peak_bytes"] > 0 and row["hwm_bytes"] > 0
        assert row["rss_ratio"] is not None
        assert row["device"] == "cpu"
        assert "gpu_max_allocated_bytes" not in row
        assert [m["phase"] for m in row["phases"]][-1] == "returned"
        assert "prepare start" in [m["phase"] for m in row["phases"]]
    assert rows["ckpt-tiny"]["write"]["files"] >= 1 and rows["ckpt-tiny"]["load_report"]["bytes_read"] > 0
    assert (work / "qwen25-tiny-bf16" / "config.json").is_file()

    md = (out / "load_memory.md").read_text()
    assert "benchmarks/scripts/load_memory.py --device cpu --shape tiny --cases ckpt-0.5b,config-32b" in md
    assert "| ckpt-tiny | ok |" in md and "| config-tiny | ok |" in md


def test_time_budget_skips_what_does_not_fit(tmp_path, monkeypatch):
    # the parent's decision, run in this process: a parent process of its own only added ~7 s of imports
    # (the test above runs the script as a command; its environment child still starts here)
    monkeypatch.chdir(ROOT)
    spec = importlib.util.spec_from_file_location("load_memory_script", SCRIPT)
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "out"
    assert script.main(["--device", "cpu", "--cases", "config-72b", "--workdir", str(tmp_path / "w"),
                        "--out", str(out), "--time-budget", "1"]) == 0
    (row,) = json.loads((out / "load_memory.json").read_text())["rows"]
    assert row["case"] == "config-72b" and row["status"] == "skipped" and "time budget" in row["error"]
