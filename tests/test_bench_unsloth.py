"""Unsloth in the bench, on the CPU: the checkpoint it loads, the worker's command line and process, the row
merge, and the clean "skipped" row when Unsloth cannot be imported (it needs a GPU: the real runs are the
lead's). A stand-in ``unsloth`` package (plain transformers + PEFT behind ``FastLanguageModel``'s two
calls) lets the worker process run end to end here.
"""

import dataclasses
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import transformers

from poros_fx.io.loader import from_config
from poros_fx.prepare import unprepare
from poros_fx import bench
from poros_fx.bench import unsloth
from poros_fx.bench.config import RowSpec
from poros_fx.bench.unsloth_worker import METHODS as UNSLOTH_METHODS, UNSLOTH_FIRST
from poros_fx.models.tiny import tiny_config

FAKE_UNSLOTH = textwrap.dedent('''
    """A stand-in for Unsloth's FastLanguageModel (tests only): records its arguments, trains plain PEFT."""
    import json, os, sys
    TRANSFORMERS_FIRST = "transformers" in sys.modules  # Unsloth must be imported before transformers
    __version__ = "fake"

    def _record(call, **kwargs):
        with open(os.environ["FAKE_UNSLOTH_LOG"], "a") as f:
            f.write(json.dumps({"call": call, "transformers_first": TRANSFORMERS_FIRST, **kwargs}) + "\\n")

    class FastLanguageModel:
        @staticmethod
        def from_pretrained(model_name, max_seq_length, dtype, load_in_4bit, local_files_only, **kwargs):
            import transformers
            _record("from_pretrained", model_name=model_name, max_seq_length=max_seq_length,
                    load_in_4bit=load_in_4bit, local_files_only=local_files_only, **kwargs)
            model = transformers.AutoModelForCausalLM.from_pretrained(model_name, dtype=dtype,
                                                                      local_files_only=local_files_only)
            return model, transformers.AutoTokenizer.from_pretrained(model_name, local_files_only=local_files_only)

        @staticmethod
        def get_peft_model(model, r, lora_alpha, lora_dropout, target_modules, use_gradient_checkpointing,
                           random_state, **kwargs):
            import peft, torch
            _record("get_peft_model", r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                    target_modules=target_modules, use_gradient_checkpointing=use_gradient_checkpointing)
            torch.manual_seed(random_state)
            config = peft.LoraConfig(r=r, lora_alpha=lora_alpha, lora_dropout=lora_dropout,
                                     target_modules=target_modules)
            return peft.get_peft_model(model, config)
''')


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the worker processes too: the machine's cores are shared
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _config(tmp_path: Path, methods: str, **kwargs) -> bench.BenchConfig:
    return bench.make_config(models="tiny", methods=methods, seqs="32", accums="1", steps=2, warmup=1, device="cpu",
                             json_path=tmp_path / "bench.json", checkpoints=tmp_path / "ckpt", command="test", **kwargs)


def test_checkpoint_round_trip_and_worker_command(tmp_path):
    """The NF4 checkpoint loads back through transformers into the very tensors from_config made (packed
    weights and quant state); a tied bf16 one keeps one embedding; a second write reuses the folder."""
    config = tiny_config("qwen2", layers=2)
    written = unsloth.write_checkpoint(config, tmp_path / "nf4", "nf4", seed=3, device="cpu")
    reference = unprepare(from_config(config, "nf4", device="cpu", seed=3, lora=None, progress=False)).state_dict()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "nf4", local_files_only=True,
                                                               device_map="cpu").state_dict()
    assert set(loaded) == set(reference) and any(k.endswith("quant_state.bitsandbytes__nf4") for k in loaded)
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    assert json.loads((tmp_path / "nf4" / "config.json").read_text())["quantization_config"]["load_in_4bit"]
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "nf4", local_files_only=True).eos_token == "<eos>"
    assert unsloth.write_checkpoint(config, tmp_path / "nf4", "nf4", seed=3, device="cpu") == written  # reused

    tied = tiny_config("qwen2", layers=2, tie_word_embeddings=True)
    unsloth.write_checkpoint(tied, tmp_path / "bf16", "bf16", seed=3, device="cpu")
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", local_files_only=True)
    reference = unprepare(from_config(tied, "bf16", device="cpu", seed=3, lora=None, progress=False)).state_dict()
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())

    assert unsloth.checkpoint_format("qwen2.5-7b") == "bf16" and unsloth.checkpoint_format("qwen2.5-32b") == "nf4"
    spec = RowSpec("qwen2.5-7b", "unsloth_offload", None, 512, 4)
    config = dataclasses.replace(_config(tmp_path, "unsloth_offload", unsloth_offload_layers=20),
                                 device_memory_cap="24GB")  # make_config refuses a cap on the CPU
    command = unsloth.worker_command(spec, config, Path("/o.json"))
    # Unsloth imported before the poros-fx command line (which imports transformers), then the hidden worker
    assert command[:3] == [sys.executable, "-c", UNSLOTH_FIRST] and command[3:6] == ["bench", "--worker", "unsloth"]
    assert UNSLOTH_FIRST.index("import unsloth") < UNSLOTH_FIRST.index("poros_fx")
    args = dict(zip(command[6::2], command[7::2]))
    assert args == {"--models": "qwen2.5-7b", "--methods": "unsloth_offload", "--seqs": "512", "--accums": "4",
                    "--steps": "2", "--warmup": "1", "--device": "cpu",
                    "--checkpoints": str(tmp_path / "ckpt"), "--json": "/o.json", "--unsloth-offload-layers": "20",
                    "--device-memory-cap": "24GB"}  # the worker caps its own process as the bench caps its


