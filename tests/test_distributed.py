"""Several ranks on CPU (gloo, 2 processes): DDP over a prepared model, exact, and one shared host store.

Each test starts its ranks as fresh processes (``multiprocessing`` forkserver) with torchrun's environment
variables and a gloo process group; every rank writes what it saw to a file, and the test reads them
back. The shared host stores go to a private folder in ``/dev/shm`` (``POROS_FX_SHM_DIR``), which must
be empty when the ranks are done: nothing leaks, also when a rank fails or dies. The same code runs
on N GPUs with NCCL (``poros_fx.distributed.init_process_group`` picks it); those runs are marked
``gpu``.
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
import shutil
import socket
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch

from poros_fx.exactness.parity import SURFACES, compare, format_diffs

EQUAL = {s: 0.0 for s in SURFACES}
RANK_TIMEOUT_S = 240  # a rank still running after this is a hang: the test fails and kills it


# -- running ranks ----------------------------------------------------------------------------------

@pytest.fixture
def shm(monkeypatch):
    """A private tmpfs folder for this test's shared host stores (checked empty by the tests)."""
    folder = tempfile.mkdtemp(prefix="poros-test-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    monkeypatch.setenv("POROS_FX_SHM_DIR", folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Ranks fork from a server process (one per test worker) that imported these once, as multiprocessing's
# forkserver does: a spawned rank spent ~8 s importing torch, transformers and peft before its first line.
# The server imports nothing else and never runs a step (no Dynamo state, no CUDA, no thread pool).
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "transformers", "peft", "poros_fx", "test_distributed"])


def _rank_main(target: Callable[..., Any], rank: int, world: int, port: int, out: str, args: tuple,
               env: dict[str, str]) -> None:
    os.environ.clear()  # the test's environment now, not the server's from when it started
    os.environ.update(env)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    import warnings

    warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
    import torch.distributed as dist

    from poros_fx import distributed

    code = 0
    try:
        distributed.init_process_group()  # gloo here (no CUDA); NCCL on GPUs
        result = target(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException as e:  # reported to the test through the file
        (Path(out) / f"rank{rank}.err").write_text(f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
        code = 1
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    os._exit(code)


def run_ranks(target: Callable[..., Any], out: Path, *args: Any, world: int = 2) -> list[dict[str, Any]]:
    """``target(rank, world, *args)`` on ``world`` fresh processes; per rank: ``result`` (what it returned),
    ``error`` (its exception text) and ``exitcode``. Fails the test if a rank is still running after
    ``RANK_TIMEOUT_S`` (a hang)."""
    port = _free_port()
    procs = [_CONTEXT.Process(target=_rank_main, args=(target, r, world, port, str(out), args, dict(os.environ)))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + RANK_TIMEOUT_S
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} still running after {RANK_TIMEOUT_S} s (a hang)"
    results = []
    for r, p in enumerate(procs):
        res, err = out / f"rank{r}.pt", out / f"rank{r}.err"
        results.append({"exitcode": p.exitcode, "result": torch.load(res, weights_only=False) if res.exists() else None,
                        "error": err.read_text() if err.exists() else None})
    return results


def _ok(results: list[dict[str, Any]]) -> list[Any]:
    for r, res in enumerate(results):
        assert res["exitcode"] == 0 and res["error"] is None, f"rank {r} failed:\n{res['error']}"
    return [res["result"] for res in results]


# -- DDP around a prepared model: streamed == stream=False on every rank ------------------------------

# a rank's prepared models, kept until it exits: the stream=False model takes the streamed one's region
# instead of tracing it again (~6 s), as in every in-process parity test
_LIVE: list[torch.nn.Module] = []


def _ddp_run(rank: int, stream: bool) -> tuple[Any, dict[str, Any]]:
    """The recipe of docs/distributed.md on a user's own model: prepare, DDP with the host store
    ignored, torch.compile of the DDP module, AdamW with dropout 0.1, DDPOptimizer off."""
    from torch.nn.parallel import DistributedDataParallel

    import poros_fx
    from poros_fx import distributed
    from poros_fx.exactness.parity import train
    from poros_fx.models.tiny import demo_batches, tiny_lora_model

    torch._dynamo.reset()
    model = tiny_lora_model("qwen2", layers=2, dropout=0.1, seed=0)  # the same base and adapter on every rank
    poros_fx.prepare(model, device="cpu")
    _LIVE.append(model)
    distributed.ignore_host_store(model)
    ddp = DistributedDataParallel(model)
    compiled = torch.compile(ddp, backend="poros", options={"stream": stream})
    data = demo_batches(6, seq=16, seed=100 + rank)  # each rank its own batches
    with distributed.no_ddp_optimizer():
        trace = train(model, compiled, data, accumulate=2, seed=1234)
    return trace, poros_fx.stats(model)


def _ddp_exact(rank: int, world: int) -> dict[str, Any]:
    streamed, s_stats = _ddp_run(rank, stream=True)
    resident, r_stats = _ddp_run(rank, stream=False)  # an independent model, compiled again
    return {"diffs": compare(streamed, resident), "streamed": streamed, "s_stats": s_stats, "r_stats": r_stats}


def test_ddp_streamed_equals_stream_false_on_two_ranks(tmp_path):
    ranks = _ok(run_ranks(_ddp_exact, tmp_path))
    for r, res in enumerate(ranks):
        assert res["diffs"] == EQUAL, format_diffs(f"rank {r}: streamed vs stream=False", res["diffs"])
        assert res["s_stats"]["loads"] > 0 and res["s_stats"]["recomputed_blocks"] > 0  # it did stream
        assert res["r_stats"]["recomputed_blocks"] == 0
    a, b = (res["streamed"] for res in ranks)
    # the ranks trained on different batches (their losses differ) and hold one adapter: DDP all-reduced
    assert not any(torch.equal(x, y) for x, y in zip(a.losses, b.losses))
    for step_a, step_b in zip(a.weights, b.weights):
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b))


