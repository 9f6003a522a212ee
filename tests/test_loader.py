"""Streamed loader: byte-identical to the standard load, trains through poros, refuses bad input clearly.

Every checkpoint here is a tiny real Qwen2/Llama model written into tmp_path by ``save_pretrained``
(sharded with ``max_shard_size``); the reference is always an independent standard load of the same
files (``from_pretrained`` then ``poros_fx.io.quantize.quantize_nf4``), compared by sha256 / torch.equal.
"""

import hashlib
import json
import shutil
from pathlib import Path

import peft
import pytest
import safetensors.torch
import torch
import transformers

import poros_fx
from poros_fx.io import loader
from poros_fx.io.loader import LoaderError, from_config, load_pretrained, load_report
from poros_fx.prepare import causal_lm, get_store
from poros_fx.io.quantize import quantize_nf4
from poros_fx.models.tiny import TARGETS, demo_batches, tiny_config

PLENTY = 1 << 40  # an available-RAM reading that never refuses


def lora_config(targets=TARGETS):
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights="gaussian")


def save_checkpoint(path, family="qwen2", *, seed=0, shard="50KB", dtype=torch.float32, **config_kwargs) -> Path:
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(tiny_config(family, **config_kwargs), dtype=dtype)
    if shard:
        model.save_pretrained(path, max_shard_size=shard)
    else:
        model.save_pretrained(path)
    return Path(path)


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def store_manifest(model) -> dict[str, str]:
    """sha256 of every host-store tensor (NF4 packed weight, absmax, offset, nested absmax and code, bf16
    tensors) and each NF4 weight's quant-state metadata with its 4-bit code table."""
    out = {e.name: f"{e.host.dtype} {list(e.host.shape)} {sha(e.host)}" for e in get_store(model).host.tensors()}
    for name, module in causal_lm(model).named_modules():
        qs = getattr(module, "_poros_quant_state", None)
        if qs is not None:
            out[f"{name}.weight.quant_state"] = (f"{qs.quant_type} {qs.blocksize} {qs.dtype} {list(qs.shape)} "
                                                 f"{qs.nested} {qs.state2.blocksize} {sha(qs.code)}")
    return out


def standard_nf4(path, lora):
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    quantize_nf4(ref, compute_dtype=torch.bfloat16, device="cpu")
    return poros_fx.prepare(peft.get_peft_model(ref, lora), device="cpu")


def checkpoint_bytes(path) -> int:
    return sum(s.nbytes for s in loader.read_checkpoint_index(path).values())


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("ckpt") / "qwen2")


@pytest.fixture
def damaged(sharded, tmp_path):
    """A private copy of the sharded checkpoint to break."""
    return Path(shutil.copytree(sharded, tmp_path / "copy"))


def load(path, quantization="nf4", **kwargs):
    kwargs.setdefault("lora", lora_config())
    kwargs.setdefault("available_ram", PLENTY)
    kwargs.setdefault("progress", False)
    return load_pretrained(path, quantization, device="cpu", **kwargs)


# -- exactness ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("family,tied", [("qwen2", False), ("llama", True)])
def test_nf4_host_store_equals_standard_quantization(tmp_path, family, tied):
    path = save_checkpoint(tmp_path / family, family, tie_word_embeddings=tied)
    assert len(list(path.glob("*.safetensors"))) > 3  # really sharded
    model = load(path, block_size=2, prefetch=0, head_chunks=2)
    ref = standard_nf4(path, lora_config())

    got, want = store_manifest(model), store_manifest(ref)
    assert sum(k.endswith(".quant_state.absmax2") for k in got) == 7 * 3  # every decoder linear is NF4
    assert got == want

    lm = causal_lm(model)
    assert (lm.lm_head._parameters["weight"] is lm.model.embed_tokens._parameters["weight"]) == tied
    stats = poros_fx.stats(model)
    assert (stats["block_size"], stats["prefetch"], stats["head_chunks"]) == (2, 0, 2)
    report = load_report(model)
    config = transformers.AutoConfig.from_pretrained(path)
    assert report.host_bytes == stats["host_bytes"] == loader.estimate_host_bytes(config, "nf4")
    assert report.bytes_read == checkpoint_bytes(path)
    # the loader filled the store's arena itself: prepare adopted it, every tensor in place, nothing left over
    store = get_store(model)
    assert store.host.arena.used == store.host.arena.capacity
    assert all(store.host.arena.holds(e.host) for e in store.host.tensors())
    # tensor by tensor: never more in flight than one decoder layer of the checkpoint
    specs = loader.read_checkpoint_index(path)
    layer_bytes = sum(s.nbytes for n, s in specs.items() if n.startswith("model.layers.0."))
    assert 0 < report.peak_inflight_bytes <= layer_bytes


