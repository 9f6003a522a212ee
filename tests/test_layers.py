"""The package's layers: each module of ``poros_fx`` (and ``poros_fx.passes``) imports only from its own
layer or the layers below it, no two of our modules import each other in a circle, and no function
imports one of our modules, except a documented lazy import of a heavy optional dependency.

Static: the modules are parsed with ``ast``, none is imported, so this runs in about a second. The
layers, lowest first (``docs/how-it-works.md`` draws the same picture)::

    base      errors, noise, units, handles, options, families   what every layer reads
    runtime   runtime/                                            what runs while a step runs
    compiler  compiler/, passes/, attention                       the backend, its passes, regions
    prepare   prepare, host_modules, adapter_hooks, report        a model made streamable
    io        io/                                                 checkpoints, quantization, data
    surfaces  step, hf, sft, distributed, stats                   what users call around their loop
    models    models/                                             built-in shapes and tiny real models
    training  training/                                           the training loop, its data and run state, FineTuner
    exactness exactness/                                          the parity harness and the configuration generator
    bench     bench/                                              the benchmark harness and profiling
    cli       cli/, __main__                                      the ``poros-fx`` command line
    api       poros_fx/__init__.py                                the public names

A lazy import is allowed only for a module in ``LAZY`` (it pulls in the dependency named there) and
only with that dependency named in a ``# lazy: <dependency>`` comment on the import line.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# (layer, module prefixes relative to poros_fx), lowest first; a module belongs to its longest matching prefix
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("base", ("errors", "noise", "units", "handles", "options", "families")),
    ("runtime", ("runtime",)),
    ("compiler", ("compiler", "passes", "attention", "loss")),
    ("prepare", ("prepare", "host_modules", "adapter_hooks", "report")),
    ("io", ("io",)),
    ("surfaces", ("step", "hf", "sft", "distributed", "stats")),
    ("models", ("models",)),
    ("training", ("training",)),
    ("exactness", ("exactness",)),
    ("bench", ("bench",)),
    ("cli", ("cli", "__main__")),
    ("api", ("",)),
)

# modules a function may import lazily: importing them pulls in a heavy or optional dependency
LAZY = {
    "poros_fx.hf": "transformers.Trainer",  # transformers' Trainer imports accelerate & co.: seconds
    "poros_fx.sft": "trl",  # the optional extra poros-fx[trl]
}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted((ROOT / "poros_fx").rglob("*.py")) + sorted((ROOT / "passes").glob("*.py")):
        rel = path.relative_to(ROOT).with_suffix("").parts
        parts = ["poros_fx", "passes", *rel[1:]] if rel[0] == "passes" else list(rel)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def layer_of(module: str) -> int:
    rel = module[len("poros_fx."):] if module != "poros_fx" else ""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if rel == prefix or (prefix and rel.startswith(prefix + ".")) or (not prefix and not rel):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in tests/test_layers.py"
    return best[1]


def _targets(module: str, node: ast.ImportFrom | ast.Import) -> list[str]:
    """Our modules an import statement imports (``from . import x`` names module ``x`` when there is one)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.split(".")[0] == "poros_fx"]
    if node.level:
        package = module.split(".") if MODULES[module].name == "__init__.py" else module.split(".")[:-1]
        base = ".".join(package[:len(package) - node.level + 1] + ([node.module] if node.module else []))
    else:
        base = node.module or ""
    if base.split(".")[0] != "poros_fx":
        return []
    return [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]


def _imports(module: str) -> tuple[list[tuple[str, int]], list[tuple[str, int, str]]]:
    """(module-level imports, function-level imports with their source line) of our modules."""
    source = MODULES[module].read_text(encoding="utf-8")
    lines = source.splitlines()
    top: list[tuple[str, int]] = []
    nested: list[tuple[str, int, str]] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue  # annotations only: never executed
            if isinstance(child, (ast.Import, ast.ImportFrom)):
                for target in _targets(module, child):
                    if in_function:
                        nested.append((target, child.lineno, lines[child.lineno - 1]))
                    else:
                        top.append((target, child.lineno))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(source), False)
    return top, nested


def test_layers_no_circles_no_function_imports():
    assert "poros_fx.prepare" in MODULES and "poros_fx.passes.recompute" in MODULES
    upward, lazy_problems, edges = [], [], {}
    for module in MODULES:
        here = layer_of(module)
        top, nested = _imports(module)
        edges[module] = {t for t, _ in top if t in MODULES and t != module}
        for target, line in top:
            if target in MODULES and layer_of(target) > here:
                upward.append(f"{module}:{line} ({LAYERS[here][0]}) imports {target} ({LAYERS[layer_of(target)][0]})")
        for target, line, text in nested:
            if target not in LAZY or f"# lazy: {LAZY[target]}" not in text:
                lazy_problems.append(f"{module}:{line}: {text.strip()}")
    assert not upward, "imports from a higher layer:\n" + "\n".join(upward)
    assert not lazy_problems, ("function-level imports of our modules (import at the top of the module; only "
                               "LAZY modules with '# lazy: <dependency>' may wait):\n" + "\n".join(lazy_problems))
    circles = _circles(edges)
    assert not circles, "import circles:\n" + "\n".join(" -> ".join(c) for c in circles)


def _circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """One circle through each strongly connected group of modules (Tarjan), as a readable path."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return groups


def test_the_checker_sees_circles_upward_and_function_imports(tmp_path):
    """The rules above can fail: a circle, an upward edge and an undocumented lazy import are each found."""
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert layer_of("poros_fx.runtime.executor") < layer_of("poros_fx.compiler.backend") < layer_of("poros_fx.prepare")
    assert layer_of("poros_fx.prepare") < layer_of("poros_fx.io.loader") < layer_of("poros_fx.step")
    assert layer_of("poros_fx.step") < layer_of("poros_fx.cli.app") < layer_of("poros_fx")
    assert layer_of("poros_fx.passes.lower_regions") == layer_of("poros_fx.compiler.ops")
    module = "poros_fx.runtime.executor"
    source = "def f():\n    from ..prepare import prepare\n    from ..sft import x  # lazy: trl\n"
    original = MODULES[module]
    fake = tmp_path / "executor.py"
    fake.write_text(source)
    MODULES[module] = fake
    try:
        _, nested = _imports(module)
    finally:
        MODULES[module] = original
    assert [t for t, _, _ in nested] == ["poros_fx.prepare", "poros_fx.sft"]
    assert "# lazy: trl" in nested[1][2] and "# lazy:" not in nested[0][2]
