"""The CLI through its real entry point (the installed ``poros-fx`` script)."""


import pytest
from cli_helper import cli
import torch

import poros_fx
from poros_fx.io.sizes import block_bytes, nf4_bytes
from poros_fx.tools.tiny import tiny_config, tiny_lora_model





def test_doctor():
    out = cli("doctor").stdout
    assert torch.__version__ in out and "bitsandbytes" in out
    assert "resolves (entry point torch_dynamo_backends)" in out
    if not torch.cuda.is_available():
        assert "no CUDA device" in out


def test_check_builtin_and_config_file(tmp_path):
    out = cli("check", "qwen2.5-32b").stdout
    assert "qwen2 (validated)" in out and "layers.63" in out and "66 blocks" in out
    config = tiny_config("llama", layers=3, tie_word_embeddings=True)
    config.save_pretrained(tmp_path)
    out = cli("check", str(tmp_path / "config.json"), "--quantization", "bf16", "--block-size", "2").stdout
    assert "llama (validated)" in out and "layers.0-1" in out and "layers.2" in out


def test_check_prefetch_auto_fixed_and_refused():
    assert "prefetch auto loads one block ahead" in cli("check", "qwen2.5-7b").stdout  # the default
    out = cli("check", "qwen2.5-7b", "--prefetch", "2").stdout
    assert "(1 + prefetch 2) x largest load" in out and "prefetch auto" not in out
    res = cli("check", "qwen2.5-7b", "--prefetch", "two", check=False)
    assert res.returncode == 2 and "prefetch must be an integer >= 0" in res.stdout + res.stderr


def test_check_estimates_the_step_and_a_budgets_plan():
    out = cli("check", "qwen2.5-72b", "--memory-budget", "24GB", "--accumulate", "8").stdout
    assert "the head is loaded in 10 row chunks" in out  # never whole: the window is a layer or a chunk
    assert "8 micro-batch(es) in flight, block-major" in out and "boundary activations 5.00 GiB" in out
    assert "layer blocks and the head would stay resident" in out and "once per optimizer step" in out
    small = cli("check", "qwen2.5-72b", "--memory-budget", "2GB").stdout
    assert "below the estimated streamed step" in small
    bad = cli("check", "qwen2.5-7b", "--memory-budget", "lots", check=False)
    assert bad.returncode == 2 and "memory_budget must be" in bad.stdout + bad.stderr


def test_check_unknown_model_and_family(tmp_path):
    res = cli("check", "no/such-model-anywhere", check=False)
    assert res.returncode != 0 and "downloads nothing" in res.stdout + res.stderr
    import transformers

    transformers.GPT2Config(n_layer=1).save_pretrained(tmp_path)
    res = cli("check", str(tmp_path), check=False)
    assert res.returncode == 2 and "not a validated poros-fx family" in res.stderr


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


def test_dump_without_training(tmp_path):
    out = cli("dump", "qwen2.5-0.5b", "--layers", "1", "--seq", "16", "--device", "cpu", "--out", str(tmp_path)).stdout
    folder = next(tmp_path.iterdir())
    assert (folder / "timeline.png").exists() and (folder / "schedule.txt").exists()
    assert "layers.0" in out and "head" in out


def test_dump_takes_the_config_layers_and_trains_nf4_by_default(tmp_path):
    """dump builds the config's layers unless --layers says otherwise, and quantizes as train and check do."""
    tiny_config("llama", layers=3).save_pretrained(tmp_path / "cfg")
    out = cli("dump", str(tmp_path / "cfg"), "--seq", "16", "--device", "cpu", "--out", str(tmp_path / "d")).stdout
    assert "layers.2" in out and "for 3 layers, nf4" in out
    region = (next((tmp_path / "d").iterdir()) / "regions" / "r0_forward.py").read_text()
    assert "4bit" in region  # the decoder linears are NF4
    out = cli("dump", str(tmp_path / "cfg"), "--layers", "1", "--quantization", "bf16", "--seq", "16", "--device",
              "cpu", "--out", str(tmp_path / "e")).stdout
    assert "for 1 layers, bf16" in out and "layers.1" not in out


def test_small_sizes_are_readable(tmp_path):
    tiny_config("qwen2", layers=2).save_pretrained(tmp_path)
    out = cli("check", str(tmp_path)).stdout
    assert "KiB" in out and "0.0 MiB" not in out and "0.00 GiB" not in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_refused_cleanly_without_cuda(tmp_path):
    res = cli("train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out", str(tmp_path / "a"), "--device",
              "cuda", check=False)
    assert res.returncode == 2 and "torch sees no CUDA device" in res.stdout + res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "a").exists()


def test_cuda_graphs_refused_cleanly_on_the_cpu(tmp_path):
    """--cuda-graphs on a CPU run: one line saying why, before anything is loaded or written."""
    res = cli("train", "--from-config", "qwen2.5-0.5b", "--data", "demo", "--out", str(tmp_path / "a"), "--device",
              "cpu", "--cuda-graphs", check=False)
    assert res.returncode == 2 and "cuda_graphs replays CUDA kernels" in res.stdout + res.stderr
    assert "Traceback" not in res.stderr and not (tmp_path / "a").exists()