@pytest.mark.parametrize("family,tied,shard", [("qwen2", True, None), ("llama", False, "50KB")])
def test_bf16_load_equals_from_pretrained(tmp_path, family, tied, shard):
    path = save_checkpoint(tmp_path / family, family, tie_word_embeddings=tied, shard=shard)
    model = load(path, "bf16", lora=lora_config(["q_proj"]))
    ref = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                              lora_config(["q_proj"]))
    poros_fx.unprepare(model)  # base tensors back in their modules, as loaded
    for kind in ("named_parameters", "named_buffers"):  # buffers: the recomputed rotary inv_freq
        got = {n: t for n, t in getattr(model, kind)() if "lora_" not in n}
        want = {n: t for n, t in getattr(ref, kind)() if "lora_" not in n}
        assert got.keys() == want.keys() and got
        for name in want:
            assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    base = model.get_base_model()
    assert (base.lm_head.weight is base.model.embed_tokens.weight) == tied
    assert not base.training  # from_pretrained returns eval mode too


def test_loaded_model_trains_through_poros_like_the_standard_load(sharded):
    model = load(sharded)
    ref = standard_nf4(sharded, lora_config())
    ref.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    batch = demo_batches(1, seq=16)[0]
    results = []
    for m in (model, ref):
        m.train()
        loss = torch.compile(m, backend="poros")(**batch, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    (loss, grads), (ref_loss, ref_grads) = results
    assert torch.isfinite(loss) and torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)
    assert all(grads[n].abs().sum() > 0 for n in grads if "lora_B" in n)
    assert poros_fx.stats(model)["recomputed_blocks"] > 0  # streamed, not resident


# -- from_config -------------------------------------------------------------------------------------

def test_from_config_is_deterministic_and_quantizes_like_bitsandbytes():
    import bitsandbytes as bnb

    config = tiny_config("qwen2", layers=2)
    kwargs = dict(device="cpu", lora=lora_config(), progress=False, available_ram=PLENTY)
    dense = store_manifest(from_config(config, "bf16", seed=3, **kwargs))
    assert dense == store_manifest(from_config(config, "bf16", seed=3, **kwargs))
    other = store_manifest(from_config(config, "bf16", seed=4, **kwargs))
    assert all(other[n] != dense[n] for n in dense if n.endswith("proj.base_layer.weight"))
    # a tensor's values depend on (seed, name) only: one layer fewer changes nothing else
    fewer = store_manifest(from_config(tiny_config("qwen2", layers=1), "bf16", seed=3, **kwargs))
    assert fewer and all(dense[n] == fewer[n] for n in fewer)

    model = from_config(config, "bf16", seed=3, **kwargs)
    nf4 = from_config(config, "nf4", seed=3, **kwargs)
    assert load_report(nf4).host_bytes == poros_fx.stats(nf4)["host_bytes"] == loader.estimate_host_bytes(config)
    lm, lm4 = causal_lm(model), causal_lm(nf4)
    assert torch.equal(lm.model.norm.weight, torch.ones(64, dtype=torch.bfloat16))
    assert torch.equal(lm.model.layers[0].self_attn.q_proj.base_layer.bias, torch.zeros(64, dtype=torch.bfloat16))
    quantized = 0
    for name, module in lm4.named_modules():
        qs = getattr(module, "_poros_quant_state", None)
        if qs is None:
            continue
        w = lm.get_submodule(name).weight  # the bf16 run's weight, loaded from its host store
        want = bnb.nn.Params4bit(w.detach().clone(), requires_grad=False, compress_statistics=True,
                                 quant_type="nf4", blocksize=64).to("cpu")
        assert sha(module._parameters["weight"]) == sha(want.data), name
        wqs = want.quant_state
        for got_t, want_t in ((module.poros_qs_absmax, wqs.absmax), (module.poros_qs_offset, wqs.offset),
                              (module.poros_qs_absmax2, wqs.state2.absmax), (module.poros_qs_code2, wqs.state2.code)):
            assert got_t.dtype == want_t.dtype and torch.equal(got_t, want_t), name
        quantized += 1
    assert quantized == 7 * 2


