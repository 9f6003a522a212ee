import logging
import os
import warnings

import pytest
import torch

from poros_fx.compiler.regions import table as region_tables

# deterministic CPU kernels and a quiet log; tests build tiny models and never touch a hub
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # one intra-op thread per xdist worker (and for the processes a test starts): `make test` runs two
    # workers on two cores, and two OpenMP pools of two threads each on them made a tiny parity case take
    # 80 s instead of 15 s; the tiny models gain nothing from a second thread
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*")
# pytest attaches its capture handlers to every logger that does not propagate, torch's structured-trace
# logger among them; torch then renders a trace record (graphs as text) for every compile event, which
# goes nowhere without TORCH_TRACE. Propagating, the logger keeps only torch's own handler, which removes
# itself at the first event.
logging.getLogger("torch.__trace").propagate = True


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (gpu marker)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def _traced_regions():
    """(layer fingerprint, call, grads, inputs' dtypes/devices/ranks) -> a region table that holds a
    lowered region for it, kept for the whole session."""
    return {}


@pytest.fixture(autouse=True)
def _keep_region_traces(_traced_regions):
    """After each test, keep one region table per layer structure and call alive: a later test's model
    of the same structure takes its trace (``RegionTable._from_another_model``) instead of tracing the
    layer again, as two live models in one process do. A symbolic trace of a tiny layer costs ~6 s of
    this suite's CPU time; tests of tracing itself use structures of their own."""
    yield
    for table in list(region_tables._TABLES.values()):
        numbers = {n: fp for fp, n in table.fingerprints.items()}
        for key, regions in table.by_key.items():
            full = (numbers[key[0]], *key[1:])
            if full not in _traced_regions and any(r.lowered for r in regions):
                _traced_regions[full] = table


@pytest.fixture
def deterministic():
    """Deterministic algorithms for one test (GPU parity tests), cuBLAS workspace set as CUDA asks."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(False)
