"""The CLI: through its real entry point (the installed ``poros-fx`` script) where a process of its own
matters, in this process (``cli.main``, as the script runs it) for commands that print and refuse: a
subprocess costs ~8 s of importing torch, transformers and peft before it does anything."""


import re

import pytest
from cli_helper import cli
from train_helper import run_cli
import torch

import poros_fx
from poros_fx.compiler.estimate import LONG_SEQUENCE_OPTIONS, long_context_plan, long_sequence_advice, options_to_add
from poros_fx.io.sizes import block_bytes, nf4_bytes
from poros_fx.loss import loss_chunk_count
from poros_fx.models.tiny import qwen25_config, tiny_config, tiny_lora_model


def words(text: str) -> str:
    # this process's console is as wide as it was when first imported (80 columns, not the script's 200)
    return " ".join(text.split())


def check(capsys, *args: str) -> tuple[int, str]:
    """``poros-fx check ARGS`` in this process: (exit code, stdout + stderr, lines rejoined)."""
    code, out, err = run_cli(capsys, "check", *args)
    return code, words(out + err)


def test_doctor():  # the installed script itself
    out = cli("doctor").stdout
    assert torch.__version__ in out and "bitsandbytes" in out
    assert "resolves (entry point torch_dynamo_backends)" in out
    if not torch.cuda.is_available():
        assert "no CUDA device" in out


