"""Several GPUs on one host: data parallelism on ``torch.distributed``, one host copy of the frozen base.

Each rank (one process per GPU, started by ``torchrun``) trains the same adapter on its share of the
data; ``DistributedDataParallel`` all-reduces the adapter's gradients as usual. What must not be
copied N times is the frozen base, so:

* **One host store per host** (``HostShare``): the ranks of a host (those that see one ``/dev/shm``)
  agree over a gloo group on one shared arena (``runtime/arena.py``). Its leader (the host's lowest
  rank, local rank 0 under torchrun) creates the file and, once every rank of the host has mapped it,
  unlinks it (nothing can leak after that, whatever kills the job); then the leader fills it (reads
  the checkpoint or builds from a config, ``io/loader.py``) and sends a manifest of where each tensor
  lies (``io/manifest.py``); the others build their module tree on ``meta`` and make its tensors views
  of the mapping. Each rank page-locks its own mapping for its own GPU (``prepare``). Every step is one
  ``all_gather_object``, so a failure on any rank reaches every rank, named, instead of a hang.
* **DDP around a prepared model** (``data_parallel``, ``ignore_host_store``): the host-store tensors
  are CPU tensors while the adapter is on the GPU; DDP refuses a module on two device types and
  would broadcast every parameter and buffer from rank 0 at start-up and every buffer before each
  forward. The host-store parameters and buffers go on DDP's ignore list: only the adapter is
  checked, broadcast and all-reduced.
* **Dynamo's DDPOptimizer off for poros graphs** (``no_ddp_optimizer``, ``check_ddp_optimizer``):
  inside a DDP forward it takes over every frame Dynamo converts, and it converts them without
  leaving the fake-tensor mode of the graph being traced; the ``torch.cond`` of ``poros_sdpa`` that a
  region traces inside the op's fake implementation then fails. It would split nothing useful
  anyway: a region takes its adapter as one list argument, which the bucket count does not see, and a
  split that did happen would fall between a block's load and its use. The adapter's gradients are
  all-reduced once at the end of the backward instead (LoRA gradients are a few MB).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import socket
import warnings
from typing import Any, Callable, Iterator, TypeVar

import torch
import torch.distributed as dist
from torch import nn

from .errors import PorosConfigError, PorosError

T = TypeVar("T")

# how long the ranks of a host wait for their leader to fill the shared store (a 72B checkpoint read
# takes minutes); a rank that stops is noticed at once (its connections close), this only bounds a
# leader that hangs
SHARE_TIMEOUT = datetime.timedelta(hours=2)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")

DDP_OPTIMIZER_MESSAGE = (
    "Dynamo's DDPOptimizer is on (torch._dynamo.config.optimize_ddp, True by default) while a "
    "DistributedDataParallel forward is being compiled with backend='poros': it converts the frames of the "
    "decoder-layer regions inside the fake-tensor mode of the outer trace and fails on their torch.cond, and a graph "
    "split at its bucket boundaries would cut a block from its load. Turn it off for poros graphs: set "
    "torch._dynamo.config.optimize_ddp = False before the first step, or call the compiled model inside "
    "`with poros_fx.distributed.no_ddp_optimizer():` (every call: a new sequence length compiles again). The adapter's "
    "gradients are then all-reduced once at the end of the backward.")


@dataclasses.dataclass(frozen=True)
class Ranks:
    """Where this process stands in a ``torchrun`` job (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
    ``LOCAL_WORLD_SIZE``; one process is ``Ranks(0, 1, 0, 1)``)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def launched_ranks(environ: dict[str, str] | None = None) -> Ranks:
    """This process's ranks from torchrun's environment variables (a plain process: one rank of one)."""
    env = os.environ if environ is None else environ
    try:
        values = {k: int(env[k]) for k in TORCHRUN_ENV if env.get(k) not in (None, "")}
    except ValueError as e:
        raise PorosConfigError(f"torchrun's rank variables must be integers ({e}); got "
                               + ", ".join(f"{k}={env.get(k)!r}" for k in TORCHRUN_ENV)) from None
    world = values.get("WORLD_SIZE", 1)
    rank = values.get("RANK", 0)
    local_world = values.get("LOCAL_WORLD_SIZE", world)
    local = values.get("LOCAL_RANK", rank)
    if not (0 <= rank < world and 0 <= local < local_world <= world):
        raise PorosConfigError(f"inconsistent torchrun ranks: RANK={rank} WORLD_SIZE={world} LOCAL_RANK={local} "
                               f"LOCAL_WORLD_SIZE={local_world}")
    return Ranks(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)


