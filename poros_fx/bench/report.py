"""The bench's outputs: the merged JSON matrix, its markdown table and its plot."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from .config import ROW_KEY, BenchConfig, MODEL_ORDER, RowSpec
from .methods import METHODS


def _num(x: Any) -> float | None:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


def _label(spec: RowSpec) -> str:
    bs = f" bs{spec.block_size}" if spec.block_size is not None else ""
    return f"{spec.model} {spec.method}{bs} seq{spec.seq} x{spec.accum}"



def _sort_key(row: dict[str, Any]) -> tuple:
    model = MODEL_ORDER.index(row["model"]) if row["model"] in MODEL_ORDER else len(MODEL_ORDER)
    order = list(METHODS)
    method = order.index(row["method"]) if row["method"] in order else len(order)
    return (model, row["model"], row["seq"], row["accum"], method, row["method"], row["block_size"] or 0)


def ratios(rows: list[dict[str, Any]]) -> None:
    """Set ``ratio_vs_peft_resident`` on every row (in place): its s/step over the ``peft_resident`` row
    of the same model, seq and accum (the matrix holds one), and ``ratio_cross_run: True`` when that
    row came from another run — step times move ±15–40 % between the hosts lent on different days,
    so only a same-run ratio compares like with like."""
    reference = {(r["model"], r["seq"], r["accum"]): (r.get("run"), r["s_per_step"]) for r in rows
                 if r["method"] == "peft_resident" and _num(r["s_per_step"])}
    for r in rows:
        run, ref = reference.get((r["model"], r["seq"], r["accum"]), (None, None))
        r["ratio_vs_peft_resident"] = round(r["s_per_step"] / ref, 4) if ref and _num(r["s_per_step"]) else None
        r.pop("ratio_cross_run", None)
        if r["ratio_vs_peft_resident"] is not None and run != r.get("run"):
            r["ratio_cross_run"] = True


def load(path: Path) -> dict[str, Any]:
    """The document at ``path``, or an empty one."""
    if path.exists():
        return json.loads(path.read_text(encoding="utf-8"))
    return {"env": {}, "rows": []}


def start_run(doc: dict[str, Any], env: dict[str, Any]) -> dict[str, Any]:
    """``doc`` with this run's environment on top, its command added to ``commands`` and itself to ``runs``."""
    old = doc.get("env", {})
    commands = [c for c in old.get("commands", []) if c]
    if env.get("command") and env["command"] not in commands:
        commands.append(env["command"])
    runs = [*old.get("runs", []), dict(env)]
    return {"env": {**env, "commands": commands, "runs": runs}, "rows": list(doc.get("rows", []))}


def upsert(doc: dict[str, Any], row: dict[str, Any]) -> None:
    """Put ``row`` in ``doc`` in place of the row with the same model/method/block_size/seq/accum, marked
    with the run that measured it (``run``: its 1-based index in ``env.runs``, the newest)."""
    row["run"] = len(doc["env"].get("runs", [])) or None
    key = tuple(row[k] for k in ROW_KEY)
    doc["rows"] = [r for r in doc["rows"] if tuple(r[k] for k in ROW_KEY) != key] + [row]


def save(doc: dict[str, Any], config: BenchConfig) -> None:
    """Sort the rows, recompute the ratios, write the JSON (atomically), the markdown and the plot."""
    doc["rows"].sort(key=_sort_key)
    ratios(doc["rows"])
    path = config.json_path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    tmp.replace(path)  # a run killed mid-write never leaves a half-written matrix
    write_outputs(doc, config)


def merge(path: Path, env: dict[str, Any], new_rows: list[dict[str, Any]], config: BenchConfig | None = None
          ) -> dict[str, Any]:
    """Merge ``new_rows`` (one run's) into the JSON at ``path`` and write it with its markdown and plot."""
    doc = start_run(load(path), env)
    for row in new_rows:
        upsert(doc, row)
    save(doc, config if config is not None else BenchConfig(json_path=path))
    return doc