def test_check_builtin_and_config_file(tmp_path, capsys):
    code, out = check(capsys, "qwen2.5-32b")
    assert code == 0 and "qwen2 (validated)" in out and "layers.63" in out and "66 blocks" in out
    config = tiny_config("llama", layers=3, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    code, out = check(capsys, str(tmp_path / "config.json"), "--quantization", "bf16", "--block-size", "2")
    assert code == 0 and "llama (validated)" in out and "layers.0-1" in out and "layers.2" in out


@pytest.mark.parametrize("shape,family,layers,per_layer", [
    ("qwen3-30b-a3b", "qwen3_moe", 48, "306.9 MiB"), ("gpt-oss-120b", "gpt_oss", 36, "1.55 GiB")])
def test_check_knows_the_mixture_of_experts_shapes(capsys, shape, family, layers, per_layer):
    """The real shapes of models/configs/ with NF4 experts: each layer's block holds its experts' NF4 tensors."""
    code, out = check(capsys, shape)
    assert code == 0 and f"{family} (validated)" in out and f"layers.{layers - 1}" in out and f"{layers + 2} blocks" in out
    assert re.search(rf"layers\.0 .*{re.escape(per_layer)}", out), out


def test_check_prefetch_auto_fixed_and_refused(capsys):
    code, out = check(capsys, "qwen2.5-7b")
    assert code == 0 and "prefetch auto loads one block ahead" in out  # the default
    code, out = check(capsys, "qwen2.5-7b", "--memory-budget", "12GB")  # kept blocks sit between streamed ones
    assert code == 0 and "(1 + prefetch 2) x largest load" in out and "loads two blocks ahead" in out
    code, out = check(capsys, "qwen2.5-7b", "--prefetch", "2")
    assert code == 0 and "(1 + prefetch 2) x largest load" in out and "prefetch auto" not in out
    code, out = check(capsys, "qwen2.5-7b", "--prefetch", "two")
    assert code == 2 and "prefetch must be an integer >= 0" in out


def test_check_estimates_the_step_and_a_budgets_plan(capsys):
    code, out = check(capsys, "qwen2.5-72b", "--memory-budget", "24GB", "--accumulate", "8")
    assert code == 0 and "the head is loaded in 10 row chunks" in out  # never whole: the window is a layer or a chunk
    assert "8 micro-batch(es) in flight, block-major" in out and "boundary activations 5.00 GiB" in out
    assert "layer blocks and the head would stay resident" in out and "once per optimizer step" in out
    code, small = check(capsys, "qwen2.5-72b", "--memory-budget", "2GB")
    assert code == 0 and "below the estimated streamed step" in small
    code, bad = check(capsys, "qwen2.5-7b", "--memory-budget", "lots")
    assert code == 2 and "memory_budget must be" in bad


def test_check_device_memory_names_the_options_a_length_needs_or_the_longest_that_fits(capsys):
    code, short = check(capsys, "qwen2.5-7b", "--seq-len", "512", "--device-memory", "24GB")
    assert code == 0 and "with no long-sequence option" in short
    code, long = check(capsys, "qwen2.5-7b", "--seq-len", "131072", "--device-memory", "24GB")
    assert code == 0 and "--chunked-loss --offload-boundaries --sequence-chunks" in long
    code, out = check(capsys, "qwen2.5-7b", "--seq-len", "1048576", "--device-memory", "24GB")
    longest = int(re.search(r"the longest length that fits is about (\d+)", out).group(1))
    assert code == 0 and "does not fit" in out and 131072 <= longest < 1048576
    code, edge = check(capsys, "qwen2.5-7b", "--seq-len", str(longest), "--device-memory", "24GB")
    assert "does not fit" not in edge
    code, _, err = run_cli(capsys, "check", "qwen2.5-7b", "--device-memory", "lots")
    assert code == 2 and "--device-memory" in err


@pytest.mark.parametrize("seq,measured_gb", [(32768, 5.82), (65536, 10.68), (131072, 20.39)])
def test_check_estimates_the_measured_long_sequence_peaks(capsys, seq, measured_gb):
    """The whole Qwen2.5-7B shape under a 24 GB cap, chunked loss + offloaded boundaries + 8 sequence chunks
    (H100, docs/bench/long_context/cap24/): the estimate within 3% of each measured peak."""
    code, out = check(capsys, "qwen2.5-7b", "--seq-len", str(seq), "--chunked-loss", "--offload-boundaries",
                      "--sequence-chunks", "8")
    estimate_gb = float(re.search(r"on those\): ([\d.]+) GiB", out).group(1)) * 2**30 / 1e9
    assert code == 0 and abs(estimate_gb / measured_gb - 1) < 0.03, (estimate_gb, measured_gb)


def test_check_says_the_host_memory_offloaded_boundaries_take(capsys):
    """72B at 32768 tokens: 80 layers' inputs and the last one's output, each 32768 x 8192 bf16, wait on the
    host, 40.5 GiB beside the base (what tests/test_long_sequences.py counts a step offloading, at a tiny size)."""
    code, out = check(capsys, "qwen2.5-72b", "--seq-len", "32768", "--offload-boundaries")
    assert code == 0 and "offloaded boundaries: 40.50 GiB of page-locked host memory" in out
    assert "this host has" in out
    code, out = check(capsys, "qwen2.5-72b", "--seq-len", "32768")
    assert "offloaded boundaries" not in out


def test_long_sequence_advice_names_the_options_or_the_longest_length():
    """What `poros-fx train` says when a length's estimate is over the device memory: the options that make it
    fit, or the longest length that fits with all of them."""
    config = qwen25_config("7b")
    window, adapter, chunks = 2**29, 160 * 2**20, loss_chunk_count(config.vocab_size, 1)  # as `check` finds them
    advice = long_sequence_advice(long_context_plan(config, window, seq=131072, batch=1, adapter_bytes=adapter,
                                                    device_memory=24 * 10**9, loss_chunks=chunks), {})
    assert "chunked_loss=True, offload_boundaries=True, sequence_chunks=" in advice and "which fits" in advice
    too_long = long_sequence_advice(long_context_plan(config, window, seq=1 << 20, batch=1, adapter_bytes=adapter,
                                                      device_memory=24 * 10**9, loss_chunks=chunks),
                                    {"chunked_loss": True})
    longest = int(re.search(r"about (\d+) tokens", too_long).group(1))
    assert 131072 <= longest < 1 << 20
    fits_at = long_context_plan(config, window, seq=longest, batch=1, adapter_bytes=adapter, device_memory=24 * 10**9,
                                loss_chunks=chunks)
    assert fits_at.fits
    # `poros-fx train` turns on what the plan needs where the options were left to their defaults, never over
    # an option given explicitly
    plan = long_context_plan(config, window, seq=131072, batch=1, adapter_bytes=adapter, device_memory=24 * 10**9,
                             loss_chunks=chunks)
    defaults = dict.fromkeys(LONG_SEQUENCE_OPTIONS)
    assert plan.fits and options_to_add(plan, defaults) == plan.options and "sequence_chunks" in plan.options
    assert options_to_add(plan, {**defaults, "chunked_loss": False}) == {}
    assert options_to_add(plan, {**defaults, "sequence_chunks": 1}) == {}
    assert options_to_add(plan, {**defaults, "chunked_loss": True}) == {k: v for k, v in plan.options.items()
                                                                          if k != "chunked_loss"}
    short = long_context_plan(config, window, seq=512, batch=1, adapter_bytes=adapter, device_memory=24 * 10**9,
                              loss_chunks=chunks)
    assert short.fits and options_to_add(short, defaults) == {}  # 512 tokens fit with no option


def test_check_unknown_model_and_family(tmp_path, capsys):
    code, out = check(capsys, "no/such-model-anywhere")
    assert code != 0 and "downloads nothing" in out
    import transformers

    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path)
    code, _, err = run_cli(capsys, "check", str(tmp_path))
    assert code == 2 and "not a validated poros-fx family" in err


