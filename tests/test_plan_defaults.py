"""What a user gets with no options, and the options that change it: CUDA graphs on by default on CUDA
(``options.cuda_graphs_choice``), ``memory_budget="auto"`` (every surface takes it; the trainers and the
command line default to it; on the CPU it means no budget, said in the report), and ``least_memory``
(refused together with an option it turns off). The GPU side: tests/test_gpu_defaults.py."""

from __future__ import annotations

import pytest
import torch
import transformers

import poros_fx
from poros_fx.errors import PorosConfigError
from poros_fx.hf import PorosTrainer
from poros_fx.options import PorosOptions, cuda_graphs_choice
from poros_fx.models.tiny import demo_batches, tiny_lora_model
from poros_fx.training.loop import TrainOptions

CUDA, CPU = torch.device("cuda", 0), torch.device("cpu")


@pytest.mark.parametrize("options, device, offload, on, says", [
    ({}, CUDA, False, True, "on by default on CUDA"),
    ({}, CPU, False, False, "off (CUDA only"),
    ({}, CUDA, True, False, "off by default with offload_boundaries"),
    ({"stream": False}, CUDA, True, True, "on by default"),  # nothing is offloaded when nothing streams
    ({"cuda_graphs": False}, CUDA, False, False, "off (options="),
    ({"cuda_graphs": True}, CUDA, False, True, "on (options="),
    ({"least_memory": True}, CUDA, False, False, "off (least_memory"),
])
def test_cuda_graphs_default_and_what_turns_them_off(options, device, offload, on, says):
    chosen, note = cuda_graphs_choice(PorosOptions.from_dict(options), device, offload)
    assert chosen is on and note.startswith(says), note


@pytest.mark.parametrize("device, offload, message", [(CPU, False, "computes on cpu"),
                                                      (CUDA, True, "cannot be combined with offload_boundaries")])
def test_cuda_graphs_asked_for_where_they_cannot_run_is_refused(device, offload, message):
    with pytest.raises(PorosConfigError, match=message):
        cuda_graphs_choice(PorosOptions.from_dict({"cuda_graphs": True}), device, offload)


@pytest.mark.parametrize("options", [{"least_memory": True, "cuda_graphs": True},
                                     {"least_memory": True, "memory_budget": "auto"},
                                     {"least_memory": True, "save_activations": 1}])
def test_least_memory_is_refused_with_an_option_it_turns_off(options):
    with pytest.raises(PorosConfigError, match="least_memory=True .* cannot be combined with"):
        PorosOptions.from_dict(options)


def test_auto_budget_on_the_cpu_is_no_budget_and_the_report_says_so():
    model = tiny_lora_model(layers=2)
    poros_fx.prepare(model, device="cpu", memory_budget="auto")
    stats = poros_fx.stats(model)
    assert stats["memory_budget"] is None and "no budget" in stats["budget_source"]
    text = poros_fx.report(model)
    assert "memory_budget 'auto' on cpu: no budget" in text and "cuda graphs  off (CUDA only" in text
    step_model = torch.compile(model, backend="poros", options={"memory_budget": "auto"})
    step_model(**demo_batches(1, vocab=256, seq=8, batch=1)[0]).loss.backward()
    assert poros_fx.stats(model)["residency_plan"] is None
    assert poros_fx.stats(model)["cuda_graphs_choice"].startswith("off (CUDA only")


def test_a_size_budget_given_to_the_step_replaces_auto():
    model = tiny_lora_model(layers=2)
    poros_fx.prepare(model, device="cpu", memory_budget="auto")
    step_model = torch.compile(model, backend="poros", options={"memory_budget": "1GB"})
    step_model(**demo_batches(1, vocab=256, seq=8, batch=1)[0]).loss.backward()
    stats = poros_fx.stats(model)
    assert stats["memory_budget"] == 10**9 and stats["budget_source"] is None
    assert stats["residency_plan"]["budget"] == 10**9


def _trainer(model, options=None) -> PorosTrainer:
    args = transformers.TrainingArguments(output_dir="unused", report_to=[], use_cpu=True, max_steps=1)
    return PorosTrainer(model=model, args=args, train_dataset=[], poros_options=options)


def test_trainer_budget_defaults_to_auto_unless_given_or_prepared_with_one():
    assert _trainer(tiny_lora_model(layers=2)).poros_options["memory_budget"] == "auto"
    assert _trainer(tiny_lora_model(layers=2), {"memory_budget": "2GB"}).poros_options["memory_budget"] == "2GB"
    assert "memory_budget" not in _trainer(tiny_lora_model(layers=2), {"least_memory": True}).poros_options
    prepared = poros_fx.prepare(tiny_lora_model(layers=2), device="cpu", memory_budget="3GB")
    assert "memory_budget" not in _trainer(prepared).poros_options


def test_command_line_options_default_to_auto_and_least_memory_gives_way():
    opts = TrainOptions(data="d", out="o", from_config="qwen2.5-0.5b")
    assert opts.memory_budget == "auto" and opts.cuda_graphs is None
    quiet = TrainOptions(data="d", out="o", from_config="qwen2.5-0.5b", least_memory=True)
    quiet.check()
    assert quiet.memory_budget is None
    with pytest.raises(PorosConfigError, match="cannot be combined with memory_budget='24GB'"):
        TrainOptions(data="d", out="o", from_config="qwen2.5-0.5b", least_memory=True, memory_budget="24GB").check()
