"""poros-fx: stream a frozen LoRA/QLoRA base through the GPU block by block, inside torch.compile."""

from . import ops  # registers poros::load
from .errors import NoBlocksError, PorosConfigError, PorosError, PorosExactnessError, UnsupportedArchitectureError
from .families import VALIDATED, Family, user_asserted
from .prepare import prepare, unprepare
from .stats import stats

__version__ = "0.1.0"

__all__ = [
    "VALIDATED", "Family", "NoBlocksError", "PorosConfigError", "PorosError", "PorosExactnessError",
    "UnsupportedArchitectureError", "ops", "prepare", "stats", "unprepare", "user_asserted",
]
