"""Unsloth, the peer, as bench rows: its checkpoint written once, each row measured in a process of its own.

Unsloth loads a checkpoint folder (it patches transformers on import, so it cannot share our process or
our in-memory model). ``checkpoint`` writes the bench's random-init model of a size there once: the same
weights as our rows (``from_config`` with the bench's seed, no adapter), in bf16 safetensors up to 7B
(Unsloth quantizes them to NF4 on load, as bitsandbytes does for us), and from 32B on pre-quantized
bitsandbytes NF4 with its ``quantization_config`` (a bf16 32B does not fit the device's 64 GB disk),
with the small tokenizer of ``models/tiny_tokenizer.py`` beside it. ``measure`` runs the worker on it
(``poros-fx bench --worker unsloth``, ``unsloth_worker.py``, with ``UNSLOTH_ENV``) and fills the bench row
from the JSON the worker writes; an Unsloth that is not installed gives a "skipped" row without writing a checkpoint.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

from ..io.loader import from_config
from ..prepare import unprepare
from ..models.tiny_tokenizer import tiny_tokenizer
from .config import BenchConfig, RowSpec
from .unsloth_worker import UNSLOTH_FIRST

UNSLOTH_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "UNSLOTH_DISABLE_STATISTICS": "1",
               "HF_HUB_DISABLE_TELEMETRY": "1"}
MARKER = "poros-checkpoint.json"  # written last: a folder without it is half-written and is written again
SHARD_BYTES = 4 * 2**30
WORKER_TIMEOUT_S = 3600
NOT_IMPORTABLE = "skipped: unsloth not importable"
# bitsandbytes' NF4 as from_config makes it (blocksize 64, absmax quantized again): what transformers reads
NF4_QUANTIZATION_CONFIG = {"quant_method": "bitsandbytes", "load_in_4bit": True, "load_in_8bit": False,
                           "bnb_4bit_quant_type": "nf4", "bnb_4bit_use_double_quant": True,
                           "bnb_4bit_compute_dtype": "bfloat16", "bnb_4bit_quant_storage": "uint8",
                           "llm_int8_skip_modules": ["lm_head"]}


def checkpoint_format(model: str) -> str:
    """bf16 up to 7B, pre-quantized NF4 from 32B on (the device's disk holds 64 GB)."""
    return "nf4" if model in ("qwen2.5-32b", "qwen2.5-72b") else "bf16"


def checkpoint_dir(root: Path, model: str, seed: int) -> Path:
    return Path(root).resolve() / f"{model}-{checkpoint_format(model)}-seed{seed}"


def write_checkpoint(hf_config: transformers.PretrainedConfig, folder: Path, quantization: str, seed: int,
                     device: str | torch.device) -> dict[str, Any]:
    """Write ``from_config(hf_config, quantization, seed=seed)``'s base (no adapter) to ``folder`` as a
    checkpoint ``from_pretrained`` loads, with a tokenizer; reuse the folder when its marker says it holds
    the same. Returns the marker (what was written, and ``write_s``)."""
    recipe = {"model_type": hf_config.model_type, "layers": hf_config.num_hidden_layers,
              "hidden": hf_config.hidden_size, "quantization": quantization, "seed": seed}
    marker = folder / MARKER
    if marker.exists():
        written = json.loads(marker.read_text())
        if written.get("recipe") == recipe:
            return written
    started = time.perf_counter()
    folder.mkdir(parents=True, exist_ok=True)
    model = from_config(hf_config, quantization, device=device, seed=seed, lora=None, progress=False)
    unprepare(model)  # every base tensor back in host memory, bitsandbytes' Params4bit with its quant state
    state = model.state_dict()  # a Linear4bit adds its quant state's tensors (absmax, quant_map, ...)
    if hf_config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # one tensor in the file; from_pretrained ties it again
    shards = _write_shards(state, folder)
    del model, state
    config = hf_config.to_dict()
    config["torch_dtype"] = "bfloat16"
    if quantization == "nf4":
        config["quantization_config"] = dict(NF4_QUANTIZATION_CONFIG)
    (folder / "config.json").write_text(json.dumps(config, indent=1))
    tiny_tokenizer().save_pretrained(folder)
    written = {"recipe": recipe, "shards": shards, "bytes": sum(f.stat().st_size for f in folder.glob("*.safetensors")),
               "write_s": round(time.perf_counter() - started, 1)}
    marker.write_text(json.dumps(written, indent=1))
    return written


def _write_shards(state: dict[str, torch.Tensor], folder: Path) -> int:
    """``state`` as safetensors shards of at most ``SHARD_BYTES`` (in order) and the index naming them."""
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if groups[-1] and size + nbytes > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    weight_map = {}
    for i, names in enumerate(groups, 1):
        file = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        # a copy of each: the state's tensors are views of the store's one host arena, and safetensors refuses
        # tensors that share storage (the copies are one shard at a time)
        save_file({n: state[n].detach().clone() for n in names}, str(folder / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return len(groups)


def worker_command(spec: RowSpec, config: BenchConfig, out: Path) -> list[str]:
    """The worker's command line for one row: Unsloth imported first, then ``poros-fx bench --worker unsloth``
    (the checkpoint folder is ``checkpoint_dir(--checkpoints, the model, the seed)``)."""
    command = [sys.executable, "-c", UNSLOTH_FIRST, "bench", "--worker", "unsloth", "--models", spec.model,
               "--methods", spec.method, "--seqs", str(spec.seq), "--accums", str(spec.accum),
               "--steps", str(config.steps), "--warmup", str(config.warmup),
               "--device", config.device, "--checkpoints", str(config.checkpoints), "--json", str(out)]
    if config.unsloth_offload_layers is not None:
        command += ["--unsloth-offload-layers", str(config.unsloth_offload_layers)]
    if config.device_memory_cap is not None:
        command += ["--device-memory-cap", config.device_memory_cap]
    return command


def measure(row: dict[str, Any], spec: RowSpec, config: BenchConfig, hf_config: transformers.PretrainedConfig,
            log: Any = print) -> dict[str, Any]:
    """Fill the bench ``row`` of an Unsloth method: the checkpoint (written if needed), then the worker."""
    if importlib.util.find_spec("unsloth") is None:
        row["error"] = f"{NOT_IMPORTABLE} (not installed)"
        return row
    folder = checkpoint_dir(config.checkpoints, spec.model, config.seed)
    written = write_checkpoint(hf_config, folder, checkpoint_format(spec.model), config.seed, config.device)
    row["checkpoint"] = {"path": str(folder), "format": checkpoint_format(spec.model), "bytes": written["bytes"],
                         "write_s": written["write_s"]}
    with tempfile.TemporaryDirectory(prefix="poros-unsloth-") as tmp:
        out = Path(tmp) / "row.json"
        command = worker_command(spec, config, out)
        log(f"  {' '.join(command)}")
        try:
            done = subprocess.run(command, env={**os.environ, **UNSLOTH_ENV}, capture_output=True, text=True,
                                  timeout=WORKER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            row["error"] = f"unsloth worker timed out after {WORKER_TIMEOUT_S} s"
            return row
        if not out.exists():
            tail = [line for line in (done.stderr or done.stdout).splitlines() if line.strip()]
            row["error"] = f"unsloth worker exited {done.returncode}: {tail[-1] if tail else 'no output'}"
            return row
        row.update(json.loads(out.read_text()))
    return row
