"""Fuse runs of consecutive cell steps on the same devices into one program each.

Every compiled call costs the host a dispatch, whatever the call computes. Cells
that follow one another on one rank with no transfer between them (all the
virtual stages of a one-rank pipeline, a backward and the gradient reduction and
update hoisted after it) need nothing from another rank in between, so one
program can run them all: the run's first readings are its arguments, a value
made and used inside it never leaves the program, and what a later step or the
call's result reads is returned. The order of the cells, and so every value, is
the plan's; the host issues one call where it issued many.

The fused steps are what `Plan.run` issues. The plan keeps its steps cell by
cell for the measurements that replay them one at a time; a cell that only runs
inside a fused program is compiled when such a measurement first calls it.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
from jax.sharding import NamedSharding

from .._compile.compiler import CellSpec
from .._runtime.plan import Step


class Wiring(NamedTuple):
    """A run of cell steps with its slots numbered in order of first use, so that runs reading and
    writing alike (the same cells on the next microbatch) share one program: per cell its spec and
    local inputs and outputs, the run's arguments and results (local numbers) and its donated
    argument positions; `slots[n]` is the plan slot of local number `n`."""

    cells: tuple  # (spec, local ins, local outs) per cell
    arguments: tuple
    results: tuple
    donated: tuple
    slots: tuple

    def key(self) -> tuple:
        """What the fused program depends on (the plan slots aside)."""
        return self.cells, self.arguments, self.results, self.donated


def _devices(spec: CellSpec) -> frozenset:
    shardings = [s.sharding for s in spec.in_specs] + list(spec.out_shardings)
    return frozenset(d for sh in shardings if sh is not None for d in sh.device_set)


def runs(steps: list, limit: int) -> list[tuple[int, int]]:
    """`(first, end)` of each run of at least two consecutive cell steps on the same devices, at
    most `limit` cells each, without the cells at its ends whose program is also issued alone
    (`trimmed`)."""
    out, start, devices = [], 0, None
    for k, step in enumerate([*steps, None]):
        here = _devices(step.fn) if step is not None and isinstance(step.fn, CellSpec) else None
        if here is None or here != devices or k - start >= limit:
            if devices is not None and k - start > 1:
                out.append((start, k))
            start, devices = k, here
    return trimmed(out, [step.fn if isinstance(step.fn, CellSpec) else None for step in steps])


def trimmed(spans: list[tuple[int, int]], programs: list) -> list[tuple[int, int]]:
    """`spans` (runs `(first, end)` of items, item `k` running `programs[k]`; None: not a
    program) less the items at their ends whose program is also issued alone, outside every
    run, until no end's is; runs left with fewer than two items are dropped.

    A fused program compiles each of its cells' code anew, so a run ending in a cell that also
    runs as its own call (a rank's last backward, alone for every other microbatch, before its
    gradient reduction) would compile that cell twice: seconds of compile once per process, for
    one call fewer per step (tens of microseconds). Such a cell stays its own call."""
    while True:
        inside = {k for first, end in spans for k in range(first, end)}
        alone = {p for k, p in enumerate(programs) if p is not None and k not in inside}
        out = []
        for first, end in spans:
            while first < end and programs[first] in alone:
                first += 1
            while end > first and programs[end - 1] in alone:
                end -= 1
            if end - first > 1:
                out.append((first, end))
        if out == spans:
            return out
        spans = out


def wiring(
    steps: list, first: int, end: int, kept: set, last_read: dict, made: frozenset = frozenset()
) -> Wiring:
    """The wiring of `steps[first:end]` fused: a slot is an argument where the run reads it before
    writing it, a result where the run writes it and a later step (`last_read[slot]`: the last step
    reading it) or the call (`kept`) reads it; an argument is donated where the cell reading it
    donated it, the call's own arguments (slots no step in `made` writes) listed first: XLA may
    reuse fewer donated buffers than are donated (`_usable`), and those are what the caller sees
    consumed."""
    local: dict = {}
    written: set = set()
    arguments: list = []
    donated: set = set()
    cells = []
    for step in steps[first:end]:
        for j, slot in enumerate(step.ins):
            if slot not in written and slot not in local:
                local[slot] = len(local)
                arguments.append(local[slot])
            if j in step.fn.donate and slot not in written:
                donated.add(arguments.index(local[slot]))
        for slot in step.outs:
            local.setdefault(slot, len(local))
            written.add(slot)
        cells.append((step.fn, tuple(local[s] for s in step.ins), tuple(local[s] for s in step.outs)))
    results = [n for s, n in local.items() if s in written and (s in kept or last_read.get(s, -1) >= end)]
    slots = tuple(local)
    order = sorted(donated, key=lambda k: (slots[arguments[k]] in made, k))
    return Wiring(tuple(cells), tuple(arguments), tuple(results), tuple(order), slots)


def fused_spec(w: Wiring, bodies: dict) -> CellSpec:
    """One program running `w`'s cells in order on its arguments, returning its results. Each cell
    runs as a nested `jax.jit` of its function (`bodies`, one per cell spec, shared by every run of
    the plan), so a cell that runs in many programs is traced once."""
    specs: dict = {}  # local number -> the spec of the argument, or the sharding a cell made it with
    made: dict = {}
    for spec, ins, outs in w.cells:
        for n, in_spec in zip(ins, spec.in_specs):
            specs.setdefault(n, in_spec)
        made.update(zip(outs, spec.out_shardings))
    for spec, *_ in w.cells:
        bodies.setdefault(spec, jax.jit(spec.fn))
    cells = [(bodies[spec], ins, outs) for spec, ins, outs in w.cells]
    arguments, results = w.arguments, w.results

    def run(*flat):
        env = dict(zip(arguments, flat))
        for body, ins, outs in cells:
            values = body(*[env[n] for n in ins])
            env.update((n, _constrained(v, made[n])) for n, v in zip(outs, values))
        return tuple(env[n] for n in results)

    in_specs = tuple(specs[n] for n in arguments)
    out_avals = jax.eval_shape(run, *in_specs)
    donated = _usable(w.donated, in_specs, out_avals)
    return CellSpec(run, in_specs, tuple(made[n] for n in results), donated)


def _usable(donated: tuple, in_specs: tuple, out_avals) -> tuple:
    """The donated arguments (in order of preference) a result of the same shape and type can take
    the place of, sorted (XLA reuses no other: a buffer the run consumes inside is freed after
    it instead)."""
    free: dict = {}
    for aval in out_avals:
        free[aval.shape, aval.dtype] = free.get((aval.shape, aval.dtype), 0) + 1
    usable = []
    for k in donated:
        key = (in_specs[k].shape, in_specs[k].dtype)
        if free.get(key, 0) > 0:
            free[key] -= 1
            usable.append(k)
    return tuple(sorted(usable))


def _constrained(value, sharding):
    """`value` laid out on `sharding` inside the fused program where its cell named a layout over
    several devices (a value the run keeps inside is laid out as the cell alone made it)."""
    if (
        isinstance(sharding, NamedSharding)
        and sharding.mesh.size > 1
        and sharding.memory_kind in (None, "device")
    ):
        return jax.lax.with_sharding_constraint(value, sharding)
    return value


def fuse(steps: list, kept: set, limit: int) -> tuple[list, tuple, set]:
    """`steps` with each run of consecutive cells on the same devices (at most `limit`) one step
    running a fused program (one per distinct wiring); per step of `steps` the index of the new
    step that runs it; and the cell specs that run only fused."""
    last_read: dict = {}
    for k, step in enumerate(steps):
        for slot in step.ins:
            last_read[slot] = k
    made = frozenset(slot for step in steps for slot in step.outs)
    programs: dict = {}
    bodies: dict = {}
    out, issued_of, done = [], [], 0
    for first, end in [*runs(steps, limit), (len(steps), len(steps))]:
        for step in steps[done:first]:
            issued_of.append(len(out))
            out.append(step)
        if first == end:
            break
        w = wiring(steps, first, end, kept, last_read, made)
        if w.key() not in programs:
            programs[w.key()] = fused_spec(w, bodies)
        issued_of.extend([len(out)] * (end - first))
        out.append(
            Step(
                programs[w.key()],
                tuple(w.slots[n] for n in w.arguments),
                tuple(w.slots[n] for n in w.results),
            )
        )
        done = end
    alone = {step.fn for step in out if isinstance(step.fn, CellSpec)}
    only_fused = {step.fn for step in steps if isinstance(step.fn, CellSpec)} - alone
    return out, tuple(issued_of), only_fused


class Deferred:
    """A cell that runs only inside fused programs: compiled when a step-by-step replay (a
    measurement) first calls it or asks what it makes."""

    def __init__(self, compile_spec, spec: CellSpec):
        self._compile, self._spec, self._compiled = compile_spec, spec, None

    def compiled(self):
        if self._compiled is None:
            self._compiled = self._compile(self._spec)
        return self._compiled

    def __call__(self, *args):
        return self.compiled()(*args)

    def __getattr__(self, name: str):
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.compiled(), name)
