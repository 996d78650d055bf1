"""One schema per kind of JSON file: a dataclass, and one loader that checks data against its type hints.

A wrong JSON type anywhere (``state_scalars`` a list, ``param_names`` a number) is a ``BadInput`` naming the file
and the field, never an ``AttributeError`` deep in a reader. Fields a newer writer added are ignored (the formats
promise only additions); a missing field or a value of the wrong type says where it is.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from .errors import BadInput, shown
from .finite import decode_float

T = TypeVar("T")
_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}
_JSON = {dict: "an object", list: "a list", str: "a string", bool: "a boolean", int: "an integer", float: "a number",
         type(None): "null"}


def load(kind: type[T], data: Any, path: Path | str, where: str = "") -> T:
    """``data`` (parsed from ``path``) as a ``kind``; else a ``BadInput`` naming the file and the field."""
    try:
        return from_jsonable(kind, data, where)
    except ValueError as e:
        raise BadInput(path, str(e)) from None


def _at(where: str, name: str) -> str:
    return f"{where}.{name}" if where else name


def _in(where: str) -> str:
    return f"{where}: " if where else ""


def _found(data: Any) -> str:
    """What a JSON value is, with a short escaped excerpt of a scalar (the file is one being examined)."""
    kind = _JSON.get(type(data), type(data).__name__)
    return kind if isinstance(data, (dict, list)) or data is None else f"{kind} {shown(data, 24)}"


def from_jsonable(kind: Any, data: Any, where: str = "report") -> Any:
    """``data`` as the type ``kind`` (the inverse of ``report.to_jsonable``: saved reports are re-rendered without
    replaying); a missing field or a value of the wrong type is a ``ValueError`` that says where it is."""
    if kind is Any:
        return data
    origin, args = typing.get_origin(kind), typing.get_args(kind)
    if origin in (typing.Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return from_jsonable(option, data, where)
            except ValueError as e:
                errors.append(e)
        raise errors[0] if errors else ValueError(f"{_in(where)}null where a value is required")
    if origin is typing.Literal:  # a closed set of words: the views look each up in a table
        if isinstance(data, str) and data in args:
            return data
        raise ValueError(f"{_in(where)}{_found(data)} is not one of {', '.join(map(repr, args))}")
    if dataclasses.is_dataclass(kind):
        if not isinstance(data, dict):
            raise ValueError(f"{_in(where)}expected an object, found {_found(data)}")
        hints = typing.get_type_hints(kind)
        values = {}
        for f in dataclasses.fields(kind):
            if f.name in data:
                values[f.name] = from_jsonable(hints[f.name], data[f.name], _at(where, f.name))
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ValueError(f"{_in(where)}field {f.name!r} is missing")
        return kind(**values)
    if origin is list:
        if not isinstance(data, list):
            raise ValueError(f"{_in(where)}expected a list, found {_found(data)}")
        return [from_jsonable(args[0], v, f"{where}[{i}]") for i, v in enumerate(data)]
    if origin is dict:
        if not isinstance(data, dict):
            raise ValueError(f"{_in(where)}expected an object, found {_found(data)}")
        return {k: from_jsonable(args[1], v, f"{where}[{shown(k, 24)}]") for k, v in data.items()}
    if kind is float:
        if isinstance(data, str):
            try:
                return decode_float(data)
            except ValueError:
                pass
        if isinstance(data, (int, float)) and not isinstance(data, bool):
            return data  # an int stays an int: that is how to_json wrote it
    elif kind is int:
        if isinstance(data, int) and not isinstance(data, bool):
            return data
    elif kind in (str, bool):
        if isinstance(data, kind):
            return data
    else:
        raise TypeError(f"{_in(where)}cannot load a {kind!r}")
    raise ValueError(f"{_in(where)}expected {_NAMES.get(kind, kind.__name__)}, found {_found(data)}")
