"""The CPU host-cost suite's setup (``make bench-cpu``; never part of ``make test``: pyproject's ``testpaths``).

One thread (the machine's cores are shared; OpenMP's spinning threads would time the neighbours), no hub.
"""

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def pytest_benchmark_update_json(config, benchmarks, output_json):
    output_json["torch"] = torch.__version__  # the report names it
    for bench in output_json["benchmarks"]:
        bench["stats"].pop("data", None)  # every round's time: megabytes for the microbenchmarks, kept out of git
