"""Host cost of a step: what issuing each rank's cells and transfers costs the Python thread.

One thread issues every cell of a step. When the devices finish a cell faster
than the host issues the next, the step is host-bound: its time is the issue
time, not the arithmetic. `host_profile` measures issue time per rank and cell
kind on the issuing thread's CPU clock (`time.thread_time`, which other load on
the machine barely moves), or on the wall clock where that clock is too coarse
to time one call (`spectrax_mpmd._runtime.clock`), and compares the whole step's
issue time to its wall time.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable

import jax

from .._comm import is_transfer
from .clock import issue_clock
from .replay import replay


@dataclass(frozen=True)
class HostRow:
    """Issue cost of one rank's cells of one kind (per step)."""

    rank: int
    kind: str
    calls: int
    transfers: int
    call_us: float
    transfer_us: float

    @property
    def issue_us(self) -> float:
        return self.call_us + self.transfer_us


@dataclass(frozen=True)
class HostProfile:
    """Per-step host cost of a pipelined call (medians over rounds).

    `rows`: per (rank, cell kind) counts and issue time, where kind is a
    schedule cell (`F`, `B`, `I`, `W`, the last stage's `FB`, fused `F&B`) or
    `setup` / `finish` (accumulators, gradient sums, casts), each cell replayed as
    its own call, also where the step runs consecutive cells of a rank as one
    program. `issue_s`: the time of issuing the whole step uninstrumented; `step_s`:
    wall time of the step until its results are ready; `issue_share = issue_s /
    step_s` (near 1: host-bound). `cells`: schedule cells per step; `calls` and
    `copies`: the compiled calls (fewer than its cells' where it fuses them) and the
    copies the step issues; `calls_s`: those calls and copies each timed by itself, summed.
    `per_cell_us`: issue time per schedule cell, its transfers included;
    `calls_per_cell_us`: the same for the issued calls and copies alone, so
    `per_cell_us / calls_per_cell_us` is what running them as a plan adds (the loop,
    storing results, releasing buffers after their last use); `per_call_us`: issue
    time per issued call or copy.
    `clock` names the clock issue times were taken on: `"thread CPU"`, or `"wall"`
    where this machine's thread CPU clock is too coarse to time one call (`clock_note`
    says so, with its step).
    """

    rows: tuple[HostRow, ...]
    issue_s: float
    step_s: float
    cells: int
    calls: int
    copies: int
    calls_s: float
    rounds: int
    clock: str = "thread CPU"
    clock_note: str = ""

    @property
    def issue_share(self) -> float:
        return self.issue_s / self.step_s

    @property
    def per_cell_us(self) -> float:
        return self.issue_s * 1e6 / max(self.cells, 1)

    @property
    def calls_per_cell_us(self) -> float:
        return self.calls_s * 1e6 / max(self.cells, 1)

    @property
    def per_call_us(self) -> float:
        return self.issue_s * 1e6 / max(self.calls + self.copies, 1)

    def as_dict(self) -> dict:
        return {
            "rows": [{**row.__dict__, "issue_us": row.issue_us} for row in self.rows],
            "issue_s": self.issue_s,
            "step_s": self.step_s,
            "issue_share": self.issue_share,
            "cells": self.cells,
            "calls": self.calls,
            "copies": self.copies,
            "calls_s": self.calls_s,
            "per_cell_us": self.per_cell_us,
            "calls_per_cell_us": self.calls_per_cell_us,
            "per_call_us": self.per_call_us,
            "rounds": self.rounds,
            "clock": self.clock,
        }

    def table(self) -> str:
        """The report as text: one line per (rank, kind), then the step totals."""
        lines = [
            f"{'rank':>4} {'kind':8} {'calls':>6} {'sends':>6} {'call us':>9} {'send us':>9} {'us/call':>8}"
        ]
        for r in self.rows:
            per = r.issue_us / max(r.calls, 1)
            lines.append(
                f"{r.rank:>4} {r.kind:8} {r.calls:>6} {r.transfers:>6} {r.call_us:>9.1f} {r.transfer_us:>9.1f} {per:>8.1f}"
            )
        measure = "CPU" if self.clock == "thread CPU" else "wall time"
        lines.append(
            f"step: issue {self.issue_s * 1e3:.2f} ms {measure} of {self.step_s * 1e3:.2f} ms wall "
            f"({self.issue_share:.0%} issuing); {self.cells} schedule cells issued as "
            f"{_count(self.calls, 'call', 'calls')} and {_count(self.copies, 'copy', 'copies')}, "
            f"{self.per_cell_us:.1f} us issue {measure} per cell (with its sends), of which the calls and "
            f"copies alone {self.calls_per_cell_us:.1f} us"
        )
        replayed = sum(row.calls for row in self.rows)
        if self.calls < replayed:
            lines.append(
                f"(the rows time each cell as its own call, {replayed} calls; the step runs consecutive "
                f"cells of a rank as one program, {_count(self.calls, 'call', 'calls')} in all)"
            )
        if self.clock_note:
            lines.append(f"({self.clock_note})")
        return "\n".join(lines)


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _step_owners(plan) -> list[tuple[int, str]]:
    """(rank, kind) of every plan step: the action it belongs to, else setup / finish by the
    rank of the devices it writes."""
    owners: list = [None] * len(plan.steps)
    first = min((a for _, _, a, _ in plan.action_steps), default=len(plan.steps))
    for (rank, _, a, b), (_, _, cell) in zip(plan.action_steps, plan.log):
        for k in range(a, b):
            owners[k] = (rank, cell)
    for k, (fn, *_rest) in enumerate(plan.steps):
        if owners[k] is None:
            owners[k] = (_rank_of(plan, fn), "setup" if k < first else "finish")
    return owners


