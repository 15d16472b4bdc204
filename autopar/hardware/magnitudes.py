"""The range real hardware spans (FLOP/s, bytes, bytes per second), and the errors for a
cluster value outside it: such a value is in the wrong unit (989 for 989 TFLOP/s, 80 for
80 GiB), and planned as given it would fit with absurd times or fit nothing."""

from __future__ import annotations

from autopar.errors import ClusterError

MIN_FLOP_PER_S = 1e8
"""The slowest compute a device may state (FLOP/s: a peak, the fastest point of a matmul
curve), for the whole device (before a time share): 100 MFLOP/s, some 30 times below one
core of an old CPU and 10**7 below an H100, so only a value in the wrong unit (989 for
989 TFLOP/s) falls under it, where the plans it gives would be absurd yet marked fitting."""

MAX_FLOP_PER_S = 1e17
"""The fastest compute a device may state (FLOP/s): 100 PFLOP/s, some 50 times an H100's
dense FP8 peak, so only a value in the wrong unit (989e15 for 989 TFLOP/s) passes it,
where the plans it gives would have an MFU near zero."""

MAX_MEMORY_BYTES = 2**45
"""The most memory a device may state (bytes): 32 TiB, some 200 times an H200's, so only
a value in the wrong unit passes it."""

MIN_MEMORY_BYTES = 2**20
"""The least memory a device may state (bytes): 1 MiB, thousands of times below any
accelerator or CPU process, so only a value in the wrong unit (80 for 80 GiB) falls
under it, which would otherwise be refused as a reserve above the capacity, or fit nothing."""

MIN_MEMORY_BYTES_PER_S = 1e8
"""The slowest memory bandwidth a device may state (bytes per second, the whole device):
100 MB/s, some 100 times below one DDR channel, so only a value in the wrong unit falls
under it."""


def sci(x: float) -> str:
    """``x`` in at most three significant digits, its exponent without a sign or zeros
    (``9.89e14``, ``1e8``, ``2e-6``, ``0.002``): how the magnitude errors write numbers."""
    text = f"{x:.3g}"
    if "e" not in text:
        return text
    mantissa, exponent = text.split("e")
    return f"{mantissa}e{int(exponent)}"


_PREFIXES = {"T": 1e12, "G": 1e9, "M": 1e6}


def too_small(
    what: str, value: float, bound: float, unit: str, prefixes: str, *, note: str = "", remedy: str = ""
) -> ClusterError:
    """The error for a rate below ``bound``: ``what`` (the field and how it was given) is
    slower than any real device or link, the field is in ``unit``, and ``value`` read
    with each of ``prefixes`` (``"TG"``: tera, giga) shows what it should have been;
    ``note`` is added to that, ``remedy`` to fixing the cluster file."""
    examples = ", ".join(f"{value:g} {p}{unit} is {sci(value * _PREFIXES[p])}" for p in prefixes)
    return ClusterError(
        f"{what} is below {sci(bound)} {unit}, slower than any real hardware: the field is in {unit} "
        f"({note}{examples}); fix the cluster file{remedy}."
    )