def rank_device(ranks: Ranks | None = None) -> torch.device:
    """The compute device of this rank: ``cuda:LOCAL_RANK`` when CUDA is there, else the CPU."""
    ranks = launched_ranks() if ranks is None else ranks
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if ranks.local_rank >= count:
        raise PorosConfigError(f"local rank {ranks.local_rank} has no GPU of its own: torch sees {count} GPU(s) on "
                               f"this host; start at most {count} processes per host (torchrun --nproc-per-node "
                               f"{count}) or check CUDA_VISIBLE_DEVICES")
    return torch.device("cuda", ranks.local_rank)


def init_process_group(timeout: datetime.timedelta | None = None) -> Ranks:
    """``torch.distributed.init_process_group`` from torchrun's environment, unless it is initialized
    already: NCCL with this rank's GPU selected when CUDA is there, gloo otherwise. Returns the ranks."""
    ranks = launched_ranks()
    if not dist.is_available():
        raise PorosConfigError("this torch build has no torch.distributed; several GPUs need it")
    if dist.is_initialized():
        return ranks
    if "MASTER_ADDR" not in os.environ or "RANK" not in os.environ:
        raise PorosConfigError("no torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, ...): start the job with "
                               "`torchrun --nproc-per-node N ...` (or call torch.distributed.init_process_group "
                               "yourself before poros-fx)")
    device = rank_device(ranks)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timeout, device_id=device)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    return ranks


# -- DDP around a prepared model ----------------------------------------------------------------------

def host_store_names(model: nn.Module) -> list[str]:
    """Qualified names (as ``model.named_parameters()`` / ``named_buffers()`` give them) of every
    parameter and buffer of ``model`` that lives in a poros host store."""
    from .prepare import ENTRY_ATTR

    names = [n for n, p in model.named_parameters(remove_duplicate=False) if hasattr(p, ENTRY_ATTR)]
    names += [n for n, b in model.named_buffers(remove_duplicate=False) if hasattr(b, ENTRY_ATTR)]
    return names


def ignore_host_store(model: nn.Module) -> list[str]:
    """Put the host-store tensors of a prepared ``model`` on DDP's ignore list (before wrapping it):
    DDP then checks, broadcasts and all-reduces the adapter only. Returns the names ignored."""
    from .prepare import get_store

    if get_store(model) is None:
        raise PorosConfigError("the model is not prepared: call poros_fx.prepare(model) (or load it with "
                               "poros_fx.load_pretrained / from_config) before wrapping it in DistributedDataParallel; "
                               "DDP would otherwise see the whole frozen base as its parameters")
    if hasattr(model, "_orig_mod"):
        raise PorosConfigError("wrap the prepared model itself in DistributedDataParallel and torch.compile the DDP "
                               "module (torch.compile(DDP(model), backend='poros')), not the other way around")
    names = host_store_names(model)
    known = set(getattr(model, "_ddp_params_and_buffers_to_ignore", ()))
    from torch.nn.parallel import DistributedDataParallel

    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(model, sorted(known | set(names)))
    return names


def data_parallel(model: nn.Module, **ddp_kwargs: Any) -> nn.Module:
    """``DistributedDataParallel(model, ...)`` for a prepared ``model``: host-store tensors ignored
    (``ignore_host_store``), ``device_ids`` set to the adapter's GPU on CUDA. Compile the result with
    ``torch.compile(ddp, backend="poros")`` and run it with Dynamo's DDPOptimizer off
    (``no_ddp_optimizer``)."""
    if not dist.is_available() or not dist.is_initialized():
        raise PorosConfigError("torch.distributed is not initialized: start the job with torchrun and call "
                               "poros_fx.distributed.init_process_group() (or torch.distributed.init_process_group) "
                               "before data_parallel")
    ignore_host_store(model)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if not trainable:
        raise PorosConfigError("the prepared model has no trainable parameters (no adapter, or a frozen one): there "
                               "is nothing for DistributedDataParallel to all-reduce")
    device = trainable[0].device
    if device.type == "cuda" and "device_ids" not in ddp_kwargs:
        ddp_kwargs["device_ids"] = [device.index]
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, **ddp_kwargs)


