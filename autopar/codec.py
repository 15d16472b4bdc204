"""Frozen dataclasses <-> JSON data: one codec for plan, cluster and profile files.

A dataclass's type hints are its schema, so encoding and decoding are one generic walk
instead of a hand-written ``to_dict``/``from_dict`` per class (which drift apart).
Decoding is strict: a missing field, an unknown field or a value of the wrong type is an
error that names its path in the file (``plan.config.tp: expected an integer, got '8'``),
because a silently ignored typo in a plan or a measurement would change what runs. The
caller names the error type (a plan file raises ``PlanFormatError``, a cluster file
``ClusterError``, a profile ``ProfileFormatError``), and a dataclass's own validation
error is re-raised as that type with the path in front. Floats survive exactly: ``json``
writes ``repr(float)``, which reads back to the same bits; a non-finite float is refused
on both sides, since no field of these files may hold one. The files are written
atomically, and a command checks the paths it will write up front with the same rules
(:func:`check_output`), so a bad ``--out`` fails before the work, not after it.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import errno
import json
import math
import os
import tempfile
import types
import typing
from collections.abc import Callable, Mapping
from enum import Enum
from pathlib import Path
from typing import Any, Literal, Union

from autopar.errors import AutoparError, ConfigError


def encode(value: Any, *, error: type[AutoparError]) -> Any:
    """``value`` as JSON data: dataclasses become objects (fields in order), enums their
    values, tuples lists; mapping keys become strings."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: encode(getattr(value, f.name), error=error) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [encode(v, error=error) for v in value]
    if isinstance(value, Mapping):
        return {str(k.value if isinstance(k, Enum) else k): encode(v, error=error) for k, v in value.items()}
    if isinstance(value, float) and not math.isfinite(value):
        raise error(f"cannot write the non-finite number {value!r} into a file; the value that produced it is a bug.")
    return value


def decode(cls: Any, data: Any, path: str, *, error: type[AutoparError]) -> Any:
    """A value of type ``cls`` from JSON data, or ``error`` naming ``path``."""
    return _Decoder(error).decode(cls, data, path)


def dumps(value: Any, *, error: type[AutoparError]) -> str:
    """The JSON text of ``value`` (one space of indent, a final newline)."""
    return json.dumps(encode(value, error=error), indent=1, allow_nan=False) + "\n"


def read_json(path: str | Path, *, what: str, error: type[AutoparError], remedy: str) -> Any:
    """The JSON data in the file at ``path``, or ``error`` saying why not (``what`` names
    the kind of file, ``remedy`` how to make one)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8-sig")  # a byte-order mark, as some editors write, is not JSON
    except FileNotFoundError:
        raise error(f"{what} {str(p)!r} does not exist; {remedy}.") from None
    except (IsADirectoryError, PermissionError, UnicodeDecodeError) as exc:
        raise error(f"{what} {str(p)!r} cannot be read ({type(exc).__name__}); give a readable JSON file.") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} {str(p)!r} is not valid JSON ({exc}); was it truncated?") from None


PROFILE_SCHEMA = "autopar-profile"
"""The tag every profile report carries (and plan and cluster files do not)."""


_FILE_KINDS = {
    "profile": (
        "a profile report",
        "'autopar profile' wrote it: pass it to planning as --profile (profile= in autopar.plan), or render it with "
        "'autopar profile report'",
    ),
    "plan": (
        "a plan file",
        "'autopar plan --out' wrote it: give it to 'autopar report', 'autopar export', 'autopar run --plan' or "
        "'autopar dry-run --plan' (Plan.load)",
    ),
    "cluster": (
        "a cluster file",
        "'autopar presets --save' writes one: pass it as --cluster (cluster= in autopar.plan)",
    ),
}


def file_kind(data: Any) -> str | None:
    """Which of autopar's files ``data`` (a file's parsed JSON) is: ``profile``, ``plan``
    or ``cluster`` (None: none of them)."""
    if not isinstance(data, dict):
        return None
    if data.get("schema") == PROFILE_SCHEMA:
        return "profile"
    if {"config", "layer_strategies", "prediction"} <= data.keys():
        return "plan"
    if {"nodes", "devices_per_node", "device"} <= data.keys():
        return "cluster"
    return None


def misfiled(data: Any, own: str, expected: str) -> str | None:
    """Where ``data`` is another of autopar's files than ``own`` (:func:`file_kind`), what
    it is and what takes it (``is a plan file, not a cluster ('autopar plan --out' wrote
    it: ...)``, ``expected`` naming what was wanted): so that a loader given another kind
    says so, not a missing field of its own. None where it is not one of them, or is
    ``own``."""
    kind = file_kind(data)
    if kind is None or kind == own:
        return None
    name, how = _FILE_KINDS[kind]
    return f"is {name}, not {expected} ({how})"


def write_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` (UTF-8) through a temporary file, so a crash never leaves
    half a file; parents are created. Returns the path. A path :func:`check_writable`
    refuses raises its error before anything is written (no stray temporary file). A
    symbolic link is written through (its target replaced, the link kept), and what is
    there but is no regular file (a pipe, a device such as ``/dev/stdout``) is written
    to directly: renaming over either would replace it with a file."""
    given = check_writable(path)
    if given.exists() and not given.is_file():  # through any link: /dev/stdout is one to a pipe or a file
        with open(given, "w", encoding="utf-8") as stream:
            stream.write(text)
        return given
    p = given.resolve() if given.is_symlink() else given
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(p)
    return given