# -- sources -----------------------------------------------------------------------------------------

def fake_hub_cache(cache: Path, repo_id: str, checkpoint: Path) -> Path:
    """The layout huggingface_hub's cache uses: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    return Path(shutil.copytree(checkpoint, repo / "snapshots" / commit))


def test_hub_id_resolves_from_the_local_cache_only(sharded, tmp_path):
    snapshot = fake_hub_cache(tmp_path / "hub", "tiny-org/tiny-qwen2", sharded)
    model = load("tiny-org/tiny-qwen2", cache_dir=tmp_path / "hub")
    assert load_report(model).source == str(snapshot)
    assert store_manifest(model) == store_manifest(load(sharded))

    with pytest.raises(LoaderError, match=r"not in the local Hugging Face cache .*does not attempt a download"):
        load("tiny-org/not-cached", cache_dir=tmp_path / "hub")
    with pytest.raises(LoaderError, match="neither an existing folder nor a valid hub id"):
        load(str(tmp_path / "no" / "such" / "folder"))


def test_arguments_are_checked_before_any_file_is_read(tmp_path):
    missing = tmp_path / "does-not-exist"
    with pytest.raises(poros_fx.PorosConfigError, match=r"pass lora= .* or adapter= .*, not both"):
        load(missing, adapter=tmp_path)
    with pytest.raises(LoaderError, match="has no adapter_config.json"):  # the adapter, before the checkpoint
        load_pretrained(missing, adapter=tmp_path)
    with pytest.raises(poros_fx.PorosConfigError, match="quantization must be 'nf4' or 'bf16'"):
        load(missing, "int8")
    with pytest.raises(poros_fx.PorosConfigError, match="lora must be a peft config"):
        load(missing, lora={"r": 4})
    with pytest.raises(poros_fx.PorosConfigError, match="block_size"):
        load(missing, block_size=0)
    with pytest.raises(poros_fx.PorosConfigError, match=r"not both"):
        from_config(tiny_config(), lora=lora_config(), adapter=tmp_path)
    with pytest.raises(poros_fx.PorosConfigError, match="not made by poros_fx.load_pretrained"):
        load_report(torch.nn.Linear(2, 2))


def test_progress_bar_stays_off_without_a_terminal(sharded, capfd):
    load(sharded, progress=True)  # pytest's captured streams are not a TTY
    out, err = capfd.readouterr()
    assert "tensors" not in out + err


# -- host RAM ----------------------------------------------------------------------------------------

def test_refuses_when_host_ram_cannot_hold_the_base(sharded):
    readings = []

    def tiny_ram():
        readings.append(1)
        return 100_000

    with pytest.raises(LoaderError, match=r"needs about [\d.]+ MiB \([\d.]+ MiB in the host store .* only 0.10 MiB "
                                          r"is available"):
        load(sharded, available_ram=tiny_ram)
    assert readings == [1]
    with pytest.raises(LoaderError, match="quantization='nf4'"):  # bf16 is told about the smaller option
        load(sharded, "bf16", available_ram=100_000)
    with pytest.raises(LoaderError, match="not enough host RAM"):
        from_config(tiny_config(), device="cpu", lora=lora_config(), progress=False, available_ram=1000)


def test_proc_meminfo_reading(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384 kB\nMemFree:         1024 kB\nMemAvailable:    2048 kB\n")
    assert loader.proc_meminfo_available(meminfo) == 2048 * 1024
    meminfo.write_text("MemTotal:       16384 kB\n")
    assert loader.proc_meminfo_available(meminfo) is None
    assert loader.proc_meminfo_available(tmp_path / "absent") is None
    assert loader.host_ram_available() > 0


# -- bad input ---------------------------------------------------------------------------------------

def first_shard(path: Path) -> Path:
    return sorted(path.glob("model-*.safetensors"))[0]


def index_of(path: Path) -> dict:
    return json.loads((path / loader.INDEX_FILE).read_text())


def test_missing_shard(damaged):
    shard = first_shard(damaged)
    shard.unlink()
    with pytest.raises(LoaderError, match=rf"lists shard '{shard.name}', which is not in"):
        load(damaged)


@pytest.mark.parametrize("keep,match", [(4, "truncated safetensors file"), (None, "truncated: tensor")])
def test_truncated_shard(damaged, keep, match):
    shard = first_shard(damaged)
    data = shard.read_bytes()
    shard.write_bytes(data[:keep] if keep else data[:len(data) - 100])
    with pytest.raises(LoaderError, match=rf"{shard.name}: {match}"):
        load(damaged)


def test_corrupt_header(damaged):
    shard = first_shard(damaged)
    data = bytearray(shard.read_bytes())
    data[8:24] = b"\xff" * 16
    shard.write_bytes(bytes(data))
    with pytest.raises(LoaderError, match=rf"{shard.name}: corrupt safetensors header"):
        load(damaged)


def test_index_names_a_tensor_no_shard_has(damaged):
    index = index_of(damaged)
    index["weight_map"]["model.layers.0.mlp.extra.weight"] = first_shard(damaged).name
    (damaged / loader.INDEX_FILE).write_text(json.dumps(index))
    with pytest.raises(LoaderError, match=r"'model.layers.0.mlp.extra.weight' is in .* no such tensor"):
        load(damaged)


def rewrite_single_file(tmp_path, change) -> Path:
    """A single-file checkpoint whose tensors went through ``change(dict)``."""
    path = save_checkpoint(tmp_path / "single", layers=1, shard=None)
    tensors = safetensors.torch.load_file(path / "model.safetensors")
    change(tensors)
    safetensors.torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    return path


@pytest.mark.parametrize("change,match", [
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"].to(torch.int8)}),
     r"'model.layers.0.mlp.up_proj.weight' has dtype I8; expected a float checkpoint"),
    (lambda t: t.pop("model.layers.0.self_attn.k_proj.weight"),
     r"no tensor for 1 model weight\(s\): 'model.layers.0.self_attn.k_proj.weight'"),
    (lambda t: t.update({"model.layers.0.mlp.up_proj.weight": t["model.layers.0.mlp.up_proj.weight"][:5]}),
     r"'model.layers.0.mlp.up_proj.weight' has shape \[5, 64\], the model built from config.json expects \[128, 64\]"),
    (lambda t: t.update({"model.layers.0.mlp.extra": torch.zeros(3)}),
     r"1 tensor\(s\) the model built from config.json does not: 'model.layers.0.mlp.extra'"),
], ids=["dtype", "missing-key", "shape", "unexpected-key"])
def test_checkpoint_contents_that_do_not_fit(tmp_path, change, match):
    path = rewrite_single_file(tmp_path, change)
    with pytest.raises(LoaderError, match=match):
        load(path)


def test_unvalidated_architecture_is_refused_before_reading(tmp_path):
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"not read")  # would be a LoaderError if it were
    with pytest.raises(poros_fx.UnsupportedArchitectureError, match="not a validated poros-fx family"):
        load(tmp_path)


def test_pickle_checkpoint_is_refused_without_unpickling(tmp_path):
    save_checkpoint(tmp_path, layers=1, shard=None)
    (tmp_path / "model.safetensors").unlink()
    # not a pickle at all: torch.load would fail with an unpickling error, not this one
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04 not a pickle")
    with pytest.raises(LoaderError, match=r"pickle checkpoint \(pytorch_model.bin\).*never unpickles.*safetensors"):
        load(tmp_path)
    with pytest.raises(LoaderError, match=r"pickle checkpoint \(pytorch_model.bin\)"):
        load(tmp_path / "pytorch_model.bin")


def test_config_problems(tmp_path):
    path = save_checkpoint(tmp_path / "q", layers=1, shard=None)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": {"load_in_4bit": True}}))
    with pytest.raises(LoaderError, match="pre-quantized checkpoint"):
        load(path)
    (path / "config.json").unlink()
    with pytest.raises(LoaderError, match="has no config.json"):
        load(path)
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text(json.dumps(config))
    with pytest.raises(LoaderError, match=r"has neither model.safetensors nor model.safetensors.index.json"):
        load(empty)


# -- GPU: the standard path is BitsAndBytesConfig quantizing on the device -----------------------------

def cuda_manifests(path) -> tuple[dict[str, str], dict[str, str]]:
    """Host-store manifests of ``load_pretrained`` on CUDA and of the standard BitsAndBytesConfig load."""
    model = load_pretrained(path, "nf4", device="cuda", lora=lora_config(), progress=False)
    bnb_config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                 bnb_4bit_use_double_quant=True,
                                                 bnb_4bit_compute_dtype=torch.bfloat16)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda",
                                                            quantization_config=bnb_config)
    ref = poros_fx.prepare(peft.get_peft_model(ref, lora_config()), device="cuda")
    return store_manifest(model), store_manifest(ref)


@pytest.mark.gpu
def test_cuda_nf4_equals_bitsandbytes_config_load(tmp_path):
    got, want = cuda_manifests(save_checkpoint(tmp_path / "llama", "llama", tie_word_embeddings=True))
    assert sum(k.endswith(".quant_state.absmax2") for k in got) == 7 * 3
    assert got == want


@pytest.mark.gpu
def test_cuda_nf4_equals_bitsandbytes_config_load_05b(tmp_path):
    """The byte-identity check at the Qwen2.5-0.5B shape, with a bf16 checkpoint written here."""
    from poros_fx.models.tiny import qwen25_config

    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(qwen25_config("0.5b"), dtype=torch.bfloat16).save_pretrained(
        tmp_path / "q05", max_shard_size="300MB")
    got, want = cuda_manifests(tmp_path / "q05")
    assert sum(k.endswith(".quant_state.absmax2") for k in got) == 7 * 24
    assert got == want


@pytest.mark.gpu
def test_cuda_from_config_trains_one_step():
    config = tiny_config("qwen2", layers=2)
    kwargs = dict(device="cuda", lora=lora_config(), progress=False)
    model = from_config(config, "nf4", seed=1, **kwargs)
    assert store_manifest(model) == store_manifest(from_config(config, "nf4", seed=1, **kwargs))
    assert poros_fx.stats(model)["pinned"]
    model.train()
    batch = {k: v.cuda() for k, v in demo_batches(1, seq=16)[0].items()}
    loss = torch.compile(model, backend="poros")(**batch, use_cache=False).loss
    loss.backward()
    assert torch.isfinite(loss) and poros_fx.stats(model)["recomputed_blocks"] > 0
    assert all(p.grad is not None and p.grad.is_cuda for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])  # per-expert names: gate/up/down_proj; w1/w3/w2
def test_nf4_experts_load_as_bitsandbytes_quantizes_each_expert(tmp_path, family):
    """A mixture of experts' checkpoint (as transformers 5 saves it): its fused expert weights stored NF4 per
    expert matrix (io/nf4_experts.py), byte for byte what the standard load and then quantize_experts_nf4 give;
    the store's size is the estimate's and check's."""
    from poros_fx.io.nf4_experts import quantize_experts_nf4
    from poros_fx.io.sizes import block_bytes
    from poros_fx.models.tiny import MOE_TARGETS

    path = save_checkpoint(tmp_path / family, family, shard="200KB")
    names = list(loader.read_checkpoint_index(path))
    assert any(".experts.0." in n for n in names) and not any(n.endswith("experts.gate_up_proj") for n in names)
    lora = lora_config(list(MOE_TARGETS))
    model = load(path, lora=lora, prefetch=0)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    quantize_nf4(ref, compute_dtype=torch.bfloat16, device="cpu")
    assert quantize_experts_nf4(ref) == 3 * 2  # three layers: gate_up_proj and down_proj
    ref = poros_fx.prepare(peft.get_peft_model(ref, lora), device="cpu", prefetch=0)
    got = store_manifest(model)
    assert sum(".experts.parametrizations." in k for k in got) == 3 * 2 * 5  # packed, absmax, offset, absmax2, code
    assert got == store_manifest(ref)
    config = transformers.AutoConfig.from_pretrained(path)
    assert load_report(model).host_bytes == poros_fx.stats(model)["host_bytes"] == loader.estimate_host_bytes(config, "nf4")
    assert poros_fx.stats(model)["block_bytes"] == block_bytes(config, "nf4")[1]


