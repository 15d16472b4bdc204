"""Integer helpers of the search space."""

from __future__ import annotations

import math


def divisors(n: int, *, at_most: int | None = None) -> list[int]:
    """Positive divisors of ``n`` in increasing order; only those up to ``at_most`` when
    given, found without enumerating the rest. Either way a batch of 10**18 samples or a
    cluster of a million nodes takes milliseconds, not hours: the full list is built from
    the pairs ``d, n // d`` up to the square root."""
    if at_most is not None:
        return [d for d in range(1, min(n, at_most) + 1) if n % d == 0]
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]
