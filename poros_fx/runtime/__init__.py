"""What runs while a step runs: the host store, the residency ledger, and the graph runtime."""

from .ledger import ResidencyLedger
from .store import HostEntry, HostStore

__all__ = ["HostEntry", "HostStore", "ResidencyLedger"]
