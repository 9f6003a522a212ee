"""poros-fx: stream a frozen LoRA/QLoRA base through the GPU block by block, inside torch.compile.

The layout follows the pipeline: ``compiler`` (the backend, schedule, ops, regions, dumps) runs the
passes (``poros_fx.passes``, the repository's ``passes/`` folder) and hands the graphs to ``runtime``
(host store, copies, ledger); ``io`` reads and writes checkpoints and data. The user surfaces
(``prepare``, ``step``, ``hf``, ``sft``) sit above them; ``training`` (the loop behind ``FineTuner`` and
``poros-fx train``), ``exactness`` (the parity harness and the configuration generator), ``bench`` and
``cli`` (the ``poros-fx`` command) sit on top. ``tests/test_layers.py`` holds the order.
"""

from .noise import filter_third_party_noise

filter_third_party_noise()  # before bitsandbytes is imported (below)

from .compiler import ops  # registers poros::load
from .errors import (NoBlocksError, PorosConfigError, PorosError, PorosExactnessError, PorosOOMError,
                     UnsupportedArchitectureError)
from .families import VALIDATED, Family, user_asserted
from .prepare import prepare, unprepare
from .io.loader import LoaderError, LoadReport, from_config, load_pretrained, load_report
from .report import report
from .stats import stats
from .runtime.accumulate import block_major
from .runtime.lengths import mark_dynamic
from .step import PorosStep, step
from .training.finetune import FineTuner

__version__ = "0.1.0"


def __getattr__(name: str):
    # PorosTrainer imports transformers' Trainer, PorosSFTTrainer the optional trl: load them only when asked for
    if name == "PorosTrainer":
        from .hf import PorosTrainer  # lazy: transformers.Trainer

        return PorosTrainer
    if name == "PorosSFTTrainer":
        from .sft import PorosSFTTrainer  # lazy: trl

        return PorosSFTTrainer
    raise AttributeError(f"module 'poros_fx' has no attribute {name!r}")

__all__ = [
    "VALIDATED", "Family", "FineTuner", "LoadReport", "LoaderError", "from_config", "load_pretrained", "load_report", "NoBlocksError", "PorosConfigError", "PorosError", "PorosExactnessError", "PorosOOMError",
    "PorosSFTTrainer", "PorosStep", "PorosTrainer", "UnsupportedArchitectureError", "block_major", "mark_dynamic", "ops", "prepare", "report", "stats", "step", "unprepare", "user_asserted",
]
