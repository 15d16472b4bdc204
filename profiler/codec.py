"""Frozen dataclasses <-> plain JSON data, exactly and strictly.

The report's dataclasses are the schema: a field's type hint says what JSON value it
takes, so encoding and decoding are one generic walk instead of a hand-written
``to_dict``/``from_dict`` per class (which drift apart). Decoding is strict: a missing
field, an unknown field or a value of the wrong type is an error that names its path in
the file (``network.series[2].points[0].nbytes``), because a silently ignored typo in a
measurement file would change a plan without anyone noticing. Floats survive exactly:
``json`` writes ``repr(float)``, which reads back to the same bits.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import math
import types
import typing
from collections.abc import Mapping
from typing import Any, Literal, Union

from profiler.errors import ProfileFormatError


def encode(value: Any) -> Any:
    """``value`` as JSON data: dataclasses become objects, tuples lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (tuple, list)):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(k): encode(v) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise ProfileFormatError(
            f"cannot write the non-finite number {value!r} into a report; a measurement "
            f"produced it, which is a bug worth reporting."
        )
    return value


def decode(cls: type, data: Any, path: str) -> Any:
    """Build a ``cls`` from JSON data, raising ProfileFormatError naming ``path``."""
    return _decode(cls, data, path)


def _decode(hint: Any, data: Any, path: str) -> Any:
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        options = typing.get_args(hint)
        if data is None and type(None) in options:
            return None
        rest = [o for o in options if o is not type(None)]
        if len(rest) == 1:
            return _decode(rest[0], data, path)
        raise ProfileFormatError(f"{path}: unsupported union type {hint!r} in the report schema.")
    if origin is Literal:
        allowed = typing.get_args(hint)
        if data not in allowed:
            raise ProfileFormatError(f"{path}: {data!r} is not one of {', '.join(map(repr, allowed))}.")
        return data
    if origin is tuple:
        args = typing.get_args(hint)
        if not isinstance(data, list):
            raise ProfileFormatError(f"{path}: expected a list, got {type(data).__name__}.")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise ProfileFormatError(f"{path}: expected {len(args)} items, got {len(data)}.")
        return tuple(_decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin in (dict, collections.abc.Mapping) or hint is dict:
        key_t, val_t = typing.get_args(hint) or (str, Any)
        if not isinstance(data, dict):
            raise ProfileFormatError(f"{path}: expected an object, got {type(data).__name__}.")
        return {_decode(key_t, k, f"{path} key"): _decode(val_t, v, f"{path}.{k}") for k, v in data.items()}
    if dataclasses.is_dataclass(hint):
        return _decode_dataclass(hint, data, path)
    return _decode_scalar(hint, data, path)


def _decode_dataclass(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise ProfileFormatError(f"{path}: expected an object ({cls.__name__}), got {type(data).__name__}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ProfileFormatError(
            f"{path}: unknown field(s) {', '.join(unknown)} for {cls.__name__}; known: "
            f"{', '.join(fields)}. Was the file written by a newer profiler?"
        )
    kwargs = {}
    for name, f in fields.items():
        where = f"{path}.{name}" if path else name
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise ProfileFormatError(f"{where}: missing field ({cls.__name__} needs it).")
            continue
        kwargs[name] = _decode(hints[name], data[name], where)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise ProfileFormatError(f"{path or cls.__name__}: {exc}") from None


def _decode_scalar(hint: Any, data: Any, path: str) -> Any:
    if hint is Any:
        return data
    if hint is bool:
        if not isinstance(data, bool):
            raise ProfileFormatError(f"{path}: expected true or false, got {data!r}.")
        return data
    if hint is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise ProfileFormatError(f"{path}: expected an integer, got {data!r}.")
        return data
    if hint is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
            raise ProfileFormatError(f"{path}: expected a finite number, got {data!r}.")
        return float(data)
    if hint is str:
        if not isinstance(data, str):
            raise ProfileFormatError(f"{path}: expected a string, got {data!r}.")
        return data
    raise ProfileFormatError(f"{path}: unsupported type {hint!r} in the report schema.")
