"""The shared host store in one process: shared arenas, their files, manifests, and the checks around
DDP (``runtime/arena.py``, ``io/manifest.py``, ``poros_fx.distributed``).

Two mappings of one file in one process stand for two ranks of a host here; the protocol between real
processes is in ``tests/test_distributed.py``.
"""

from __future__ import annotations

import errno
import fcntl
import gc
import os
import shutil
import tempfile
import time
import warnings

import peft
import pytest
import torch
import torch.distributed as dist

import poros_fx
from poros_fx import distributed
from poros_fx.errors import PorosConfigError
from poros_fx.io import manifest, meta_model
from poros_fx.prepare import get_store
from poros_fx.runtime import arena as arena_mod
from poros_fx.runtime.arena import attach_shared, create_shared, remove_stale
from poros_fx.models.tiny import demo_batches, lora_targets, tiny_config, tiny_lora_model


@pytest.fixture
def shm(monkeypatch):
    folder = tempfile.mkdtemp(prefix="poros-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    monkeypatch.setenv(arena_mod.SHM_DIR_ENV, folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# -- shared arenas ----------------------------------------------------------------------------------

def test_two_mappings_of_one_arena_see_the_same_bytes_after_the_name_is_gone(shm):
    made = create_shared(1 << 16)
    assert made.shared.linked and os.path.dirname(made.shared.path) == shm
    seen = attach_shared(made.shared.path, 1 << 16)
    made.shared.unlink()
    assert os.listdir(shm) == []  # the name is gone, both mappings stay
    t = made.place(torch.arange(10, dtype=torch.float32))
    assert made.offset(t) == 0 and seen.buffer.data_ptr() != made.buffer.data_ptr()
    assert torch.equal(seen.view(0, (10,), torch.float32), t)
    assert not seen.writable and seen.used == seen.capacity
    with pytest.raises(AssertionError, match="attached from another process"):
        seen.place(torch.ones(3))
    with pytest.raises(AssertionError, match="no tensor of"):
        seen.view(1 << 16, (1,), torch.uint8)  # past the end
    with pytest.raises(AssertionError, match="no tensor of"):
        seen.view(4, (1,), torch.float32)  # not on a tensor boundary


def test_an_arena_dropped_before_its_unlink_takes_its_file_along(shm):
    made = create_shared(4096)
    path = made.shared.path
    del made
    gc.collect()
    assert not os.path.exists(path)


def test_too_little_shared_memory_is_refused_before_anything_is_made(shm):
    free = shutil.disk_usage(shm).free
    with pytest.raises(PorosConfigError, match=r"--shm-size=\d+g"):
        create_shared(free + (1 << 30))
    assert os.listdir(shm) == []


def test_a_full_tmpfs_while_reserving_is_refused_and_leaves_no_file(shm, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(PorosConfigError, match="the shared host store needs"):
        create_shared(4096)
    assert os.listdir(shm) == []


def test_a_missing_folder_or_file_and_a_wrong_size_are_named(shm, tmp_path, monkeypatch):
    with pytest.raises(PorosConfigError, match="does not exist"):
        create_shared(4096, directory=str(tmp_path / "nowhere"))
    with pytest.raises(PorosConfigError, match="is not there"):
        attach_shared(os.path.join(shm, arena_mod.SHM_PREFIX + "gone"), 4096)
    made = create_shared(4096)
    with pytest.raises(PorosConfigError, match="holds 4096 bytes, this process expects 8192"):
        attach_shared(made.shared.path, 8192)
    made.shared.unlink()


def test_stale_files_of_dead_creators_are_removed_live_and_fresh_ones_kept(shm):
    live = create_shared(4096)  # holds its lock while it lives
    stale = os.path.join(shm, arena_mod.SHM_PREFIX + "1-dead")
    fresh = os.path.join(shm, arena_mod.SHM_PREFIX + "2-fresh")
    for path in (stale, fresh):
        with open(path, "wb") as f:
            f.write(b"x" * 4096)
    old = time.time() - 2 * arena_mod.STALE_AFTER_S
    for path in (stale, live.shared.path):
        os.utime(path, (old, old))
    assert remove_stale(shm) == [stale]
    assert sorted(os.listdir(shm)) == sorted(os.path.basename(p) for p in (fresh, live.shared.path))
    live.shared.unlink()
    fd = os.open(fresh, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a lock on another open file of it: a live holder
        os.utime(fresh, (old, old))
        assert remove_stale(shm) == []
    finally:
        os.close(fd)
    assert remove_stale(shm) == [fresh]
    assert os.listdir(shm) == []


# -- manifests --------------------------------------------------------------------------------------

def _lora() -> peft.LoraConfig:
    return peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=lora_targets("qwen2"))


@pytest.mark.parametrize("quantization", ["nf4", "bf16"])
def test_a_model_attached_through_its_manifest_is_the_loaded_one(quantization):
    config = tiny_config("qwen2", layers=2, tie_word_embeddings=quantization == "bf16")
    loaded = poros_fx.from_config(config, quantization=quantization, device="cpu", progress=False)
    arena = get_store(loaded).host.arena
    poros_fx.unprepare(loaded)  # the base as the loader hands it to prepare: what a host's leader describes
    described = manifest.describe(loaded, arena)
    twin = meta_model.meta_model(config, quantization, poros_fx.families.resolve("qwen2"))
    manifest.attach(twin, arena, described)
    meta_model.rebuild_buffers(twin, config)
    pairs = list(zip(loaded.state_dict().items(), twin.state_dict().items()))
    assert len(pairs) == len(loaded.state_dict()) == len(twin.state_dict())
    for (name, a), (other, b) in pairs:
        assert name == other and torch.equal(a, b), name
        if arena.holds(a):
            assert a.data_ptr() == b.data_ptr(), f"{name} is a copy, not the arena's bytes"
    if quantization == "nf4":
        qs = loaded.model.layers[0].mlp.down_proj.weight.quant_state
        qt = twin.model.layers[0].mlp.down_proj.weight.quant_state
        assert (qt.shape, qt.blocksize, qt.nested, qt.state2.blocksize, qt.quant_type) == (
            qs.shape, qs.blocksize, qs.nested, qs.state2.blocksize, qs.quant_type)
        assert torch.equal(qt.code, qs.code) and arena.holds(qt.state2.code)
    else:
        assert twin.lm_head.weight is twin.model.embed_tokens.weight  # still tied
    # prepared on the same arena, both compute the same logits
    poros_fx.prepare(loaded.requires_grad_(False), device="cpu", _arena=arena)
    poros_fx.prepare(twin.requires_grad_(False), device="cpu", _arena=arena)
    ids = demo_batches(1, seq=16)[0]["input_ids"]
    with torch.no_grad():
        expected = torch.compile(loaded, backend="poros")(input_ids=ids, use_cache=False).logits
        torch._dynamo.reset()
        got = torch.compile(twin, backend="poros")(input_ids=ids, use_cache=False).logits
    assert torch.equal(got, expected)


def test_a_manifest_of_another_model_is_refused():
    config = tiny_config("qwen2", layers=2)
    loaded = poros_fx.from_config(config, quantization="bf16", device="cpu", progress=False)
    described = manifest.describe(loaded, get_store(loaded).host.arena)
    other = meta_model.meta_model(tiny_config("qwen2", layers=3), "bf16", poros_fx.families.resolve("qwen2"))
    with pytest.raises(poros_fx.LoaderError, match="disagree on their tensors"):
        manifest.attach(other, get_store(loaded).host.arena, described)
    wider = meta_model.meta_model(tiny_config("qwen2", layers=2, vocab=512), "bf16", poros_fx.families.resolve("qwen2"))
    with pytest.raises(poros_fx.LoaderError, match="every rank must load the same model"):
        manifest.attach(wider, get_store(loaded).host.arena, described)


# -- when the loader shares --------------------------------------------------------------------------

def test_share_needs_a_process_group_and_a_bool(monkeypatch):
    config = tiny_config("qwen2", layers=2)
    with pytest.raises(PorosConfigError, match="share=True: .* not initialized"):
        poros_fx.from_config(config, quantization="bf16", device="cpu", progress=False, share=True)
    with pytest.raises(PorosConfigError, match="share must be True, False or None"):
        poros_fx.from_config(config, quantization="bf16", device="cpu", progress=False, share="yes")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.warns(UserWarning, match="each loads its own copy"):
        model = poros_fx.from_config(config, quantization="bf16", device="cpu", progress=False)
    assert poros_fx.load_report(model).shared_ranks == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        poros_fx.from_config(config, quantization="bf16", device="cpu", progress=False, share=False)


def test_torchrun_ranks_from_the_environment():
    env = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert distributed.launched_ranks(env) == distributed.Ranks(3, 4, 1, 2)
    assert distributed.launched_ranks({}) == distributed.Ranks(0, 1, 0, 1)
    with pytest.raises(PorosConfigError, match="must be integers"):
        distributed.launched_ranks({"RANK": "one"})
    with pytest.raises(PorosConfigError, match="inconsistent torchrun ranks"):
        distributed.launched_ranks({"RANK": "2", "WORLD_SIZE": "2"})


def test_init_process_group_needs_torchrun(monkeypatch):
    for name in ("MASTER_ADDR", "RANK"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(PorosConfigError, match="no torchrun environment"):
        distributed.init_process_group()


# -- DDP around a prepared model ---------------------------------------------------------------------

def test_the_host_store_goes_on_ddps_ignore_list():
    model = tiny_lora_model("qwen2", nf4=True, layers=2)
    with pytest.raises(PorosConfigError, match="not prepared"):
        distributed.ignore_host_store(model)
    poros_fx.prepare(model, device="cpu")
    names = distributed.ignore_host_store(model)
    params = dict(model.named_parameters(remove_duplicate=False))
    buffers = dict(model.named_buffers(remove_duplicate=False))
    store = get_store(model)
    hosts = {id(e.host) for e in store.host.tensors()}
    assert {id({**params, **buffers}[n]) for n in names} == hosts  # every host tensor, under its names
    assert not any(params[n].requires_grad for n in names if n in params)
    assert any(n.endswith(".poros_qs_absmax2") for n in names)  # the NF4 quant-state buffers too
    assert set(model._ddp_params_and_buffers_to_ignore) == set(names)
    with pytest.raises(PorosConfigError, match="wrap the prepared model itself"):
        distributed.ignore_host_store(torch.compile(model, backend="poros"))
    with pytest.raises(PorosConfigError, match="torch.distributed is not initialized"):
        distributed.data_parallel(model)


@pytest.fixture
def one_rank(tmp_path):
    """A process group of one rank (gloo) in this process."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_ddpoptimizer_is_named_when_it_is_in_charge(one_rank):
    seen: list[str] = []

    class Probe(torch.nn.Module):
        def __init__(self, inner: torch.nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, **batch):
            try:
                distributed.check_ddp_optimizer()
                seen.append("off")
            except PorosConfigError as e:
                seen.append(str(e))
            return self.inner(**batch)

    model = tiny_lora_model("qwen2", layers=2)
    poros_fx.prepare(model, device="cpu")
    probe = Probe(model)
    distributed.ignore_host_store(model)
    ddp = distributed.data_parallel(model)
    assert ddp.parameters_to_ignore == set(distributed.host_store_names(model))
    with pytest.raises(PorosConfigError, match="has no trainable parameters"):
        frozen = tiny_lora_model("qwen2", layers=2)
        poros_fx.prepare(frozen.requires_grad_(False), device="cpu")
        distributed.data_parallel(frozen)
    wrapped = torch.nn.parallel.DistributedDataParallel(probe)
    batch = demo_batches(1, seq=8)[0]
    with torch.no_grad():
        wrapped(**batch, use_cache=False)
        with distributed.no_ddp_optimizer():
            wrapped(**batch, use_cache=False)
    assert seen[0].startswith("Dynamo's DDPOptimizer is on") and seen[1] == "off"
    assert not distributed.ddp_optimizer_active()  # outside a DDP forward
