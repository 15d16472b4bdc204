"""Typed errors. Every message says the value, why it is wrong and what to do."""

from __future__ import annotations


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
    """

    def __init__(self, message: str, *, min_memory_bytes: float, capacity_bytes: float):
        super().__init__(message)
        self.min_memory_bytes = min_memory_bytes
        self.capacity_bytes = capacity_bytes


def check_positive_int(name: str, value: object, hint: str = "") -> int:
    """Return ``value`` if it is an int >= 1, else raise ConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        extra = f" {hint}" if hint else ""
        raise ConfigError(f"{name}={value!r} is not allowed: it must be a positive integer.{extra}")
    return value


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


POSITION_FIELDS = ("max_position_embeddings", "n_positions", "seq_len")
"""Where a model's ``config`` gives the longest sequence it was built for: Hugging Face
configs (``n_positions`` in GPT-2's), then autopar's own GPT and Llama configs."""


def max_positions(model: object) -> tuple[int, str] | None:
    """The longest sequence ``model`` was built for and the config field that says so, or
    None for a model without such a config (then any length is taken)."""
    config = getattr(model, "config", None)
    for field in POSITION_FIELDS:
        value = getattr(config, field, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, field
    return None


def longest_length_note(limit: tuple[int, str], flag: str) -> str:
    """What a plan says when it was made for the longest sequence its model was built for
    (``limit``, from :func:`max_positions`) because no length was given; ``flag`` is how
    the caller gives one (``--seq-len``, ``seq_len=``)."""
    return (
        f"Planned for seq_len {limit[0]}, the model's maximum (config.{limit[1]}), as no sequence length was given; "
        f"pass {flag} with your training length: memory, FLOPs and the chosen plan depend on it."
    )


def check_seq_len(seq_len: object, model: object) -> int:
    """Return ``seq_len`` if it is a positive integer no longer than the positions
    ``model`` was built for, else raise ConfigError: a longer sequence indexes past a
    learned position table, or past the context a rotary model was trained for."""
    length = check_positive_int("seq_len", seq_len)
    limit = max_positions(model)
    if limit is not None and length > limit[0]:
        raise ConfigError(
            f"seq_len={length} is longer than the {limit[0]} positions {type(model).__name__} was built for "
            f"(config.{limit[1]}); give seq_len <= {limit[0]}, or a model configured for longer sequences."
        )
    return length


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