def _rank_of(plan, fn) -> int:
    shardings = fn.targets if is_transfer(fn) else jax.tree.leaves(fn.output_shardings)
    device = min(shardings[0].device_set, key=lambda d: d.id)
    return plan.device_rank.get(device, -1)


def host_profile(plan, inputs: Callable, rounds: int = 7) -> HostProfile:
    """Run `plan` `2 * rounds` times (`3 * rounds` where it fuses cells), each on `inputs()` (placed
    inputs, made outside the timed part): instrumented runs give the per-(rank, kind) issue time,
    cell by cell, and the issued calls' own time; uninstrumented ones the whole step's issue and
    wall time; medians over rounds. Issue times are on `issue_clock()`."""
    clock = issue_clock()
    owners = _step_owners(plan)
    keys = sorted(set(owners), key=lambda o: (o[0], o[1]))
    samples: dict = {k: [] for k in keys}
    issue, wall, issued = [], [], []
    fused = bool(plan.issued)  # else the step issues `plan.steps`, the cell-by-cell replay times them
    for _ in range(rounds):
        costs = _timed_steps(plan, inputs(), clock, plan.steps)
        spent = dict.fromkeys(keys, (0.0, 0.0))
        for owner, (fn, *_rest), cost in zip(owners, plan.steps, costs):
            call_s, send_s = spent[owner]
            spent[owner] = (call_s, send_s + cost) if is_transfer(fn) else (call_s + cost, send_s)
        for k in keys:
            samples[k].append(spent[k])
        issued.append(sum(_timed_steps(plan, inputs(), clock, plan.hot_steps) if fused else costs))
        placed_inputs = inputs()
        jax.block_until_ready(plan.buffers(placed_inputs))
        wall_start, issue_start = time.perf_counter(), clock.now()
        out = plan.run(placed_inputs)
        issue.append(clock.now() - issue_start)
        jax.block_until_ready(out)
        wall.append(time.perf_counter() - wall_start)
    counts: dict = {k: [0, 0] for k in keys}
    for owner, (fn, *_rest) in zip(owners, plan.steps):
        counts[owner][1 if is_transfer(fn) else 0] += 1
    rows = tuple(
        HostRow(
            rank,
            kind,
            counts[(rank, kind)][0],
            counts[(rank, kind)][1],
            statistics.median(c for c, _ in samples[(rank, kind)]) * 1e6,
            statistics.median(s for _, s in samples[(rank, kind)]) * 1e6,
        )
        for rank, kind in keys
    )
    cells = sum(len(cell.split("&")) for _, _, cell in plan.log if cell != "-")
    return HostProfile(
        rows,
        statistics.median(issue),
        statistics.median(wall),
        cells,
        sum(not is_transfer(fn) for fn, *_ in plan.hot_steps),
        sum(is_transfer(fn) for fn, *_ in plan.hot_steps),
        statistics.median(issued),
        rounds,
        clock.name,
        clock.note,
    )


def _timed_steps(plan, placed_inputs, clock, steps) -> list[float]:
    """Each of `steps`' own seconds (its call or copy timed by itself) in one replay of them."""
    spent: list = []

    def call(k, fn, args):
        start = clock.now()
        results = fn(*args)
        spent.append(clock.now() - start)
        return results

    jax.block_until_ready(replay(plan, placed_inputs, call=call, ready=True, steps=steps))
    return spent
