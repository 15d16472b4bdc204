"""Typed errors of the profiler. Every message says the value, why it is wrong and what to do.

They are autopar errors (the profiler builds on autopar), so the ``autopar`` command
reports them in one line like any other; a malformed report file raises autopar's own
:class:`~autopar.errors.ProfileFormatError`, which the profile schema defines.
"""

from __future__ import annotations

from autopar.errors import AutoparError, ProfileFormatError


class ProfilerError(AutoparError):
    """Base class of every error the profiler raises on purpose."""


class MeasurementError(ProfilerError, RuntimeError):
    """A measurement could not be taken (unsupported dtype, no process group, a model
    that cannot run its units in isolation)."""


class SettingsError(ProfilerError, ValueError):
    """A setting given by the user (sizes, repeats, ranks) is not allowed."""


__all__ = ["MeasurementError", "ProfileFormatError", "ProfilerError", "SettingsError"]
