"""The benchmarks' one timing helper and one definition of spread.

Every table reports, per contender, the min and median of the wall time over interleaved rounds,
their spread ((max - min) / median over the rounds) and the issuing thread's CPU time next to it
(on the wall clock where this machine's thread CPU clock is too coarse to time a call:
`issue_clock`). `interleaved` times the rounds, `once` times one call (a first call, a compile),
`summary` turns the per-round seconds into the reported figures, `ratio` divides two of them. No
benchmark script reads a clock itself.
"""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}
WAITS = ("each", "last", None)
process_cpu = time.process_time  # a `clock=` for work on other threads too (XLA's compiles)


def issue_clock():
    """The clock the issuing thread's time is read on (`spectrax_mpmd._runtime.clock`): its CPU
    time, or the wall clock where this machine's thread CPU clock moves in steps too coarse for
    one call (10 ms under gVisor, where every call would read 0). `.now`, `.name`, `.note`."""
    from spectrax_mpmd._runtime import issue_clock as measured  # a script sets JAX's flags first

    return measured()


def ratio(numerator: float, denominator: float) -> float | None:
    """`numerator / denominator`, or None when the denominator measured 0 (a clock too coarse for
    what it timed) or less: no ratio, where a division would raise or mislead."""
    return numerator / denominator if denominator > 0 else None


def times(value: float | None) -> str:
    """A `ratio` as the tables print it: `1.03x`, or `n/a` when there is none."""
    return "n/a" if value is None else f"{value:.2f}x"


def spread(values: list) -> float:
    """(max - min) / median of `values`: the benchmarks' one measure of how much the rounds vary
    (0 when every round took the same time)."""
    med = statistics.median(values)
    low, high = min(values), max(values)
    if high == low:
        return 0.0
    return (high - low) / med if med > 0 else float("inf")


def summary(wall: list, cpu: list | None = None, unit: str = "ms") -> dict:
    """Seconds per round → min and median in `unit` ("s", "ms" or "us") and the relative spread of
    the wall time; with `cpu` (seconds per round of the issuing thread) its min and median too.

    Keys: `min_<unit>`, `median_<unit>`, `spread`, and with `cpu` `cpu_min_<unit>`,
    `cpu_median_<unit>`."""
    scale = UNITS[unit]
    out = {
        f"min_{unit}": min(wall) * scale,
        f"median_{unit}": statistics.median(wall) * scale,
        "spread": spread(wall),
    }
    if cpu is not None:
        out[f"cpu_min_{unit}"] = min(cpu) * scale
        out[f"cpu_median_{unit}"] = statistics.median(cpu) * scale
    return out


def _blocker(wait) -> Callable | None:
    """`jax.block_until_ready` unless nothing is waited for."""
    if wait is None:
        return None
    import jax  # here: a script sets its fake CPU devices before JAX is first imported

    return jax.block_until_ready


def _measure(fn: Callable, calls: int, wait, issue_cpu_only: bool, clock: Callable) -> tuple:
    """Wall and `clock` seconds of `calls` calls of `fn` in a row, and the last call's result."""
    _block, out = _blocker(wait), None
    if issue_cpu_only:  # the CPU clock stops while each result is waited for
        issued = 0.0
        t0 = time.perf_counter()
        for _ in range(calls):
            c0 = clock()
            out = fn()
            issued += clock() - c0
            if wait == "each":
                _block(out)
        if wait == "last":
            _block(out)
        return time.perf_counter() - t0, issued, out
    t0, c0 = time.perf_counter(), clock()
    if wait == "each":  # only the last result is kept (for `after`)
        for _ in range(calls - 1):
            _block(fn())
        out = _block(fn())
    elif wait is None:
        for _ in range(calls - 1):
            fn()
        out = fn()
    else:  # "last": a chain, each result feeding the next call
        for _ in range(calls):
            out = fn()
        _block(out)
    return time.perf_counter() - t0, clock() - c0, out


def interleaved(
    contenders: dict,
    rounds: int,
    calls: int = 1,
    *,
    setup: Callable | None = None,
    after: Callable | None = None,
    warmup: int = 0,
    wait: str | None = "each",
    issue_cpu_only: bool = False,
    clock: Callable | None = None,
    shuffle=None,
    collect_garbage: bool = True,
) -> tuple[dict, dict]:
    """Time every contender (a no-argument callable) `calls` times per round, the contenders
    interleaved over `rounds` rounds (so a load change on the shared machine hits them alike).
    Returns `(wall, cpu)`: per contender, the seconds per call of each round, on the wall clock
    and on `clock` (default: `issue_clock().now`, the issuing thread's CPU time where this machine
    times it finely; `time.process_time` counts every thread, a compiler's included).

    setup: `setup(name)` runs before a contender's calls in every round, untimed (fresh inputs,
        a barrier between processes, a reset of a decoder's state).
    after: `after(name, result)` runs after them, untimed, given the last call's result.
    warmup: untimed calls of the contender before its timed ones in every round.
    wait: "each" waits for every call's result (`jax.block_until_ready`) inside the timing;
        "last" only for the last one's (a chain of calls, each fed by the one before, issued
        ahead of the device); None for none (host-only work, or the result waited for in `after`).
    issue_cpu_only: the CPU clock runs only while each call is made, not while its result is
        waited for (the wall clock still counts the wait).
    shuffle: a `random.Random` (or numpy `Generator`) that orders the contenders anew each round
        (default: the order given, every round).
    collect_garbage: False switches Python's garbage collector off while the calls are timed
        (as `timeit` does), for calls of a few microseconds.
    """
    if wait not in WAITS:
        raise ValueError(f"wait={wait!r}: expected one of {WAITS}.")
    if rounds < 1 or calls < 1:
        raise ValueError(f"rounds={rounds}, calls={calls}: both must be at least 1.")
    clock = issue_clock().now if clock is None else clock
    wall = {name: [] for name in contenders}
    cpu = {name: [] for name in contenders}
    order = list(contenders)
    for _ in range(rounds):
        if shuffle is not None:
            shuffle.shuffle(order)
        for name in order:
            fn = contenders[name]
            if setup is not None:
                setup(name)
            for _ in range(warmup):
                _blocker("each")(fn())
            collecting = gc.isenabled()
            if not collect_garbage:
                gc.disable()
            try:
                w, c, out = _measure(fn, calls, wait, issue_cpu_only, clock)
            finally:
                if collecting:
                    gc.enable()
            if after is not None:
                after(name, out)
            del out
            wall[name].append(w / calls)
            cpu[name].append(c / calls)
    return wall, cpu


def once(fn: Callable, *, wait: str | None = "each", clock: Callable = process_cpu) -> tuple:
    """Wall and `clock` seconds of one call of `fn` (a first call: trace, compile and run; one
    compile), its result waited for unless `wait` is None. The default clock is the process's CPU
    time: a first call's work runs on the compiler's threads too. Returns `(wall_s, cpu_s)`."""
    if wait not in WAITS:
        raise ValueError(f"wait={wait!r}: expected one of {WAITS}.")
    w, c, _ = _measure(fn, 1, wait, False, clock)
    return w, c
