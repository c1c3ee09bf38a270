"""The figures every benchmark table reports for one contender: min, median and spread of the
wall time over interleaved rounds, next to the issuing thread's CPU time."""

from __future__ import annotations

import statistics


def summary(wall: list, cpu: list) -> dict:
    """Wall and thread-CPU seconds per round → milliseconds (min, median) and relative spread."""
    med = statistics.median(wall)
    return {
        "min_ms": min(wall) * 1e3,
        "median_ms": med * 1e3,
        "spread": (max(wall) - min(wall)) / med,
        "cpu_min_ms": min(cpu) * 1e3,
        "cpu_median_ms": statistics.median(cpu) * 1e3,
    }
