"""A run's settings as a TOML file: ``poros-fx train --config run.toml`` reads one, every run writes one.

Keys are the train command's option names (``seq_len`` or ``seq-len``), at the top level or in a
``[train]`` table; the command line overrides the file. A run writes the settings it used to
``OUT/run.toml`` (next to the adapter), so ``poros-fx train --config OUT/run.toml --out NEW`` repeats it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
import types
import typing
from pathlib import PurePath
from typing import Any, Iterable, Mapping

from ..errors import PorosConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

RUN_CONFIG_FILE = "run.toml"


def read_run_config(path: Path, known: Iterable[str], types_of: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The settings in ``path`` keyed by option name (underscores), each one of ``known``; with ``types_of``
    (option name -> type hint) each value is checked to be of its option's type."""
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
    for key, value in settings.items():
        if types_of is not None and key in types_of and not _is_of(value, types_of[key]):
            raise PorosConfigError(f"--config {path}: {key} = {value!r} is not {_type_name(types_of[key])}; fix "
                                   f"that line")
    return settings


def _is_of(value: Any, hint: Any) -> bool:
    """Whether a TOML value fits a type hint (an int fits a float, never a bool an int; a string fits a path)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_is_of(value, arg) for arg in typing.get_args(hint))
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        # a string is one comma-separated list, as on the command line
        return isinstance(value, str) or (isinstance(value, list) and all(_is_of(v, item) for v in value))
    if hint is Any:
        return True
    if hint is type(None):
        return value is None
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return isinstance(value, str)
    return isinstance(value, hint) if isinstance(hint, type) else True


def _type_name(hint: Any) -> str:
    """A type hint in words: 'an integer', 'a string or nothing', ..."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(arg) for arg in typing.get_args(hint) if arg is not type(None))
    if origin is list:
        return "a list of strings (or one comma-separated string)"
    names = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}
    if isinstance(hint, type) and issubclass(hint, PurePath):
        return "a path (a string)"
    return names.get(hint, getattr(hint, "__name__", str(hint)))


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
