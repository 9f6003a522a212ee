"""One host store per host: the ranks of a host share one arena over their own gloo group.

The ranks of a host (those that see one ``/dev/shm``) agree over a gloo group on one shared arena
(``runtime/arena.py``). Its leader (the host's lowest rank, local rank 0 under torchrun) creates the
file and, once every rank of the host has mapped it, unlinks it (nothing can leak after that, whatever
kills the job); then the leader fills it (reads the checkpoint or builds from a config, ``io/``) and
sends a manifest of where each tensor lies (``io/manifest.py``); the others build their module tree on
``meta`` and make its tensors views of the mapping. Every step is one ``all_gather_object``, so a
failure on any rank reaches every rank, named, instead of a hang. ``launched_ranks`` reads torchrun's
environment. ``poros_fx.distributed`` re-exports these names for users.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import socket
import warnings
from typing import Any, Callable, TypeVar

import torch.distributed as dist

from ..errors import PorosConfigError, PorosError
from .arena import attach_shared, create_shared, shm_dir

T = TypeVar("T")

# how long the ranks of a host wait for their leader to fill the shared store (a 72B checkpoint read
# takes minutes); a rank that stops is noticed at once (its connections close), this only bounds a
# leader that hangs
SHARE_TIMEOUT = datetime.timedelta(hours=2)
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")


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


def host_key() -> str:
    """What makes two processes share a host store: the same host (name and boot), and the same
    shared-memory folder (a container with its own /dev/shm is another host for this)."""
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
        same_host = [r for r, h in enumerate(hosts) if h == hosts[rank]]
        self.leader_rank = same_host[0]
        self.local_rank = same_host.index(rank)
        self.local_world_size = len(same_host)
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