# -- one shared host store per host -----------------------------------------------------------------

def _host_digests(model: torch.nn.Module) -> dict[str, str]:
    from poros_fx.prepare import get_store

    store = get_store(model)
    return {e.name: hashlib.sha256(e.host.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()
            for e in store.host.tensors()}


def _shared_load(rank: int, world: int, shm: str) -> dict[str, Any]:
    import peft

    import poros_fx
    from poros_fx import distributed
    from poros_fx.prepare import get_store
    from poros_fx.exactness.parity import train
    from poros_fx.models.tiny import demo_batches, lora_targets, tiny_config

    torch.manual_seed(0)  # the LoRA init, the same on every rank
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=lora_targets("qwen2"))
    model = poros_fx.from_config(tiny_config("qwen2", layers=2), quantization="nf4", device="cpu", seed=0, lora=lora,
                                 progress=False)
    store = get_store(model)
    left = os.listdir(shm)  # the arena's name is gone as soon as every rank mapped it
    report = poros_fx.load_report(model)
    model.train()
    compiled = torch.compile(distributed.data_parallel(model), backend="poros")
    with distributed.no_ddp_optimizer():
        trace = train(model, compiled, demo_batches(2, seq=16, seed=100 + rank))
    return {"left": left, "shared_ranks": report.shared_ranks, "attached": report.attached,
            "path": store.host.arena.shared.path, "inode_gone": not store.host.arena.shared.linked,
            "digests": _host_digests(model), "weights": trace.weights, "losses": trace.losses,
            "loads": poros_fx.stats(model)["loads"]}


