"""Command-line flags made from an options dataclass's declarations (``training/options.py``'s
``TrainOptions``): one typer option per field, with the field's help, its default, and its check run on
the value the command line gives (a bad value is a usage error naming the flag, before anything loads).

    bool field                 --pack/--no-pack
    bool | None                --cuda-graphs/--no-cuda-graphs (left out: None)
    list[str] | None           --target-modules, repeated or comma-separated
    int | str | None           a string on the command line, an integer where it reads as one (--prefetch 2)
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from ..errors import PorosConfigError


def _members(annotation: Any) -> tuple[Any, ...]:
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return typing.get_args(annotation)
    return (annotation,)


def _command_line_type(annotation: Any) -> tuple[Any, Callable[[Any], Any]]:
    """The type typer parses for a field of ``annotation``, and how its value becomes the field's."""
    members = [m for m in _members(annotation) if m is not type(None)]
    optional = len(members) < len(_members(annotation))
    if members == [bool]:
        return (Optional[bool] if optional else bool), lambda v: v
    if len(members) == 1 and typing.get_origin(members[0]) is list:
        return Optional[list[str]], lambda v: v
    if len(members) == 1 and members[0] in (int, float, str, Path):
        return (Optional[members[0]] if optional else members[0]), lambda v: v
    # a union with str: the command line gives text, an integer where the field takes one and it reads as one
    def convert(text: Any) -> Any:
        if int in members and isinstance(text, str):
            try:
                return int(text)
            except ValueError:
                return text
        return text
    return Optional[str], convert


def _callback(field: dataclasses.Field, convert: Callable[[Any], Any]) -> Callable[[Any], Any]:
    def checked(value: Any) -> Any:
        if value is None:
            return None
        value = convert(value)
        try:
            field.metadata["check"](field.name, value)
        except PorosConfigError as e:
            raise typer.BadParameter(str(e)) from None
        return value
    return checked


def option_parameters(options: type, skip: tuple[str, ...] = ()) -> list[inspect.Parameter]:
    """One keyword parameter per field of the dataclass ``options`` (but ``skip``), each a typer option."""
    hints = typing.get_type_hints(options)
    parameters = []
    for field in dataclasses.fields(options):
        if field.name in skip:
            continue
        cli_type, convert = _command_line_type(hints[field.name])
        flag = "--" + field.name.replace("_", "-")
        decls = (f"{flag}/--no-{flag[2:]}",) if cli_type in (bool, Optional[bool]) else (flag,)
        default = field.default
        if cli_type is Optional[str] and default is not None:
            default = str(default)
        info = typer.Option(default, *decls, help=field.metadata["help"], callback=_callback(field, convert),
                            show_default=default is not None,
                            metavar="NAME" if cli_type == Optional[list[str]] else None)
        parameters.append(inspect.Parameter(field.name, inspect.Parameter.KEYWORD_ONLY, default=info,
                                            annotation=cli_type))
    return parameters


def with_parameters(function: Callable[..., Any], parameters: list[inspect.Parameter]) -> Callable[..., Any]:
    """``function`` (taking ``**values``) as typer sees a function with ``parameters``."""
    function.__signature__ = inspect.Signature(parameters, return_annotation=None)  # type: ignore[attr-defined]
    function.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": None}
    return function
