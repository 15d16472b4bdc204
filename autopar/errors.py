"""Typed errors. Every message says the value, why it is wrong and what to do."""

from __future__ import annotations

import numbers


class AutoparError(Exception):
    """Base class of every error autopar raises on purpose."""


class ConfigError(AutoparError, ValueError):
    """A value given by the user (a size, a mode, a constraint) is not allowed."""


class ClusterError(ConfigError):
    """A cluster description is malformed or names an unknown preset."""


class DeviceCountError(ConfigError):
    """No configuration of the cluster's device count satisfies the batch and the
    constraints (a fixed degree that does not divide it, no candidate left), where
    another device count may have one: what :func:`autopar.present.whatif.fewest_nodes`
    moves on from, as it does from a plan that does not fit, while any other ConfigError
    is the input's fault at every node count."""


class ModelError(AutoparError, ValueError):
    """The model cannot be analysed (no forward input, an unsupported structure)."""


class PlanFormatError(AutoparError, ValueError):
    """A plan file is malformed, of an unknown schema version, or inconsistent."""


class ProfileFormatError(AutoparError, ValueError):
    """A profile report is malformed, of an unknown schema version, or inconsistent."""


class InfeasiblePlanError(AutoparError):
    """No configuration in the searched space fits in device memory.

    Attributes:
        min_memory_bytes: the smallest peak memory per device found.
        capacity_bytes: the memory of one device.
        nodes_that_fit: a node count of the same cluster where a configuration fits,
            as the message offers it; None where none was found.
    """

    def __init__(
        self, message: str, *, min_memory_bytes: float, capacity_bytes: float, nodes_that_fit: int | None = None
    ):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.capacity_bytes = capacity_bytes
        self.nodes_that_fit = nodes_that_fit


def check_positive_int(name: str, value: object, hint: str = "") -> int:
    """Return ``value`` as an int if it is an integer >= 1 (a numpy integer too), else
    raise ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        extra = f" {hint}" if hint else ""
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a positive integer.{extra}")
    return int(value)


def check_positive_float(name: str, value: object, unit: str = "", *, error: type[ConfigError] = ConfigError) -> float:
    """Return ``value`` as float if it is a finite number > 0, else raise ``error``
    (a cluster description's values raise ClusterError)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or value == float("inf"):
        raise error(f"{name}={value!r} is not allowed: it must be a finite number > 0{(' ' + unit) if unit else ''}.")
    return float(value)


def check_cluster_seconds(name: str, value: object) -> float:
    """Return ``value`` as float if it is a finite number >= 0 (seconds), else raise
    ClusterError."""
    if isinstance(value, bool) or not (isinstance(value, (int, float)) and 0 <= value < float("inf")):
        raise ClusterError(f"{name}={value!r} is not allowed: it must be a finite number >= 0 seconds.")
    return float(value)


def first_line(exc: BaseException) -> str:
    """A library's exception message in one line: its first, joined with the next while
    a line ends in a colon (a heading over the detail, as transformers' config checks
    write them)."""
    lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
    if not lines:
        return type(exc).__name__
    text = lines[0]
    for line in lines[1:]:
        if not text.endswith(":"):
            break
        text = f"{text} {line}"
    return text


def out_of_memory(exc: BaseException) -> str | None:
    """What a command says of ``exc`` where it is an allocation that failed (Python's
    MemoryError, torch's out-of-memory error, or its CPU allocator's refusal, which
    torch raises as a plain RuntimeError): the cause's first line and what to do; None
    for any other error."""
    if isinstance(exc, MemoryError):
        cause = first_line(exc) if str(exc) else "MemoryError"
    elif isinstance(exc, RuntimeError):
        import torch

        if not (isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)):
            return None
        cause = first_line(exc)
    else:
        return None
    return (
        f"this machine ran out of memory ({cause}); give smaller sizes (the profiler's --sizes, --array-sizes, "
        f"--max-bytes, --batch or --seq-len, as the command takes them), or free memory on this machine."
    )
