"""The fixes a refusal suggests: nearby divisors and multiples."""

from __future__ import annotations


def divisors_near(n: int, limit: int) -> str:
    """The divisors of n up to limit, as a hint's list: "1, 2, 4"."""
    return ", ".join(str(d) for d in range(1, limit + 1) if n % d == 0)


def multiples_near(value: int, k: int) -> str:
    """The multiples of k nearest value, as a hint: "64 or 72"."""
    lo = max(k, value // k * k)
    return f"{lo} or {lo + k}" if lo != value else str(lo)
