"""Compile once, then cached: a second process loads a region's Inductor code from the FX graph cache.

Two processes share one ``TORCHINDUCTOR_CACHE_DIR``. The first compiles the layer's region (cache
misses), the second finds its three graphs (the forward in two parts, the backward) in the cache (``fxgraph_cache_hit``) and trains the
same bits. Each process also checks the chunked loss under the Inductor codegen: streamed ==
``stream=False`` (tests/test_long_sequences.py has the eager codegen and the eager loop).
"""

import json
import os
import textwrap
from pathlib import Path

import pytest

from forked_helper import run_forked

SCRIPT = textwrap.dedent("""
    import hashlib, json, os, torch
    import poros_fx
    from torch._dynamo.utils import counters
    from poros_fx.exactness.parity import compare, train
    from poros_fx.models.tiny import demo_batches, tiny_lora_model

    torch.set_num_threads(1)

    def run(stream):
        model = tiny_lora_model("qwen2", dropout=0.1, layers=2, vocab=256)
        poros_fx.prepare(model, device="cpu", codegen="inductor", head_chunks=3, chunked_loss=True)
        compiled = torch.compile(model, backend="poros", options={"stream": stream})
        return train(model, compiled, demo_batches(2, vocab=256, seq=24, batch=2, seed=7)), model

    streamed, model = run(True)
    # the warm process trains the streamed model only: its forward and backward graphs are the region's two
    resident = run(False)[0] if os.environ["POROS_TEST_COLD"] == "1" else streamed
    digest = hashlib.sha256()
    for t in [*streamed.losses, *streamed.grad_norms, *streamed.weights[-1]]:
        digest.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    region = poros_fx.stats(model)["regions"][0]
    print(json.dumps({"cache": {k: v for k, v in counters["inductor"].items() if k.startswith("fxgraph_cache")},
                      "exact": all(v == 0.0 for v in compare(streamed, resident).values()),
                      "digest": digest.hexdigest(), "trace_s": region["trace_s"],
                      "compile_s": region["compile_s"]["inductor"]}))
""")


def _run_script() -> None:
    exec(compile(SCRIPT, "<test_compile_cache>", "exec"), {"__name__": "__main__"})


def _process(cache: Path, cold: bool) -> dict:
    """SCRIPT in a fresh process, forked from test_distributed.py's server (torch, transformers, peft and
    poros_fx imported once, nothing compiled: no Dynamo or Inductor state, in memory or on disk)."""
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache), "OMP_NUM_THREADS": "1",
           "POROS_TEST_COLD": "1" if cold else "0"}
    out, err = (cache.parent / f"{'cold' if cold else 'warm'}.{kind}" for kind in ("out", "err"))
    code = run_forked(_run_script, env, str(out), str(err), timeout=900)
    assert code == 0, err.read_text()[-3000:]
    return json.loads(out.read_text().strip().splitlines()[-1])


@pytest.mark.slow
def test_second_process_hits_the_region_cache_and_trains_the_same_bits(tmp_path):
    cold = _process(tmp_path / "inductor-cache", cold=True)
    warm = _process(tmp_path / "inductor-cache", cold=False)
    assert cold["exact"]  # chunked loss, Inductor codegen: streamed == stream=False
    # each process prepares two models of one structure, which share one region (a forward and a backward
    # graph; regions/table.py): the cold process compiles both graphs, the warm one finds both in the cache
    # the region's graphs: its forward in two parts (compiler/regions/split.py) and its backward
    assert cold["cache"].get("fxgraph_cache_miss") == 3 and not cold["cache"].get("fxgraph_cache_hit"), cold
    assert warm["cache"].get("fxgraph_cache_hit") == 3 and not warm["cache"].get("fxgraph_cache_miss"), warm
    assert not warm["cache"].get("fxgraph_cache_bypass")
    assert warm["digest"] == cold["digest"]
