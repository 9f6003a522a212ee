"""The streaming options are declared once (``poros_fx/options.py``: ``PorosOptions``) and every surface
takes them from there: a new field must reach ``torch.compile``'s ``options``, ``@poros_fx.step``, the
trainers' ``poros_options``, ``prepare`` and the loaders (where it is set at prepare), and ``poros-fx
train`` / ``FineTuner`` / ``run.toml`` / ``--resume``. ``SAMPLES`` names a value other than the default
for each field; a field without one fails ``test_every_option_has_a_sample``."""

from __future__ import annotations

import dataclasses
from operator import attrgetter

import pytest
import transformers

import poros_fx
from poros_fx.errors import PorosConfigError
from poros_fx.handles import get_store
from poros_fx.io.loader import from_config
from poros_fx.models.tiny import tiny_config, tiny_lora_model
from poros_fx.options import (
    OPTION_NAMES,
    PREPARE_DEFAULTS,
    SAME_BITS_OPTIONS,
    PorosOptions,
    option_help,
)
from poros_fx.prepare import causal_lm

SAMPLES = {"block_size": 2, "prefetch": 0, "stream": False, "dump": "graph-dumps", "group_copies": False,
           "codegen": "inductor", "turnaround": False, "memory_budget": "1GB", "block_major": False,
           "chunked_loss": True, "offload_boundaries": True, "save_activations": 1, "cuda_graphs": False,
           "least_memory": True, "sequence_chunks": 2}
# where prepare() keeps each option it takes, on the model's host store (chunked_loss: on the model)
STORE_FIELDS = {"block_size": "host.block_size", "prefetch": "prefetch", "codegen": "codegen",
                "memory_budget": "budget.request", "block_major": "block_major",
                "offload_boundaries": "offload_boundaries", "sequence_chunks": "sequence_chunks"}


def test_every_option_has_a_sample_help_and_check():
    assert set(SAMPLES) == set(OPTION_NAMES)
    for f in dataclasses.fields(PorosOptions):
        assert option_help(f.name) and callable(f.metadata["check"]), f.name
        assert SAMPLES[f.name] != f.default, f.name
        PorosOptions.from_dict({f.name: SAMPLES[f.name]})


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_a_bad_value_is_refused_by_name(name):
    with pytest.raises(PorosConfigError, match=name):
        PorosOptions.from_dict({name: object()})


def test_the_resumable_options_leave_the_bits_alone():
    assert "codegen" not in SAME_BITS_OPTIONS and "chunked_loss" not in SAME_BITS_OPTIONS
    assert {"block_size", "prefetch", "memory_budget", "cuda_graphs", "least_memory"} <= set(SAME_BITS_OPTIONS)


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_every_option_reaches_step(name):
    @poros_fx.step(**{name: SAMPLES[name]})
    def train_step(model, batch):
        return model(**batch).loss

    assert train_step.options[name] == SAMPLES[name]


def test_step_refuses_an_unknown_option():
    with pytest.raises(PorosConfigError, match="unknown poros option"):
        poros_fx.step(block_sise=2)


def _trainer(tmp_path, options):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], max_steps=1)
    return poros_fx.PorosTrainer(model=tiny_lora_model("qwen2", layers=2), args=args,
                                 poros_options={**options, "device": "cpu"})


def test_every_option_reaches_the_trainer(tmp_path):
    everything = {k: v for k, v in SAMPLES.items() if k not in ("least_memory", "memory_budget", "cuda_graphs")}
    trainer = _trainer(tmp_path, everything)
    assert {k: trainer.poros_options[k] for k in everything} == everything
    store = get_store(trainer.model)
    for name, field in STORE_FIELDS.items():  # an unprepared model is prepared with the options prepare takes
        if name in everything:
            assert attrgetter(field)(store) == everything[name], name
    rest = {"least_memory": True, "cuda_graphs": False}
    assert {k: _trainer(tmp_path, rest).poros_options[k] for k in rest} == rest
    assert _trainer(tmp_path, {"memory_budget": "1GB"}).poros_options["memory_budget"] == "1GB"


@pytest.mark.parametrize("name", OPTION_NAMES)
def test_prepare_takes_its_options_and_refuses_the_others(name):
    model = tiny_lora_model("qwen2", layers=2)
    if name not in PREPARE_DEFAULTS:
        with pytest.raises(PorosConfigError, match=f"{name} is set when the model is compiled"):
            poros_fx.prepare(model, device="cpu", **{name: SAMPLES[name]})
        assert get_store(model) is None
        return
    poros_fx.prepare(model, device="cpu", **{name: SAMPLES[name]})
    if name == "chunked_loss":
        assert causal_lm(model)._poros_chunked_loss is True
    else:
        assert attrgetter(STORE_FIELDS[name])(get_store(model)) == SAMPLES[name]


def test_the_loaders_take_the_prepare_options_before_reading():
    config = tiny_config("qwen2", layers=2)
    given = {k: SAMPLES[k] for k in PREPARE_DEFAULTS}
    store = get_store(from_config(config, "bf16", device="cpu", progress=False, **given))
    for name, field in STORE_FIELDS.items():
        assert attrgetter(field)(store) == given[name], name
    with pytest.raises(PorosConfigError, match="save_activations is set when the model is compiled"):
        from_config(config, "bf16", device="cpu", progress=False, save_activations=1)
    with pytest.raises(PorosConfigError, match="block_size"):
        from_config(config, "bf16", device="cpu", progress=False, block_size=0)


def test_compile_takes_every_option():
    together = {k: v for k, v in SAMPLES.items() if k != "least_memory"}  # least_memory refuses a budget
    opts = PorosOptions.from_dict(together)
    assert {k: getattr(opts, k) for k in together} == together
    assert PorosOptions.from_dict({"least_memory": True}).least_memory is True


def test_every_option_is_a_run_option_and_a_flag(tmp_path, monkeypatch):
    """PorosOptions' fields are TrainOptions' (FineTuner, run.toml, --resume), and every one is a flag of
    `poros-fx train` that reaches the run with the value given."""
    import typer.main

    import poros_fx.cli.train as train_command
    from poros_fx.cli.app import app
    from poros_fx.training.options import CONFIG_KEYS, MODEL_OPTIONS, RESUMABLE, TrainOptions
    from poros_fx.training.options import OPTION_NAMES as RUN_OPTIONS

    assert set(OPTION_NAMES) <= set(RUN_OPTIONS) and set(OPTION_NAMES) <= set(CONFIG_KEYS)
    assert set(SAME_BITS_OPTIONS) <= set(RESUMABLE) and set(PREPARE_DEFAULTS) <= set(MODEL_OPTIONS)
    flags = {p.name for p in typer.main.get_command(app).commands["train"].params}
    assert set(RUN_OPTIONS) - {"model"} <= flags, set(RUN_OPTIONS) - flags
    runs = []
    monkeypatch.setattr(train_command, "train_run", lambda opts, **_: runs.append(opts))
    given = {k: v for k, v in SAMPLES.items() if k != "least_memory"}  # least_memory refuses a budget
    args = ["train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out", str(tmp_path / "run")]
    for name, value in given.items():
        flag = "--" + name.replace("_", "-")
        args += [flag if value else f"--no-{flag[2:]}"] if isinstance(value, bool) else [flag, str(value)]
    app(args, standalone_mode=False)
    assert isinstance(runs[0], TrainOptions)
    assert {k: getattr(runs[0], k) for k in given} == given
