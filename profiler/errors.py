"""Typed errors of the profiler. Every message says the value, why it is wrong and what to do.

The profiler's report format must be readable without autopar (``profiler.report``
imports nothing from it), so these errors stand alone rather than subclassing
``autopar.errors``.
"""

from __future__ import annotations


class ProfilerError(Exception):
    """Base class of every error the profiler raises on purpose."""


class ProfileFormatError(ProfilerError, ValueError):
    """A report file is malformed, of an unknown schema version, or inconsistent."""


class MeasurementError(ProfilerError, RuntimeError):
    """A measurement could not be taken (unsupported dtype, no process group, a model
    that cannot run its units in isolation)."""


class SettingsError(ProfilerError, ValueError):
    """A setting given by the user (sizes, repeats, ranks) is not allowed."""
