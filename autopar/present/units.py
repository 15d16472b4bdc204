"""The one way ``autopar.present`` writes durations and byte counts, so the explanation,
the pictures and the HTML page read alike: ``21.6 us``, ``3 ms``, ``16.1 s``; ``67.8 GiB``.

Durations take the largest of ns, us, ms and s that keeps the number at 1 or more, with
three significant digits and never an exponent (``2.16e-05 s`` and ``3e+03 us`` are hard
to compare at a glance). Byte counts take the largest binary unit up to GiB, one decimal.
"""

from __future__ import annotations

import math

_TIME_UNITS = ((86400.0, "d"), (3600.0, "h"), (1.0, "s"), (1e-3, "ms"), (1e-6, "us"), (1e-9, "ns"))
_BYTE_UNITS = ((2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def duration(seconds: float) -> str:
    """``seconds`` with three significant digits in ns, us, ms, s, hours or days:
    ``0.0123`` -> ``12.3 ms``, ``16.14`` -> ``16.1 s``, ``1234.0`` -> ``1230 s``,
    ``9000.0`` -> ``2.5 h`` (a step of hours says its batch is not what was meant)."""
    if not math.isfinite(seconds):
        return f"{seconds} s"
    if seconds == 0:
        return "0 s"
    rounded = float(f"{seconds:.3g}")  # round first, so 999.7 us becomes 1 ms, not 1000 us
    scale, unit = next(((s, u) for s, u in _TIME_UNITS if abs(rounded) >= s), _TIME_UNITS[-1])
    return f"{significant(rounded / scale)} {unit}"


def significant(value: float) -> str:
    """Three significant digits in positional notation, trailing zeros dropped (as
    ``%g`` writes them, but never with an exponent): for numbers in a column whose unit
    the heading names."""
    if value == 0 or not math.isfinite(value):
        return f"{value:g}"
    decimals = max(0, 2 - math.floor(math.log10(abs(value))))
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def byte_unit(nbytes: float) -> tuple[float, str]:
    """(divisor, name) of the unit :func:`size` writes ``nbytes`` in, so that several
    counts can share the unit of the largest."""
    return next(((d, u) for d, u in _BYTE_UNITS if abs(nbytes) >= d), (1, "B"))


def size(nbytes: float) -> str:
    """Bytes in GiB, MiB or KiB with one decimal (``67.8 GiB``, ``154.9 MiB``), or whole bytes."""
    divisor, unit = byte_unit(nbytes)
    return f"{nbytes:.0f} B" if unit == "B" else f"{nbytes / divisor:.1f} {unit}"


def count(n: float) -> str:
    """A parameter count: 174.62B, 124.4M, 830.2K."""
    for div, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            return f"{n / div:.2f}{suffix}" if suffix == "B" else f"{n / div:.1f}{suffix}"
    return str(int(n))


def per_second(value: float, decimals: int) -> str:
    """A rate of 1 or more with thousands separators and ``decimals`` decimals (``115.4``,
    ``24,661``); a smaller one with three significant digits (:func:`significant`), so
    that a step of minutes reads ``0.0235``, not ``0.0``."""
    if abs(value) >= 1 or value == 0 or not math.isfinite(value):
        return f"{value:,.{decimals}f}"
    return significant(value)