def test_two_ranks_share_one_host_store_and_train(tmp_path, shm):
    import peft

    import poros_fx
    from poros_fx.models.tiny import lora_targets, tiny_config

    ranks = _ok(run_ranks(_shared_load, tmp_path, shm))
    assert [r["attached"] for r in ranks] == [False, True]  # rank 0 built the base, rank 1 mapped it
    assert [r["shared_ranks"] for r in ranks] == [2, 2]
    assert ranks[0]["path"] == ranks[1]["path"] and all(r["inode_gone"] and r["left"] == [] for r in ranks)
    assert os.listdir(shm) == []
    # the same bytes as a private load of the same config and seed (NF4 quantized once, by rank 0)
    torch.manual_seed(0)
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=lora_targets("qwen2"))
    private = poros_fx.from_config(tiny_config("qwen2", layers=2), quantization="nf4", device="cpu", seed=0,
                                   lora=lora, progress=False, share=False)
    expected = _host_digests(private)
    assert any(".quant_state.absmax2" in name for name in expected)  # NF4 with its nested quant state
    assert ranks[0]["digests"] == expected and ranks[1]["digests"] == expected
    # both ranks trained streamed and hold one adapter after the all-reduce
    assert all(r["loads"] > 0 for r in ranks)
    assert not torch.equal(ranks[0]["losses"][0], ranks[1]["losses"][0])
    assert all(torch.equal(x, y) for x, y in zip(ranks[0]["weights"][-1], ranks[1]["weights"][-1]))


def _leader_fails(rank: int, world: int) -> None:
    import poros_fx
    from poros_fx.models.tiny import tiny_config

    # rank 0 (the host's leader) is told there is no host RAM; rank 1 would not check (it takes none)
    poros_fx.from_config(tiny_config("qwen2", layers=2), quantization="bf16", device="cpu", progress=False,
                         available_ram=1)


def test_a_failing_leader_fails_every_rank_by_name(tmp_path, shm):
    ranks = run_ranks(_leader_fails, tmp_path)
    assert [r["exitcode"] for r in ranks] == [1, 1]
    assert ranks[0]["error"].startswith("LoaderError: not enough host RAM")
    assert ranks[1]["error"].startswith("PorosError: rank 1: creating the shared host store failed on rank 0 (this "
                                        "host): LoaderError: not enough host RAM"), ranks[1]["error"]
    assert os.listdir(shm) == []


def _rank_dies(rank: int, world: int) -> str:
    from poros_fx.distributed import HostShare

    share = HostShare.open(1 << 20)
    if rank == 1:
        os._exit(3)  # killed while its leader fills the store
    try:
        share.from_leader(lambda: time.sleep(0.5), "filling the shared host store")
    finally:
        share.close()
    return "not reached"


def test_a_rank_that_dies_fails_the_others_without_a_hang_or_a_leak(tmp_path, shm):
    started = time.monotonic()
    ranks = run_ranks(_rank_dies, tmp_path)
    assert ranks[1]["exitcode"] == 3
    assert ranks[0]["exitcode"] == 1
    assert ranks[0]["error"].startswith("PorosError: rank 0: lost contact with the other ranks while filling the "
                                        "shared host store"), ranks[0]["error"]
    assert os.listdir(shm) == []  # unlinked as soon as both had mapped it
    assert time.monotonic() - started < RANK_TIMEOUT_S


# -- GPUs (NCCL); skipped without CUDA -----------------------------------------------------------------

@pytest.mark.gpu
def test_rank_without_a_gpu_of_its_own_is_refused():
    from poros_fx.distributed import Ranks, rank_device
    from poros_fx.errors import PorosConfigError

    count = torch.cuda.device_count()
    assert rank_device(Ranks(rank=0, world_size=count, local_rank=0, local_world_size=count)) == torch.device("cuda", 0)
    with pytest.raises(PorosConfigError, match="has no GPU of its own"):
        rank_device(Ranks(rank=count, world_size=count + 1, local_rank=count, local_world_size=count + 1))


def _gpu_exact(rank: int, world: int, quantization: str) -> dict[str, Any]:
    import peft

    import poros_fx
    from poros_fx import distributed
    from poros_fx.exactness.parity import train
    from poros_fx.models.tiny import demo_batches, lora_targets, tiny_config

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    device = distributed.rank_device()
    traces, shared = [], []
    for stream in (True, False):
        torch._dynamo.reset()
        torch.manual_seed(0)
        lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.1, target_modules=lora_targets("qwen2"))
        model = poros_fx.from_config(tiny_config("qwen2", layers=4), quantization=quantization, device=device, seed=0,
                                     lora=lora, progress=False)
        shared.append(poros_fx.load_report(model).shared_ranks)
        model.train()
        compiled = torch.compile(distributed.data_parallel(model), backend="poros", options={"stream": stream})
        data = [{k: v.to(device) for k, v in b.items()} for b in demo_batches(8, seq=64, seed=100 + rank)]
        with distributed.no_ddp_optimizer():
            traces.append(train(model, compiled, data, accumulate=2))
        del compiled, model
    return {"diffs": compare(*traces), "shared": shared}