def check_writable(path: str | Path) -> Path:
    """``path``, or the OSError that writing a file there (its missing folders created)
    would meet, found without writing it: a directory or the empty path is
    IsADirectoryError; a file where a folder should be is NotADirectoryError naming that
    file (creating the folders would say FileExistsError, which reads as if the output
    were there); a folder that takes no new file (no permission, read-only, ``/proc``)
    fails creating a probe file in it, as the write would. A pipe or a device (``/dev/null``)
    is written to where it is (:func:`write_atomically`), so it needs only to be writable."""
    p = Path(path)
    if p.is_dir():  # an empty path is '.', a directory too
        raise IsADirectoryError(errno.EISDIR, "it is a directory", str(path))
    if p.exists() and not p.is_file():  # a pipe or a device (a link to one too): written to where it is
        if not os.access(p, os.W_OK):
            raise PermissionError(errno.EACCES, "it cannot be written to", str(path))
        return p
    target = p.resolve() if p.is_symlink() else p  # a link's file is replaced in the link's target's folder
    folder = next((a for a in target.parents if a.exists()), Path("."))
    if not folder.is_dir():
        raise NotADirectoryError(errno.ENOTDIR, f"{str(folder)!r} is a file, not a directory", str(path))
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{p.name}.", suffix=".probe"):
            pass
    except OSError as exc:
        raise type(exc)(exc.errno, f"no file can be created in {str(folder)!r}: {exc.strerror}", str(path)) from None
    return p


def write_output(flag: str, path: str | Path, write: Callable[[str | Path], Any]) -> None:
    """``write(path)`` for the command-line option ``flag``; its OSError (a directory, a
    file where a folder should be, no permission, a full disk) is a one-line ConfigError
    naming the option, the path and why."""
    try:
        write(path)
    except OSError as exc:
        raise ConfigError(
            f"{flag} {str(path)!r} cannot be written ({exc.strerror or exc}); give a file path in a writable directory."
        ) from None


def check_output(flag: str, path: str | Path | None) -> None:
    """Refuse ``flag``'s output path (None: the option was not given) as
    :func:`write_output` would, before the work whose result it is to hold: a bad path
    is one line at once, not after minutes of planning or measuring."""
    if path is not None:
        write_output(flag, path, check_writable)


def check_distinct(outputs: Mapping[str, Any], inputs: Mapping[str, Any] | None = None) -> None:
    """Refuse an output path that is one of the command's inputs, or another output: the
    write would replace the file the command read (the only copy of a plan, a cluster
    file, a model config) or the other output. ``outputs`` and ``inputs``: option ->
    path (None where not given; an input may be a list of paths or a spec that is no
    file, such as ``dgx-h100:8``, which matches nothing)."""
    seen: dict[Path, str] = {}
    for flag, value in (inputs or {}).items():
        for path in value if isinstance(value, (list, tuple)) else (value,):
            if path is not None and Path(path).is_file():
                seen.setdefault(Path(path).resolve(), f"{flag} {str(path)!r}")
    for flag, path in outputs.items():
        if path is None:
            continue
        where = Path(path).resolve()
        if where in seen:
            raise ConfigError(
                f"{flag} {str(path)!r} is {seen[where]} too: writing it would replace that file; give another path."
            )
        seen[where] = f"{flag} {str(path)!r}"