def ddp_optimizer_active() -> bool:
    """Whether Dynamo's DDPOptimizer would take over a frame converted now: ``optimize_ddp`` is in its
    ``ddp_optimizer`` mode and a DistributedDataParallel forward is running."""
    from torch.nn.parallel import DistributedDataParallel

    mode = torch._dynamo.config.optimize_ddp  # True and "ddp_optimizer" are the same mode
    return mode in (True, "ddp_optimizer") and DistributedDataParallel._get_active_ddp_module() is not None


def check_ddp_optimizer() -> None:
    """Raise ``PorosConfigError`` (saying how to turn it off) when Dynamo's DDPOptimizer is in charge of
    the graph being compiled now (see the module docstring for why poros graphs need it off)."""
    if ddp_optimizer_active():
        raise PorosConfigError(DDP_OPTIMIZER_MESSAGE)


@contextlib.contextmanager
def no_ddp_optimizer() -> Iterator[None]:
    """Dynamo's DDPOptimizer off inside the block (``torch._dynamo.config.optimize_ddp = False``), the
    setting restored after. Wrap every call of a compiled DDP model in it: Dynamo reads the setting each
    time it compiles, and a new input shape compiles again."""
    with torch._dynamo.config.patch(optimize_ddp=False):
        yield


# -- one host store per host ---------------------------------------------------------------------------

def host_key() -> str:
    """What makes two processes share a host store: the same host (name and boot), and the same
    shared-memory folder (a container with its own /dev/shm is another host for this)."""
    from .runtime.arena import shm_dir

    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    try:
        st = os.stat(shm_dir())
        folder = f"{st.st_dev}:{st.st_ino}"
    except OSError:
        folder = "?"
    return f"{socket.gethostname()}|{boot}|{shm_dir()}|{folder}"


def wants_share(share: bool | None) -> bool:
    """Whether a load should go through ``HostShare``: ``share=True`` needs torch.distributed initialized;
    ``None`` shares when it is initialized with more than one rank, and warns when torchrun started
    several ranks on this host without a process group (each then loads its own copy)."""
    initialized = dist.is_available() and dist.is_initialized()
    if share is True and not initialized:
        raise PorosConfigError("share=True: the ranks of a host share one host store through torch.distributed, "
                               "which is not initialized; call torch.distributed.init_process_group() (or "
                               "poros_fx.distributed.init_process_group()) first, or pass share=False")
    if share is False:
        return False
    if initialized:
        return dist.get_world_size() > 1
    try:
        ranks = launched_ranks()
    except PorosConfigError:  # not a torchrun environment poros-fx can read: nothing to say about it here
        return False
    if ranks.local_world_size > 1:
        warnings.warn(f"{ranks.local_world_size} ranks run on this host but torch.distributed is not initialized, so "
                      "each loads its own copy of the base into host memory; call torch.distributed."
                      "init_process_group() before loading to keep one shared copy per host (share=False silences "
                      "this)", stacklevel=3)
    return False