def md_path(config: BenchConfig) -> Path:
    return config.md_path or config.json_path.with_suffix(".md")


def plot_path(config: BenchConfig) -> Path:
    return config.plot_path or config.json_path.with_suffix(".png")


def _fmt(x: Any, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _sigfmt(x: Any) -> str:
    return "-" if x is None else f"{x:.3g}"


UNSLOTH_NOTE = ("unsloth_* rows: Unsloth in a process of its own on a checkpoint of the same random-init weights "
                "(bf16 up to 7B, quantized to NF4 on load; pre-quantized NF4 from 32B on), LoRA r16 alpha 32 dropout 0 "
                "(Unsloth's fast path; our rows use 0.05) on the seven projections, the same batches, AdamW and timing; "
                "resident: use_gradient_checkpointing=False; checkpointing: \"unsloth\" (activations to host); "
                "offload: from_pretrained(offload_layers=every decoder layer) with \"unsloth\" checkpointing. "
                "Peak: from get_peft_model to the last step.")
WARM_NOTE = ("first step s / compile s: with --compile-warm, cold (the bench's process, a fresh Inductor cache); "
             "warm: the same row in a second process with that cache (first step / compile s).")


def _warm(row: dict[str, Any]) -> str:
    if row.get("first_step_warm_s") is not None:
        return f"{row['first_step_warm_s']:.1f} / {_fmt(row.get('compile_warm_s'), 1)}"
    error = (row.get("warm_process") or {}).get("error")
    return f"failed: {error}".replace("|", "/") if error else "-"


def _shapes(rows: list[dict[str, Any]]) -> str:
    """The rows' models, by name (qwen2.5-*: Qwen2.5 shapes; the others: models/configs/ or tiny)."""
    return f"Random-init models ({', '.join(sorted({r['model'] for r in rows}))})"


def markdown(doc: dict[str, Any]) -> str:
    """The matrix as a markdown table, with the environment and the command lines that built it."""
    env = doc["env"]
    lines = ["# poros-fx bench", "",
             (f"Device: {env.get('gpu') or env.get('device')}; torch {env.get('torch')}, transformers "
             f"{env.get('transformers')}, peft {env.get('peft')}, bitsandbytes {env.get('bitsandbytes')}; pinned H2D "
             f"{_fmt(env.get('pinned_h2d_gbps'), 1)} GB/s (device to host {_fmt(env.get('pinned_d2h_gbps'), 1)}). {_shapes(doc['rows'])}, NF4 base, LoRA r16 alpha 32 "
             "on every linear of a decoder layer, AdamW, batch 1. s/step: median after warm-up; peak: "
             "max_memory_allocated (CUDA graph rows: the timed steps' plus the graphs' pool, which replays write "
             "unseen by it); "
             "floor: 2 x bytes loaded per pass (every block once) x accum / pinned bandwidth; ratio: s/step over "
             "the same run's peft_resident (marked * where that run had none and another run's is used: step "
             "times move between the hosts lent on different days); run: the numbered run below that measured "
             "the row ('-': a run from before rows were numbered)."), "",
             "Runs (one process each):", ""]
    runs = env.get("runs", [])
    lines += [f"    [{i}] {run_env.get('command') or '?'}" for i, run_env in enumerate(runs, 1)] + [""]
    lines += [f"Run {i} stopped early: {run_env['stopped']}" for i, run_env in enumerate(runs, 1)
              if run_env.get("stopped")]
    lines += [f"Run {i}: every row's process capped at {run_env['device_memory_cap_gb']:g} GB of device memory "
              "(torch.cuda.set_per_process_memory_fraction)" for i, run_env in enumerate(runs, 1)
              if run_env.get("device_memory_cap_gb")]
    if any(r["method"].startswith("unsloth_") for r in doc["rows"]):
        lines += ["", UNSLOTH_NOTE]
    if any(r.get("first_step_warm_s") is not None or r.get("warm_process") for r in doc["rows"]):
        lines += ["", WARM_NOTE]
    header = ("| model | method | block | seq | accum | s/step | peak GB | H2D GB/s | floor s | first step s | compile s "
              "| warm: first / compile s | ratio | run | error |")
    lines += ["", header, "|---" * (header.count("|") - 1) + "|"]
    for r in doc["rows"]:
        error = (r.get("error") or "").replace("|", "/")
        ratio = _fmt(r["ratio_vs_peft_resident"], 2) + ("*" if r.get("ratio_cross_run") else "")
        method = (r["method"] + (f" (chunks {r['sequence_chunks']})" if r.get("sequence_chunks") else "")
                  + (" (+ experts LoRA)" if r.get("expert_lora") else ""))
        lines.append(f"| {r['model']} | {method} | {r['block_size'] or '-'} | {r['seq']} | {r['accum']} | "
                     f"{_fmt(r['s_per_step'], 3)} | {_fmt(r['peak_gb'], 2)} | {_sigfmt(r['h2d_gbps'])} | "
                     f"{_fmt(r['floor_s'], 3)} | {_fmt(r.get('first_step_s'), 1)} | {_fmt(r['compile_s'], 1)} | "
                     f"{_warm(r)} | {ratio} | {r.get('run') or '-'} | {error} |")
    return "\n".join(lines) + "\n"


def plot(doc: dict[str, Any], path: Path) -> None:
    """Step time and peak memory per model (x) and method (bars), one group per (seq, accum)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    rows = [r for r in doc["rows"] if not r.get("error")]
    groups = sorted({(r["model"], r["seq"], r["accum"]) for r in rows},
                    key=lambda g: _sort_key({"model": g[0], "seq": g[1], "accum": g[2], "method": "", "block_size": 0}))
    variants = sorted({(r["method"], r["block_size"]) for r in rows},
                      key=lambda v: _sort_key({"model": "", "seq": 0, "accum": 0, "method": v[0], "block_size": v[1]}))
    fig = Figure(figsize=(max(9.0, 2.5 + 0.35 * len(groups) * max(1, len(variants))), 8))
    FigureCanvasAgg(fig)  # Agg without pyplot: no global backend switch
    axes = fig.subplots(2, 1)
    width = 0.8 / max(1, len(variants))
    for ax, key, label in ((axes[0], "s_per_step", "s / step (median)"), (axes[1], "peak_gb", "peak GB (max allocated)")):
        for j, (method, bs) in enumerate(variants):
            xs, ys = [], []
            for i, g in enumerate(groups):
                for r in rows:
                    if (r["model"], r["seq"], r["accum"]) == g and (r["method"], r["block_size"]) == (method, bs) \
                            and _num(r[key]) is not None:
                        xs.append(i - 0.4 + width * (j + 0.5))
                        ys.append(r[key])
            if xs:
                bars = ax.bar(xs, ys, width=width, label=method + (f" bs{bs}" if bs else ""))
                ax.bar_label(bars, fmt="%.3g", fontsize=6)  # log-scale bar heights are hard to read
        ax.set_ylabel(label)
        ax.set_xticks(range(len(groups)), [f"{m}\nseq {s} x{a}" for m, s, a in groups], fontsize=8)
        if any(_num(r[key]) is not None for r in rows):
            ax.set_yscale("log")
            ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
        else:
            ax.text(0.5, 0.5, f"{key}: not measured (no CUDA)", transform=ax.transAxes, ha="center")
    fig.suptitle(f"poros-fx bench on {doc['env'].get('gpu') or doc['env'].get('device')}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_outputs(doc: dict[str, Any], config: BenchConfig) -> None:
    md_path(config).write_text(markdown(doc), encoding="utf-8")
    plot(doc, plot_path(config))

