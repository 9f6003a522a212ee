"""A run's settings as a TOML file: ``poros-fx train --config run.toml`` reads one, every run writes one.

Keys are the train command's option names (``seq_len`` or ``seq-len``), at the top level or in a
``[train]`` table; the command line overrides the file. A run writes the settings it used to
``OUT/run.toml`` (next to the adapter), so ``poros-fx train --config OUT/run.toml --out NEW`` repeats it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Iterable

from ..errors import PorosConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

RUN_CONFIG_FILE = "run.toml"


def read_run_config(path: Path, known: Iterable[str]) -> dict[str, Any]:
    """The settings in ``path`` keyed by option name (underscores), each one of ``known``."""
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise PorosConfigError(f"--config {path}: no such file") from None
    except (OSError, UnicodeDecodeError) as e:
        raise PorosConfigError(f"--config {path}: cannot read it ({e})") from None
    except tomllib.TOMLDecodeError as e:
        raise PorosConfigError(f"--config {path}: not valid TOML ({e})") from None
    if isinstance(data.get("train"), dict):
        data = {**{k: v for k, v in data.items() if k != "train"}, **data["train"]}
    known = set(known)
    settings = {key.replace("-", "_"): value for key, value in data.items()}
    unknown = sorted(k for k in settings if k not in known)
    if unknown:
        raise PorosConfigError(f"--config {path}: unknown setting(s) {', '.join(unknown)}; known: "
                               f"{', '.join(sorted(known))}")
    return settings


def write_run_config(path: Path, settings: dict[str, Any]) -> None:
    """``settings`` (strings, numbers, booleans, lists of them; ``None`` left out) as TOML at ``path``."""
    lines = ["# poros-fx train settings: poros-fx train --config THIS_FILE (the command line overrides it)"]
    for key, value in settings.items():
        if value is None:
            continue
        lines.append(f"{key} = {_toml(key, value)}")
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")


def _toml(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a JSON string is a TOML basic string
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(key, v) for v in value) + "]"
    raise TypeError(f"setting {key!r}: {type(value).__name__} has no TOML form here")