def test_unsloth_rows_run_in_their_own_process_or_skip(tmp_path, monkeypatch):
    """Without Unsloth: a "skipped" row, no checkpoint written, the run goes on. With the stand-in: each row
    in a worker process that imports unsloth before transformers, loads the checkpoint by absolute path with
    local_files_only, asks each method's options, and its row merges beside ours."""
    monkeypatch.chdir(Path(__file__).resolve().parents[1])  # the worker processes import this checkout
    doc = bench.run(_config(tmp_path, "unsloth_resident,peft_resident"), log=lambda s: None)
    rows = {r["method"]: r for r in doc["rows"]}
    assert rows["unsloth_resident"]["error"].startswith("skipped: unsloth not importable")
    assert rows["peft_resident"]["error"] is None and not (tmp_path / "ckpt").exists()
    assert "unsloth_* rows" in (tmp_path / "bench.md").read_text()

    fake = tmp_path / "fake"
    (fake / "unsloth").mkdir(parents=True)
    (fake / "unsloth" / "__init__.py").write_text(FAKE_UNSLOTH)
    calls = tmp_path / "calls.jsonl"
    monkeypatch.syspath_prepend(str(fake))
    monkeypatch.setenv("PYTHONPATH", f"{fake}")
    monkeypatch.setenv("FAKE_UNSLOTH_LOG", str(calls))
    # two of the three methods (a worker process each); unsloth_checkpointing differs from unsloth_offload
    # only in the option its worker passes, checked below
    doc = bench.run(_config(tmp_path, "unsloth_resident,unsloth_offload"), log=lambda s: None)
    rows = {r["method"]: r for r in doc["rows"]}
    assert set(rows) == {"peft_resident", "unsloth_resident", "unsloth_offload"}
    folder = unsloth.checkpoint_dir(tmp_path / "ckpt", "tiny", 0)
    for name in ("unsloth_resident", "unsloth_offload"):
        r = rows[name]
        assert r["error"] is None and r["unsloth"] == "fake" and r["steps"] == 2 and r["run"] == 2
        assert r["s_per_step"] > 0 and r["compile_s"] is not None and torch.isfinite(torch.tensor(r["loss"]))
        assert r["checkpoint"]["path"] == str(folder) and r["checkpoint"]["format"] == "bf16"
    logged = [json.loads(line) for line in calls.read_text().splitlines()]
    assert not any(c["transformers_first"] for c in logged)
    loads = [c for c in logged if c["call"] == "from_pretrained"]
    assert all(c["model_name"] == str(folder) and c["local_files_only"] and c["load_in_4bit"] for c in loads)
    assert [c.get("offload_layers") for c in loads] == [None, 2]  # tiny: 2 decoder layers, all swapped
    peft_calls = [c for c in logged if c["call"] == "get_peft_model"]
    assert [c["use_gradient_checkpointing"] for c in peft_calls] == [False, "unsloth"]
    assert UNSLOTH_METHODS["unsloth_checkpointing"] == {"use_gradient_checkpointing": "unsloth",
                                                                      "offload": False}
    assert all(c["r"] == 16 and c["lora_alpha"] == 32 and c["lora_dropout"] == 0 and len(c["target_modules"]) == 7
               for c in peft_calls)
    md = (tmp_path / "bench.md").read_text()
    assert "| tiny | unsloth_offload | - | 32 | 1 |" in md and "| tiny | peft_resident | - | 32 | 1 |" in md

    # a checkpoint that cannot be written fails its row, not the run
    (tmp_path / "not-a-folder").write_text("")
    config = bench.make_config(models="tiny", methods="unsloth_resident,peft_resident", seqs="32", accums="1", steps=1,
                               warmup=1, device="cpu", json_path=tmp_path / "b2.json",
                               checkpoints=tmp_path / "not-a-folder")
    rows = {r["method"]: r for r in bench.run(config, log=lambda s: None)["rows"]}
    assert rows["unsloth_resident"]["error"].startswith(("NotADirectoryError", "FileExistsError"))
    assert rows["peft_resident"]["error"] is None

    # the worker alone, without the stand-in on its path: the skipped row is the worker's own answer too
    monkeypatch.setenv("PYTHONPATH", "")
    out = tmp_path / "row.json"
    subprocess.run(unsloth.worker_command(RowSpec("tiny", "unsloth_resident", None, 32, 1),
                                          _config(tmp_path, "unsloth_resident"), out), check=True)
    assert json.loads(out.read_text())["error"].startswith("skipped: unsloth not importable (ModuleNotFoundError")