class HostShare:
    """The ranks of every host agreeing on one shared arena per host, over their own gloo group.

    ``HostShare.open(capacity)`` is collective over all ranks (call it on every rank, in the same
    order as the other collectives). It returns ``None`` when no host has two ranks (nothing to share);
    else the share, whose ``arena`` is mapped on every rank of this host and already unlinked.
    ``from_leader(fn)`` runs ``fn`` on each host's leader (filling the arena, describing it) and hands
    its result to every rank of that host. An exception on any rank makes every rank raise, naming the
    rank and its reason; a rank that dies makes the others' next step fail at once (its connections
    close). ``close`` frees the group.
    """

    def __init__(self, group: Any, rank: int, hosts: list[str]) -> None:
        self.group = group
        self.rank = rank
        self.hosts = hosts  # host key of every rank
        mine = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        self.leader_rank = mine[0]
        self.local_rank = mine.index(rank)
        self.local_world_size = len(mine)
        self.arena: Any = None  # runtime.arena.HostArena, set by open

    @property
    def leader(self) -> bool:
        return self.rank == self.leader_rank

    @classmethod
    def open(cls, capacity: int, *, before_create: Callable[[], None] | None = None,
             timeout: datetime.timedelta = SHARE_TIMEOUT) -> "HostShare | None":
        """Create (leader) or map (the others) this host's shared arena of ``capacity`` bytes;
        ``before_create`` runs on each leader first (the host-RAM check)."""
        group = dist.new_group(backend="gloo", timeout=timeout)
        rank = dist.get_rank()
        share = None
        try:
            hosts = _gather(group, rank, host_key(), "finding the ranks of each host")
            share = cls(group, rank, hosts)
            if max(hosts.count(h) for h in hosts) < 2:
                share.close()
                return None
            share._map(capacity, before_create)
            return share
        except BaseException:
            if share is not None:
                share.close()
            else:
                dist.destroy_process_group(group)
            raise

    def _map(self, capacity: int, before_create: Callable[[], None] | None) -> None:
        from .runtime.arena import attach_shared, create_shared

        def create() -> str:
            if before_create is not None:
                before_create()
            self.arena = create_shared(capacity)
            return self.arena.shared.path

        try:
            path = self.from_leader(create, "creating the shared host store")
            status: dict[str, Any] = {}
            if not self.leader:
                try:
                    self.arena = attach_shared(path, capacity)
                except Exception as e:  # reported to every rank by the exchange below
                    status = {"error": _reason(e)}
            self.agree(status, "mapping the shared host store")
        finally:
            if self.leader and self.arena is not None:
                self.arena.shared.unlink()  # every rank has mapped it (or failed): its name goes now

    def from_leader(self, fn: Callable[[], T] | None, what: str) -> T:
        """``fn()`` on this host's leader (``fn`` is not called elsewhere and may be ``None`` there),
        its result on every rank of the host. The leader's exception is raised on the leader and named
        on the other ranks."""
        payload: dict[str, Any] = {}
        error: BaseException | None = None
        if self.leader:
            try:
                payload = {"value": fn()}
            except Exception as e:
                error, payload = e, {"error": _reason(e)}
        results = self.agree(payload, what, own_error=error)
        return results[self.leader_rank]["value"]

    def agree(self, payload: dict[str, Any], what: str, own_error: BaseException | None = None) -> list[dict]:
        """One step every rank takes together: each rank's ``payload`` (``{"error": reason}`` when it
        failed) to every rank; raises ``own_error`` here, or a ``PorosError`` naming every rank that
        failed. Returns the payloads by rank."""
        results = _gather(self.group, self.rank, payload, what)
        if own_error is not None:
            raise own_error
        failed = [(r, p["error"]) for r, p in enumerate(results) if isinstance(p, dict) and "error" in p]
        if failed:
            named = "; ".join(f"rank {r}{' (this host)' if self.hosts[r] == self.hosts[self.rank] else ''}: {reason}"
                              for r, reason in failed)
            raise PorosError(f"rank {self.rank}: {what} failed on {named}")
        return results

    def close(self) -> None:
        """Free the gloo group (the arena stays mapped as long as tensors use it)."""
        if self.group is not None:
            dist.destroy_process_group(self.group)
            self.group = None


def _gather(group: Any, rank: int, payload: Any, what: str) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size(group)
    try:
        dist.all_gather_object(out, payload, group=group)
    except RuntimeError as e:  # gloo: a peer's connection closed (it stopped), or the timeout passed
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PorosError(f"rank {rank}: lost contact with the other ranks while {what} (another rank stopped or "
                         f"hangs; its own log, or torchrun's summary, names it and why): {first}") from e
    return out


def _reason(e: BaseException) -> str:
    text = str(e).strip()
    return f"{type(e).__name__}: {text}" if text else type(e).__name__
