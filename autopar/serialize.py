"""Type-directed conversion between frozen dataclasses and JSON data.

The plan file is the contract between the planner and the runtime, so decoding checks
every field against its annotation and names the exact path of anything wrong
(``plan.config.tp: expected an integer, got '8'``) instead of failing deep inside.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from collections.abc import Mapping
from enum import Enum
from typing import Any, Union

from autopar.errors import PlanFormatError


def encode(value: Any) -> Any:
    """Dataclasses -> dicts (field order kept), enums -> values, tuples -> lists."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        to_dict = getattr(value, "to_dict", None)
        if callable(to_dict):
            return to_dict()
        return {f.name: encode(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (list, tuple)):
        return [encode(v) for v in value]
    if isinstance(value, Mapping):
        return {str(encode(k)): encode(v) for k, v in value.items()}
    return value


def decode(cls: Any, data: Any, path: str) -> Any:
    """Rebuild a value of annotation ``cls`` from JSON data, or raise PlanFormatError."""
    origin = typing.get_origin(cls)
    args = typing.get_args(cls)
    if cls is Any:
        return data
    if origin in (Union, types.UnionType):
        if data is None and type(None) in args:
            return None
        last: PlanFormatError | None = None
        for arg in args:
            if arg is type(None):
                continue
            try:
                return decode(arg, data, path)
            except PlanFormatError as exc:
                last = exc
        raise last or PlanFormatError(f"{path}: unexpected null")
    if origin is typing.Literal:
        if data not in args:
            raise PlanFormatError(f"{path}: {data!r} is not one of {list(args)}")
        return data
    if origin is tuple:
        if not isinstance(data, list):
            raise PlanFormatError(f"{path}: expected a list, got {type(data).__name__}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise PlanFormatError(f"{path}: expected {len(args)} items, got {len(data)}")
        return tuple(decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))
    if origin in (dict, Mapping, collections.abc.Mapping) or cls in (dict, Mapping):
        if not isinstance(data, dict):
            raise PlanFormatError(f"{path}: expected an object, got {type(data).__name__}")
        key_t, val_t = args if args else (str, Any)
        return {decode(key_t, k, f"{path}.key"): decode(val_t, v, f"{path}[{k!r}]") for k, v in data.items()}
    if isinstance(cls, type) and issubclass(cls, Enum):
        try:
            return cls(data)
        except ValueError:
            allowed = ", ".join(repr(m.value) for m in cls)
            raise PlanFormatError(f"{path}: {data!r} is not allowed; expected one of {allowed}") from None
    if isinstance(cls, type) and dataclasses.is_dataclass(cls):
        from_dict = getattr(cls, "from_dict", None)
        if callable(from_dict):
            try:
                return from_dict(data, origin=path)
            except PlanFormatError:
                raise
            except Exception as exc:  # a typed error of the class itself (e.g. ClusterError)
                raise PlanFormatError(f"{path}: {exc}") from None
        return _decode_dataclass(cls, data, path)
    if cls is bool:
        if not isinstance(data, bool):
            raise PlanFormatError(f"{path}: expected true or false, got {data!r}")
        return data
    if cls is int:
        if isinstance(data, bool) or not isinstance(data, int):
            raise PlanFormatError(f"{path}: expected an integer, got {data!r}")
        return data
    if cls is float:
        if isinstance(data, bool) or not isinstance(data, (int, float)):
            raise PlanFormatError(f"{path}: expected a number, got {data!r}")
        return float(data)
    if cls is str:
        if not isinstance(data, str):
            raise PlanFormatError(f"{path}: expected a string, got {data!r}")
        return data
    raise PlanFormatError(f"{path}: cannot decode values of type {cls!r}")


def _decode_dataclass(cls: type, data: Any, path: str) -> Any:
    if not isinstance(data, dict):
        raise PlanFormatError(f"{path}: expected an object, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise PlanFormatError(f"{path}: unknown field(s) {unknown}; expected {sorted(fields)}")
    kwargs = {}
    for name, f in fields.items():
        if name not in data:
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise PlanFormatError(f"{path}: missing field {name!r}")
            continue
        kwargs[name] = decode(hints[name], data[name], f"{path}.{name}")
    try:
        return cls(**kwargs)
    except PlanFormatError:
        raise
    except Exception as exc:
        raise PlanFormatError(f"{path}: {exc}") from None
