"""What runs while a step runs: the host store (its host tensors, their residency, the memory budget),
the residency ledger, and the graph runtime."""

from .host_tensors import HostEntry, HostTensors
from .ledger import ResidencyLedger
from .residency import Residency
from .store import HostStore

__all__ = ["HostEntry", "HostStore", "HostTensors", "Residency", "ResidencyLedger"]
