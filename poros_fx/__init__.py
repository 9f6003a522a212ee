"""poros-fx: stream a frozen LoRA/QLoRA base through the GPU block by block, inside torch.compile."""

from . import ops  # registers poros::load
from .errors import (NoBlocksError, PorosConfigError, PorosError, PorosExactnessError, PorosOOMError,
                     UnsupportedArchitectureError)
from .families import VALIDATED, Family, user_asserted
from .prepare import prepare, unprepare
from .loader import LoaderError, LoadReport, from_config, load_pretrained, load_report
from .report import report
from .stats import stats
from .step import PorosStep, step

__version__ = "0.1.0"


def __getattr__(name: str):
    # PorosTrainer imports transformers' Trainer: load it only when asked for
    if name == "PorosTrainer":
        from .hf import PorosTrainer

        return PorosTrainer
    raise AttributeError(f"module 'poros_fx' has no attribute {name!r}")

__all__ = [
    "VALIDATED", "Family", "LoadReport", "LoaderError", "from_config", "load_pretrained", "load_report", "NoBlocksError", "PorosConfigError", "PorosError", "PorosExactnessError", "PorosOOMError",
    "PorosStep", "PorosTrainer", "UnsupportedArchitectureError", "ops", "prepare", "report", "stats", "step", "unprepare", "user_asserted",
]
