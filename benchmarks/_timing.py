"""The figures every benchmark table reports for one contender: min, median and spread of the
wall time over interleaved rounds, next to the issuing thread's CPU time."""

from __future__ import annotations

import statistics
import time


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


def interleaved(contenders: dict, rounds: int, calls: int) -> tuple[dict, dict]:
    """Time every contender (a callable) `calls` times per round, the contenders interleaved over
    `rounds` rounds (so a load change on the shared machine hits them alike); each call waited
    for. Returns `(wall, cpu)`: per contender, the seconds per call of each round (wall clock and
    the issuing thread's CPU time)."""
    import jax  # here: a script sets its fake CPU devices before JAX is first imported

    wall = {name: [] for name in contenders}
    cpu = {name: [] for name in contenders}
    for _ in range(rounds):
        for name, fn in contenders.items():
            t0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(calls):
                jax.block_until_ready(fn())
            wall[name].append((time.perf_counter() - t0) / calls)
            cpu[name].append((time.thread_time() - c0) / calls)
    return wall, cpu
