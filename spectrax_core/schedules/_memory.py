"""Memory in bytes over a step: `StageMemory` and `peak_bytes`.

Each rank holds its parameters, their gradient accumulators, the optimizer's
state and the step's inputs for the whole step; on top of that, each
`(stage, microbatch)` holds buffers from one cell to another:

* an activation received from the previous stage, from its arrival (the end of
  the producing forward) to the end of the forward (`inputs`) or, when the
  backward reads it, to the end of the backward (`kept_inputs`);
* what the forward saves for the backward (`residuals`), from the end of the
  forward to the end of the backward;
* the cotangent received from the next stage (`grads`), from its arrival to the
  end of the backward;
* an I cell's stash for its W (`stash`), from the end of I to the end of W.

Saved values can be offloaded: `host_residuals` and `host_stash` are the bytes
of residuals and stash kept in host memory instead, from the end of the cell
that makes them to the start of the first backward cell that reads them (B, I
or W for residuals, W for the stash; a reading cell gets its own device copy
for its duration, a temporary like any other). `peak_bytes(..., kind="host")`
sweeps those; the default `kind="device"` the rest.

"The end of the backward" is the end of B, or of W when the backward is split.
The last stage computes its input cotangent together with its forward (a fused
loss cell), so the cotangent it sends arrives at the end of that forward.
"When" is either the order a host thread issues the cells (the default: with
asynchronous dispatch that is when buffers exist) or the simulated device
times (`peak_bytes(..., order="time")`). At equal times releases come before
allocations: a rank's peak is taken between cells, over the buffers it holds,
not inside a cell (temporaries are not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from ._flow import DeadlockError, Flow, issue_order
from ._timeline import Timeline

_PER_STAGE = ("inputs", "kept_inputs", "residuals", "grads", "stash", "host_residuals", "host_stash")
_PER_RANK = ("params", "accumulators", "optimizer", "other")


@dataclass(frozen=True)
class StageMemory:
    """Bytes per stage (for one microbatch) and per rank, on one device of the rank.

    Per stage `s` (tuples of one entry per logical stage): `inputs[s]` received
    activations only the forward reads; `kept_inputs[s]` received activations the
    backward reads too; `residuals[s]` what the forward saves for the backward;
    `grads[s]` the cotangents received from the next stage; `stash[s]` what an I
    cell keeps for its W. Per rank (one entry per rank): `params`,
    `accumulators` (gradients summed over microbatches, and the loss),
    `optimizer` (the optimizer's state, an estimate) and `other` (the batch and
    other arguments placed on the rank, constants), all held for the whole step.
    `host_residuals[s]` and `host_stash[s]` are the residual and stash bytes kept
    in host memory (empty: none; `residuals` and `stash` count the device part).
    """

    inputs: tuple[int, ...]
    kept_inputs: tuple[int, ...]
    residuals: tuple[int, ...]
    grads: tuple[int, ...]
    stash: tuple[int, ...]
    params: tuple[int, ...]
    accumulators: tuple[int, ...]
    optimizer: tuple[int, ...]
    other: tuple[int, ...]
    host_residuals: tuple[int, ...] = ()
    host_stash: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("host_residuals", "host_stash"):
            if getattr(self, name) == ():
                object.__setattr__(self, name, (0,) * len(self.inputs))
        for group, names in (("stage", _PER_STAGE), ("rank", _PER_RANK)):
            sizes = {name: getattr(self, name) for name in names}
            count = len(sizes[names[0]])
            for name, values in sizes.items():
                if not isinstance(values, tuple) or len(values) != count:
                    raise ValueError(
                        f"StageMemory: {name} must be a tuple with one byte count per {group} (as "
                        f"{names[0]} has, {count}), received {values!r}."
                    )
                for k, v in enumerate(values):
                    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                        raise ValueError(
                            f"StageMemory: {name}[{k}] must be a non-negative int of bytes, received {v!r}."
                        )

    @property
    def stages(self) -> int:
        return len(self.inputs)

    @property
    def ranks(self) -> int:
        return len(self.params)

    def of(self, name: str, stage: int, microbatch: int) -> int:
        """The bytes `name` (a per-stage field) of `stage` holds for `microbatch`: the same for
        every microbatch here; a subclass may size each microbatch on its own (microbatches of
        different lengths)."""
        return getattr(self, name)[stage]

    def static(self, rank: int) -> int:
        """Bytes rank `rank` holds for the whole step: parameters, accumulators, optimizer, other."""
        return sum(getattr(self, name)[rank] for name in _PER_RANK)

    def as_dict(self) -> dict:
        return {f.name: list(getattr(self, f.name)) for f in fields(self)}


def peak_bytes(
    timeline: Timeline, memory: StageMemory, order: str = "issue", kind: str = "device"
) -> tuple[int, ...]:
    """Per rank, the most bytes it holds at once over `timeline`'s step (see the module docstring),
    in device memory (`kind="device"`) or in host memory (`kind="host"`: offloaded values).

    `order="issue"` (default) follows the order one host thread issues the cells:
    every rank's cells in table order, merged round-robin, one cell per rank per
    round once what it reads was issued. With asynchronous dispatch a buffer exists
    from the issue of the cell (or send) that makes it to the issue of its last
    reader, so this is what `spectrax_mpmd`'s runtime holds, whatever the durations.
    `order="time"` follows the simulated device times instead (a buffer arrives when
    its producer ends, plus `comm` across ranks): a runtime that allocates on arrival.
    """
    if not isinstance(memory, StageMemory):
        raise TypeError(f"peak_bytes: memory must be a StageMemory, received {type(memory).__name__}.")
    if order not in ("issue", "time"):
        raise ValueError(f"peak_bytes: order must be 'issue' or 'time', received {order!r}.")
    if kind not in ("device", "host"):
        raise ValueError(f"peak_bytes: kind must be 'device' or 'host', received {kind!r}.")
    if memory.ranks != timeline.n:
        raise ValueError(
            f"peak_bytes: the StageMemory has {memory.ranks} ranks but the timeline has {timeline.n}; "
            "give one byte count per rank."
        )
    stages = 1 + max((a.stage for row in timeline.events for e in row for a in e.cell.parts), default=-1)
    if stages != memory.stages:
        raise ValueError(
            f"peak_bytes: the StageMemory has {memory.stages} stages but the timeline runs {stages}; "
            "give one byte count per logical stage."
        )
    if order == "issue":
        rows = _issued(timeline.events, stages)
    else:
        rows = [[(e.rank, e.cell, e.start, e.end) for e in row] for row in timeline.events]
    comm = 0.0 if order == "issue" else float(timeline.cost.comm)
    return _host_peaks(rows, memory) if kind == "host" else _peaks(rows, comm, memory)


def _issued(events, stages: int) -> list[list[tuple]]:
    """Each rank's cells as `(rank, cell, k, k + 1)`, k the cell's place in the issue order of
    a chain of `stages` stages."""
    table = [[e.cell for e in row] for row in events]
    try:
        order = issue_order(table, Flow.chain(stages))
    except DeadlockError as err:
        message = "peak_bytes: the timeline's cells cannot be issued in table order."
        raise DeadlockError(message, err.stuck) from None
    rows: list[list] = [[] for _ in table]
    for k, (r, cell) in enumerate(order):
        rows[r].append((r, cell, float(k), float(k + 1)))
    return rows


def _peaks(rows, comm: float, memory: StageMemory) -> tuple[int, ...]:
    """Sweep each rank's holdings over `rows` of `(rank, cell, start, end)`."""
    where: dict[tuple[str, int, int], tuple[int, float, float]] = {}
    for row in rows:
        for rank, cell, start, end in row:
            for a in cell.parts:
                where[(a.kind, a.stage, a.microbatch)] = (rank, start, end)
    marks: list[list[tuple[float, int]]] = [[] for _ in rows]

    def hold(rank: int, start: float, end: float, nbytes: int) -> None:
        if nbytes and end > start:
            marks[rank] += [(start, nbytes), (end, -nbytes)]

    def arrival(key: tuple[str, int, int], rank: int) -> float:
        src, _, end = where[key]
        return end + (comm if src != rank else 0.0)

    last = memory.stages - 1
    for (kind, s, mb), (rank, _, f_end) in where.items():
        if kind != "F":
            continue
        backward = where.get(("W", s, mb)) or where.get(("B", s, mb)) or where.get(("I", s, mb))
        b_end = backward[2] if backward is not None else f_end
        if s > 0:
            came = arrival(("F", s - 1, mb), rank)
            hold(rank, came, f_end, memory.of("inputs", s, mb))
            hold(rank, came, b_end, memory.of("kept_inputs", s, mb))
        hold(rank, f_end, b_end, memory.of("residuals", s, mb))
        if s < last:
            if s + 1 == last:  # the loss cell sends its input cotangent with its forward
                producer = ("F", last, mb)
            else:
                producer = ("I", s + 1, mb) if ("I", s + 1, mb) in where else ("B", s + 1, mb)
            hold(rank, arrival(producer, rank), b_end, memory.of("grads", s, mb))
        if ("I", s, mb) in where and ("W", s, mb) in where:
            hold(rank, where[("I", s, mb)][2], where[("W", s, mb)][2], memory.of("stash", s, mb))
    peaks = []
    for rank, row in enumerate(marks):
        live = peak = memory.static(rank)
        for _, delta in sorted(row):  # at equal times a release (negative) sorts first
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)