@pytest.mark.gpu
@pytest.mark.parametrize("quantization", ["nf4", "bf16"])
def test_two_gpus_nccl_streamed_equals_stream_false(tmp_path, shm, quantization):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    for r, res in enumerate(_ok(run_ranks(_gpu_exact, tmp_path, quantization))):
        assert res["diffs"] == EQUAL, format_diffs(f"rank {r}: streamed vs stream=False", res["diffs"])
        assert res["shared"] == [2, 2]
    assert os.listdir(shm) == []


@pytest.mark.gpu
def test_a_shared_arena_is_page_locked_by_each_mapping(shm):
    from poros_fx.runtime.arena import attach_shared, create_shared

    made = create_shared(1 << 20)
    seen = attach_shared(made.shared.path, 1 << 20)
    made.shared.unlink()
    values = made.place(torch.arange(1 << 18, dtype=torch.float32))
    for arena in (made, seen):  # two ranks' mappings of the same pages, each registered
        arena.pin()
        got = arena.view(0, (1 << 18,), torch.float32).to("cuda", non_blocking=True)
        torch.cuda.synchronize()
        assert torch.equal(got.cpu(), values)
    for arena in (made, seen):
        arena.unpin()


# -- the multi-GPU benchmark launcher, on CPU ------------------------------------------------------------

def test_multi_bench_runs_poros_on_two_ranks_and_records_failures(tmp_path, capsys):
    """`poros-fx bench --nproc`: each row a torchrun job of `poros-fx bench --worker multi-gpu` ranks."""
    from train_helper import run_cli

    from poros_fx.bench import make_multi_config
    from poros_fx.bench import multi_gpu as multi_bench

    code, out, err = run_cli(capsys, "bench", "--nproc", "2", "--device", "cpu", "--models", "tiny", "--rows", "poros:2",
                             "--steps", "1", "--warmup", "1", "--seqs", "16", "--json", str(tmp_path / "multi.json"))
    assert code == 0, err
    results = tmp_path / "multi"  # the --json path without its suffix
    doc = json.loads((results / "multi_bench.json").read_text())
    assert doc["command"].startswith("poros-fx bench --nproc 2") and "| poros | 2 |" in out
    config = make_multi_config(nproc=2, device="cpu", models="tiny", seqs="16")
    (row,) = doc["rows"]
    assert row.get("error") is None, row.get("error")
    assert (row["method"], row["nproc"], len(row["ranks"]), len(row["loss"])) == ("poros", 2, 2, 2)
    assert row["tokens_per_s"] > 0 and len(row["host_pss_gb"]) == 1  # two ranks, one host
    assert "peak_gb" not in row  # no GPU
    saved = (results / "multi_bench.json").read_text()
    assert '"tokens_per_s"' in saved and "| poros | 2 |" in (results / "multi_bench.md").read_text()
    assert (results / "logs" / "poros-2.log").exists()
    # a rank's error becomes the row's, named by rank
    failed = multi_bench.summarize([{"rank": 0, "error": "ValueError: quant_state is required"},
                                    {"rank": 1, "error": "ValueError: quant_state is required"}], config)
    assert failed["error"] == "rank 0: ValueError: quant_state is required; rank 1: ValueError: quant_state is required"
    assert make_multi_config(nproc=4, device="cpu").rows == (("poros", 1), ("poros", 4), ("fsdp2_offload", 4))
    with pytest.raises(ValueError, match="--rows: 'poros:0'"):
        make_multi_config(nproc=2, device="cpu", rows="poros:0")