class _Decoder:
    def __init__(self, error: type[AutoparError]):
        self.error = error

    def decode(self, hint: Any, data: Any, path: str) -> Any:
        origin = typing.get_origin(hint)
        if hint is Any:
            return data
        if origin in (Union, types.UnionType):
            return self._union(hint, data, path)
        if origin is Literal:
            allowed = typing.get_args(hint)
            if data not in allowed:
                raise self.error(f"{path}: {data!r} is not one of {', '.join(map(repr, allowed))}.")
            return data
        if origin is tuple:
            return self._tuple(typing.get_args(hint), data, path)
        if origin in (dict, collections.abc.Mapping) or hint in (dict, Mapping):
            key_t, val_t = typing.get_args(hint) or (str, Any)
            if not isinstance(data, dict):
                raise self.error(f"{path}: expected an object, got {type(data).__name__}.")
            return {
                self.decode(key_t, k, f"{path} key {k!r}"): self.decode(val_t, v, f"{path}[{k!r}]")
                for k, v in data.items()
            }
        if isinstance(hint, type) and issubclass(hint, Enum):
            try:
                return hint(data)
            except ValueError:
                allowed = ", ".join(repr(m.value) for m in hint)
                raise self.error(f"{path}: {data!r} is not one of {allowed}.") from None
        if dataclasses.is_dataclass(hint):
            return self._dataclass(hint, data, path)
        return self._scalar(hint, data, path)

    def _union(self, hint: Any, data: Any, path: str) -> Any:
        options = [o for o in typing.get_args(hint) if o is not type(None)]
        if data is None and len(options) < len(typing.get_args(hint)):
            return None
        last: AutoparError | None = None
        for option in options:
            try:
                return self.decode(option, data, path)
            except AutoparError as exc:
                last = exc
        raise last or self.error(f"{path}: unexpected null.")

    def _tuple(self, args: tuple, data: Any, path: str) -> tuple:
        if not isinstance(data, list):
            raise self.error(f"{path}: expected a list, got {type(data).__name__}.")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(self.decode(args[0], v, f"{path}[{i}]") for i, v in enumerate(data))
        if len(args) != len(data):
            raise self.error(f"{path}: expected {len(args)} items, got {len(data)}.")
        return tuple(self.decode(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, data)))

    def _dataclass(self, cls: type, data: Any, path: str) -> Any:
        if not isinstance(data, dict):
            raise self.error(f"{path}: expected an object ({cls.__name__}), got {type(data).__name__}.")
        hints = typing.get_type_hints(cls)
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(data) - set(fields))
        if unknown:
            raise self.error(
                f"{path}: unknown field(s) {', '.join(unknown)} for {cls.__name__}; known: {', '.join(fields)}. "
                f"Was the file written by another autopar version?"
            )
        kwargs = {}
        for name, f in fields.items():
            where = f"{path}.{name}" if path else name
            if name not in data:
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                    raise self.error(f"{where}: missing field ({cls.__name__} needs it).")
                continue
            kwargs[name] = self.decode(hints[name], data[name], where)
        try:
            return cls(**kwargs)
        except (AutoparError, TypeError, ValueError) as exc:  # the dataclass's own validation
            raise self.error(f"{path or cls.__name__}: {exc}") from None

    def _scalar(self, hint: Any, data: Any, path: str) -> Any:
        if hint is bool:
            if not isinstance(data, bool):
                raise self.error(f"{path}: expected true or false, got {data!r}.")
            return data
        if hint is int:
            if isinstance(data, bool) or not isinstance(data, int):
                raise self.error(f"{path}: expected an integer, got {data!r}.")
            return data
        if hint is float:
            if isinstance(data, bool) or not isinstance(data, (int, float)) or not math.isfinite(data):
                raise self.error(f"{path}: expected a finite number, got {data!r}.")
            return float(data)
        if hint is str:
            if not isinstance(data, str):
                raise self.error(f"{path}: expected a string, got {data!r}.")
            return data
        raise self.error(f"{path}: cannot decode values of type {hint!r}.")