def _host_peaks(rows, memory: StageMemory) -> tuple[int, ...]:
    """Sweep each rank's host holdings over `rows`: offloaded residuals from the end of F to the
    start of the last backward cell that reads them (W when split, else B), the offloaded stash
    from the end of I to the start of W."""
    where = {
        (a.kind, a.stage, a.microbatch): (rank, start, end)
        for row in rows
        for rank, cell, start, end in row
        for a in cell.parts
    }
    marks: list[list[tuple[float, int]]] = [[] for _ in rows]
    for (kind, s, mb), (rank, _, f_end) in where.items():
        if kind != "F":
            continue
        reader = where.get(("W", s, mb)) or where.get(("B", s, mb)) or where.get(("I", s, mb))
        residuals, stash = memory.of("host_residuals", s, mb), memory.of("host_stash", s, mb)
        if reader is not None and residuals and reader[1] > f_end:
            marks[rank] += [(f_end, residuals), (reader[1], -residuals)]
        if ("I", s, mb) in where and ("W", s, mb) in where and stash:
            marks[rank] += [(where[("I", s, mb)][2], stash), (where[("W", s, mb)][1], -stash)]
    peaks = []
    for row in marks:
        live = peak = 0
        for _, delta in sorted(row):
            live += delta
            peak = max(peak, live)
        peaks.append(peak)
    return tuple(peaks)