def save_mxfp4_checkpoint(path: Path, layers: int = 2) -> Path:
    """A tiny gpt-oss checkpoint laid out as the hub's: every fused expert weight ``[experts, K, N]`` as MXFP4
    ``<name>_blocks`` ``[experts, N, K/32, 16]`` and ``<name>_scales`` ``[experts, N, K/32]`` (random bytes;
    exponents near 2^0), and a ``quantization_config`` saying so."""
    path = save_checkpoint(path, "gpt_oss", shard=None, layers=layers)
    (file,) = path.glob("*.safetensors")
    tensors = safetensors.torch.load_file(file)
    g = torch.Generator().manual_seed(3)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, k, n = tensors.pop(name).shape
        tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, n, k // 32, 16), generator=g, dtype=torch.uint8)
        tensors[f"{name}_scales"] = torch.randint(118, 128, (experts, n, k // 32), generator=g, dtype=torch.uint8)
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("quantization", ["bf16", "nf4"])
def test_mxfp4_experts_load_as_transformers_dequantizes_them(tmp_path, quantization):
    """gpt-oss's hub checkpoints keep their experts in MXFP4: read as bf16 by transformers' own dequantization,
    byte for byte the model ``from_pretrained(..., Mxfp4Config(dequantize=True))`` gives (and, with NF4, that
    model's experts quantized per expert matrix)."""
    from poros_fx.io.nf4_experts import quantize_experts_nf4

    path = save_mxfp4_checkpoint(tmp_path / "gpt_oss")
    model = load(path, lora=None, quantization=quantization)
    ref = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.bfloat16)
    assert ref.model.layers[0].mlp.experts.gate_up_proj.dtype == torch.bfloat16
    if quantization == "nf4":
        quantize_nf4(ref, compute_dtype=torch.bfloat16, device="cpu")
        assert quantize_experts_nf4(ref) == 2 * 2
    ref = poros_fx.prepare(ref.requires_grad_(False), device="cpu", prefetch=0)
    got = store_manifest(model)
    assert sum("experts" in k for k in got) >= 2 * 2 and got == store_manifest(ref)
    assert getattr(causal_lm(model).config, "quantization_config", None) is None  # the model built is a bf16 one


def test_mxfp4_experts_of_another_shape_are_refused(tmp_path):
    path = save_mxfp4_checkpoint(tmp_path / "gpt_oss", layers=1)
    (file,) = path.glob("*.safetensors")
    tensors = safetensors.torch.load_file(file)
    name = "model.layers.0.mlp.experts.down_proj_scales"
    tensors[name] = tensors[name][..., :-1].contiguous()
    safetensors.torch.save_file(tensors, file, metadata={"format": "pt"})
    with pytest.raises(LoaderError, match=r"do not make 'model.layers.0.mlp.experts.down_proj' .* in MXFP4 \(expected U8"):
        load(path, lora=None)


def test_an_adapter_trained_on_an_mxfp4_base_exports_onto_it(tmp_path):
    """``poros-fx export`` onto an MXFP4 base: the experts stay the base's MXFP4 bytes (with its
    ``quantization_config``), the attention gets the merged LoRA, and transformers loads the result."""
    from poros_fx.io.export import export_merged

    path = save_mxfp4_checkpoint(tmp_path / "gpt_oss", layers=1)
    dequantized = transformers.Mxfp4Config(dequantize=True)
    base = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=dequantized, dtype=torch.float32)
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    tuned = peft.get_peft_model(base, lora)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(4)) * 0.05)
    tuned.save_pretrained(tmp_path / "adapter")
    report = export_merged(tmp_path / "adapter", path, tmp_path / "merged", any_base=True)
    assert report.merged_modules == 2
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", quantization_config=dequantized,
                                                               dtype=torch.bfloat16)
    plain = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=dequantized, dtype=torch.bfloat16)
    experts, plain_experts = merged.model.layers[0].mlp.experts, plain.model.layers[0].mlp.experts
    assert torch.equal(experts.gate_up_proj, plain_experts.gate_up_proj)
    assert torch.equal(experts.down_proj, plain_experts.down_proj)
    attention, plain_attention = merged.model.layers[0].self_attn, plain.model.layers[0].self_attn
    assert not torch.equal(attention.q_proj.weight, plain_attention.q_proj.weight)
    assert torch.equal(attention.k_proj.weight, plain_attention.k_proj.weight)
