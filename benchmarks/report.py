"""``docs/bench/cpu/host_cost.md`` from the suite's pytest-benchmark JSON (``make bench-cpu``).

    python benchmarks/report.py docs/bench/cpu/host_cost.json docs/bench/cpu/host_cost.md
"""

import json
import sys
from pathlib import Path


def _us(seconds: float) -> str:
    return f"{seconds * 1e6:,.1f}"


def markdown(doc: dict, command: str) -> str:
    info = doc["machine_info"]
    benches = {b["name"]: b for b in doc["benchmarks"]}
    lines = ["# Host cost per step on the CPU (pytest-benchmark)", "",
             f"Made by `{command}` on {doc['datetime'][:10]}: {info.get('cpu', {}).get('brand_raw', '?')}, "
             f"{info.get('cpu', {}).get('count', '?')} cores shared with other work (noisy: compare runs made back to "
             f"back), one torch thread, Python {info.get('python_version')}, torch {doc.get('torch', '?')}. "
             "A tiny Qwen2 (hidden 64) with LoRA r8 on the seven projections, seq 32, NF4 base (bf16 for "
             "`test_step`): its kernels take little, so the timings are mostly the host's. Suite: `benchmarks/test_host_cpu.py`.", "",
             "| benchmark | min µs | median µs | IQR µs | rounds | extra |", "|---|---|---|---|---|---|"]
    for name, b in benches.items():
        s = b["stats"]
        extra = ", ".join(f"{k}={v}" for k, v in b["extra_info"].items() if k not in ("phases_s",))
        lines.append(f"| {name} | {_us(s['min'])} | {_us(s['median'])} | {_us(s['iqr'])} | {s['rounds']} | {extra} |")
    lines += ["", "## Per region call (the step's growth per layer, bf16 base)", "",
              "Minimum step at 6 layers minus at 2 (the minimum: a neighbour's work only adds time), over the 4 "
              "layers added; poros' growth over eager PEFT's, over the region calls a layer adds (streamed: "
              "forward, recompute, backward; `stream=False`: forward, backward) is what poros costs the host per "
              "region call (its loads and bookkeeping, and the recompute's kernels).", "",
              "| mode | growth per layer µs | over eager per layer µs | region calls per layer | per region call µs |",
              "|---|---|---|---|---|"]
    growth = {}
    for mode in ("eager", "resident", "streamed"):
        small, large = benches.get(f"test_step[{mode}-2]"), benches.get(f"test_step[{mode}-6]")
        if small and large:
            growth[mode] = (large["stats"]["min"] - small["stats"]["min"]) / 4
            calls = large["extra_info"]["region_calls_per_layer"]
            over = growth[mode] - growth["eager"] if "eager" in growth else None
            lines.append(f"| {mode} | {_us(growth[mode])} | {_us(over) if calls and over is not None else '-'} | "
                         f"{calls} | {_us(over / calls) if calls and over is not None else '-'} |")
    phases = [b for b in benches.values() if "phases_s" in b["extra_info"]]
    if phases:
        names = sorted({k for b in phases for k in b["extra_info"]["phases_s"]})
        lines += ["", "## The first step's compile, by phase (seconds; one cold round, fresh Inductor cache)", "",
                  "Dynamo's `compile_times` (nested and overlapping: `_compile.compile_inner` holds the others, and the "
                  "region's trace runs inside them when a fake call first asks for it, so they do not add up) "
                  "and the region's own trace and compile (`poros_fx.stats(model)['regions']`, one region "
                  "per layer structure: here one for all the layers).", "",
                  "| codegen | layers | first step s | region trace s | region compile s | " + " | ".join(names) + " |",
                  "|---" * (5 + len(names)) + "|"]
        for b in phases:
            e = b["extra_info"]
            lines.append(f"| {e['codegen']} | {e['layers']} | {b['stats']['median']:.2f} | {e['region_trace_s']} | "
                         f"{e['region_compile_s']} | " + " | ".join(str(e["phases_s"].get(n, "-")) for n in names)
                         + " |")
        eager = sorted(((b["extra_info"]["layers"], b) for b in phases if b["extra_info"]["codegen"] == "eager"),
                       key=lambda pair: pair[0])
        if len(eager) >= 2:
            (small, a), (large, b) = eager[0], eager[-1]
            per_layer = {n: (b["extra_info"]["phases_s"].get(n, 0) - a["extra_info"]["phases_s"].get(n, 0)) / (large - small)
                         for n in names}
            lines += ["", f"Growth per layer, eager codegen, {small} -> {large} layers (one region for all: this is the "
                      f"compile's cost per layer outside the region): first step "
                      f"{(b['stats']['median'] - a['stats']['median']) / (large - small) * 1e3:.0f} ms; "
                      + ", ".join(f"{n} {v * 1e3:.0f} ms" for n, v in per_layer.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    source, target = Path(argv[0]), Path(argv[1])
    command = argv[2] if len(argv) > 2 else "make bench-cpu"
    target.write_text(markdown(json.loads(source.read_text()), command), encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