@pytest.mark.parametrize("quantization", ["bf16", "nf4"])
@pytest.mark.parametrize("tied", [False, True])
def test_sizes_match_the_host_store(quantization, tied):
    """check's bytes per block, from the config alone, are the bytes prepare's store holds per block."""
    config = tiny_config("qwen2", layers=3, tie_word_embeddings=tied)
    model = tiny_lora_model("qwen2", layers=3, nf4=quantization == "nf4", dtype=torch.bfloat16,
                            tie_word_embeddings=tied)
    poros_fx.prepare(model, device="cpu", block_size=2)
    names, sizes = block_bytes(config, quantization, block_size=2)
    stats = poros_fx.stats(model)
    assert names == stats["block_names"] and sizes == stats["block_bytes"]


def test_nf4_bytes_formula():
    assert nf4_bytes(64 * 256) == 64 * 128 + 256 + 4 + 1024 + 4


def test_dump_without_training(tmp_path, capsys):
    code, out, err = run_cli(capsys, "dump", "qwen2.5-0.5b", "--layers", "1", "--seq", "16", "--device", "cpu", "--out",
                             str(tmp_path))
    assert code == 0, err
    folder = next(tmp_path.iterdir())
    assert (folder / "timeline.png").exists() and (folder / "schedule.txt").exists()
    assert "layers.0" in out and "head" in out


def test_dump_takes_the_config_layers_and_trains_nf4_by_default(tmp_path, capsys):
    """dump builds the config's layers unless --layers says otherwise, and quantizes as train and check do
    (the first dump through the installed script, the second in this process)."""
    tiny_config("llama", layers=3).save_pretrained(tmp_path / "cfg")
    out = cli("dump", str(tmp_path / "cfg"), "--seq", "16", "--device", "cpu", "--out", str(tmp_path / "d")).stdout
    assert "layers.2" in out and "for 3 layers, nf4" in out
    region = (next((tmp_path / "d").iterdir()) / "regions" / "r0_forward.py").read_text()
    assert "4bit" in region  # the decoder linears are NF4
    code, out, err = run_cli(capsys, "dump", str(tmp_path / "cfg"), "--layers", "1", "--quantization", "bf16", "--seq",
                             "16", "--device", "cpu", "--out", str(tmp_path / "e"))
    assert code == 0 and "for 1 layers, bf16" in words(out) and "layers.1" not in out, err


def test_small_sizes_are_readable(tmp_path, capsys):
    tiny_config("qwen2", layers=2).save_pretrained(tmp_path)
    code, out = check(capsys, str(tmp_path))
    assert code == 0 and "KiB" in out and "0.0 MiB" not in out and "0.00 GiB" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_refused_cleanly_without_cuda(tmp_path, capsys):
    code, out, err = run_cli(capsys, "train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out",
                             str(tmp_path / "a"), "--device", "cuda")
    assert code == 2 and "torch sees no CUDA device" in out + err
    assert "Traceback" not in err and not (tmp_path / "a").exists()


def test_cuda_graphs_refused_cleanly_on_the_cpu(tmp_path, capsys):
    """--cuda-graphs on a CPU run: one line saying why, before anything is loaded or written."""
    code, out, err = run_cli(capsys, "train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out",
                             str(tmp_path / "a"), "--device", "cpu", "--cuda-graphs")
    assert code == 2 and "cuda_graphs replays CUDA kernels" in out + err
    assert "Traceback" not in err and not (tmp_path / "a").exists()
