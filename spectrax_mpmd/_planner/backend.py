"""What the backend at hand charges a step beyond its cells, measured once per advice.

* A host copy (device -> `pinned_host` and back) costs a fixed time plus its bytes
  over a bandwidth, per memory kind it goes to: both are fitted (least squares) to
  copies of a range of sizes that includes the sizes the plan moves, made with the
  runtime's own transfer (`spectrax_mpmd._comm.transfer`), so a step making many
  KiB-sized copies pays their fixed cost and not only their bytes.
* The issuing thread's CPU time per copy and per compiled call: one thread issues
  every rank's cells and copies, so a step is never shorter than its issuing. Where
  the thread CPU clock is too coarse to time one call, the wall clock times it
  (`spectrax_mpmd._runtime.clock.issue_clock`).
* How many compute units the ranks share (`parallelism`, the units a step is simulated
  on: `spectrax_mpmd._planner.shared`). Separate accelerators: one per rank, the
  issuing thread on a core of its own. Fake CPU devices share the host's cores (each
  already spreading its own work over them) with the issuing thread (`shares_host`):
  measured on the step's own cells, a real step of plain Std1F1B timed whole against
  the work of its cells each timed alone and its issuing (`busy_and_wall`,
  `ranks_at_once`), never more than the cores (`compute_units`). Only when no step
  could be measured, a test program run on every rank's device together against
  one alone stands in (`parallelism_source`).
* A cell's work is its time alone less its issuing (`cell_work`): timed alone, a cell
  also waits while the host issues it, which in a step runs on the issuing thread
  ahead of the devices. So a table of many short cells (more stages, a split
  backward) is not charged its issuing twice: measured, an 8-stage V table's cells
  sum to 10% more than plain Std1F1B's, its step takes the same time.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from .._comm import transfer
from .._runtime import issue_clock
from .._trace.policy import HOST

PROBE_SIZES = (1 << 12, 1 << 16, 1 << 20)  # bytes: a KiB-sized copy, a middling one, a MiB


@dataclass(frozen=True)
class CopyFit:
    """Seconds of one copy of `b` bytes: `fixed_s + b / bandwidth`, fitted over `sizes`."""

    fixed_s: float
    bandwidth: float
    sizes: tuple[int, ...]

    def seconds(self, nbytes: int) -> float:
        return self.fixed_s + nbytes / self.bandwidth

    def as_dict(self) -> dict:
        return {"fixed_s": self.fixed_s, "bandwidth": self.bandwidth, "sizes": list(self.sizes)}


@dataclass(frozen=True)
class BackendCost:
    """The measured costs `advise` adds to a step's cells (see the module docstring): copies to
    host (`out`) and back (`back`), the issuing thread's seconds per copy and per call, and how
    many of the `ranks` compute at once, measured on a real `"step"` or by the `"probe"`
    (`parallelism_source`), and whether the issuing thread shares their compute (`shares_host`:
    CPU devices)."""

    out: CopyFit
    back: CopyFit
    copy_issue_s: float
    call_issue_s: float
    parallelism: float
    ranks: int
    parallelism_source: str = "probe"
    shares_host: bool = False

    def as_dict(self) -> dict:
        return {
            "out": self.out.as_dict(),
            "back": self.back.as_dict(),
            "copy_issue_s": self.copy_issue_s,
            "call_issue_s": self.call_issue_s,
            "parallelism": self.parallelism,
            "ranks": self.ranks,
            "parallelism_source": self.parallelism_source,
            "shares_host": self.shares_host,
        }


def fit_line(sizes: Sequence[int], seconds: Sequence[float]) -> CopyFit:
    """Least-squares `seconds = fixed + bytes / bandwidth`, with the fixed part at least 0 and the
    bandwidth finite (a slope at or below 0, as noise can make it, is taken as the largest size's
    own rate)."""
    x, y = np.asarray(sizes, float), np.asarray(seconds, float)
    slope, fixed = np.polyfit(x, y, 1) if len(set(sizes)) > 1 else (0.0, float(y.min()))
    if slope <= 0:
        k = int(np.argmax(x))
        slope = max(y[k] - max(fixed, 0.0), 1e-12) / max(x[k], 1.0)
    return CopyFit(max(float(fixed), 0.0), 1.0 / float(slope), tuple(int(s) for s in sizes))


def _timed_copies(move, array, rounds: int) -> tuple[float, float]:
    """`(least wall seconds until ready, median issuing-thread seconds)` of `move(array)`."""
    wall, issue, clock = [], [], issue_clock().now
    for _ in range(rounds):
        start, cpu = time.perf_counter(), clock()
        (moved,) = move(array)
        issue.append(clock() - cpu)
        moved.block_until_ready()
        wall.append(time.perf_counter() - start)
    return min(wall), statistics.median(issue)


def copy_fits(device, sizes: Iterable[int], rounds: int = 5) -> tuple[CopyFit, CopyFit, float]:
    """`(out, back, issue seconds per copy)` on `device`: each size copied to `pinned_host` and
    back `rounds` times by the runtime's transfer."""
    sharding = jax.sharding.SingleDeviceSharding(device)
    host = sharding.with_memory_kind(HOST)
    out, back = transfer([sharding], [host]), transfer([host], [sharding])
    sizes = sorted({max(4, int(s) // 4 * 4) for s in sizes})
    rows = []
    for nbytes in sizes:
        x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), sharding).block_until_ready()
        (on_host,) = out(x)
        on_host.block_until_ready()
        rows.append((*_timed_copies(out, x, rounds), *_timed_copies(back, on_host, rounds)))
    out_s, out_issue, back_s, back_issue = zip(*rows)
    issue = statistics.median([*out_issue, *back_issue])
    return fit_line(sizes, out_s), fit_line(sizes, back_s), issue


def parallelism(devices: Sequence, rounds: int = 3, size: int = 192) -> tuple[float, float]:
    """`(ranks computing at once, issuing-thread seconds per call)`: a program of a few
    milliseconds run on `devices[0]` alone and on every device together (least of `rounds`
    each); `len(devices) * alone / together`, between 1 and the device count."""
    f = jax.jit(lambda x: jnp.tanh(jnp.tanh(x @ x) @ x) @ x)
    xs = [jax.device_put(jnp.full((size, size), 1e-3, jnp.float32), d) for d in devices]
    jax.block_until_ready([f(x) for x in xs])
    alone, together, issue, clock = math.inf, math.inf, [], issue_clock().now
    for _ in range(rounds):
        start = time.perf_counter()
        f(xs[0]).block_until_ready()
        alone = min(alone, time.perf_counter() - start)
        start, cpu = time.perf_counter(), clock()
        ys = [f(x) for x in xs]
        issue.append((clock() - cpu) / len(xs))
        jax.block_until_ready(ys)
        together = min(together, time.perf_counter() - start)
    return ranks_at_once(len(devices) * alone, together, len(devices)), statistics.median(issue)


def shares_host(devices: Sequence) -> bool:
    """Whether `devices` compute on the host's cores, which the issuing thread runs on too."""
    return all(d.platform == "cpu" for d in devices)


def compute_units(devices: Sequence) -> int:
    """How many of one device per rank can compute at once at most: every rank, or for CPU
    devices (which share the host's cores) no more than the cores this process may run on."""
    if not shares_host(devices):
        return len(devices)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(len(devices), cores or 1)


def ranks_at_once(busy_s: float, wall_s: float, ranks: int) -> float:
    """How many of `ranks` computed at once in a step whose cells sum to `busy_s` and which took
    `wall_s`: their ratio, between 1 (cells one after another) and `ranks`."""
    if not wall_s > 0:
        raise ValueError(f"ranks_at_once: wall_s must be positive, received {wall_s!r}.")
    return min(max(busy_s / wall_s, 1.0), float(ranks))


def cell_work(seconds: Iterable[float], issue_s: float) -> float:
    """The work of cells that take `seconds` each timed alone: each less `issue_s`, its issuing
    (which a step does on the issuing thread, ahead of the devices), and at least 0."""
    return sum(max(t - issue_s, 0.0) for t in seconds)


def busy_and_wall(step, args: Sequence, rounds: int = 3) -> tuple[float, float, float, float]:
    """`(cells' work, step's wall seconds, issuing seconds per cell, issuing seconds)` of the
    training step `step` on `args`, each the least of `rounds` after a warm-up call (which
    compiles), as a profile takes its cells' least times (other load only ever adds time): the
    whole step run as it runs; the issuing thread's CPU time of a call, and over its cells; its
    cells timed one at a time (`measure_timeline`), their `cell_work` summed."""
    jax.block_until_ready(step(*args))
    work = wall = issue = issuing = math.inf
    clock = issue_clock().now
    for _ in range(rounds):
        start, cpu = time.perf_counter(), clock()
        out = step(*args)
        issued = clock() - cpu
        jax.block_until_ready(out)
        wall = min(wall, time.perf_counter() - start)
        cells = [(e.end - e.start) * 1e-6 for row in step.measure_timeline(*args).events for e in row]
        issue, issuing = min(issue, issued / max(len(cells), 1)), min(issuing, issued)
        work = min(work, cell_work(cells, issue))
    return work, wall, issue, issuing


def step_units(measured: Sequence[float], devices: Sequence) -> float:
    """The compute units of `devices`, one per rank, from a plain step's `busy_and_wall`: the
    rank count on accelerators; on CPU devices, the ranks at once of its cells' work and its
    issuing (which runs on the same cores) over its wall time (`ranks_at_once`)."""
    if not shares_host(devices):
        return float(len(devices))
    work, wall, _, issuing = measured
    return ranks_at_once(work + issuing, wall, compute_units(devices))


def measure_backend(
    devices: Sequence,
    sizes: Iterable[int] = (),
    at_once: float | None = None,
    call_issue: float | None = None,
) -> BackendCost:
    """The `BackendCost` of one device per rank (`devices[r]` is rank r's first device): copies
    on rank 0's over `PROBE_SIZES` and `sizes` (the bytes of the values the plan moves); ranks
    computing at once `at_once` and the issuing seconds per call `call_issue` when a step
    measured them (`busy_and_wall`, `ranks_at_once`), else the probe's."""
    out, back, copy_issue = copy_fits(devices[0], {*PROBE_SIZES, *sizes})
    probed, probed_issue = parallelism(devices)
    source = "probe" if at_once is None else "step"
    ranks = probed if at_once is None else at_once
    issue = probed_issue if call_issue is None else call_issue
    return BackendCost(out, back, copy_issue, issue, ranks, len(devices), source, shares_host(devices))
