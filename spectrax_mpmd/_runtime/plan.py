"""The compiled plan of one call signature, and the function that runs it.

A plan is a flat list of steps `(callable, input slots, output slots, slots to
free)` over a list of buffers. Everything else — pytree work, sharding
decisions, compilation, dependency order — was done once by the plan passes
(`spectrax_mpmd._plan`); running calls the steps in order on flat argument lists, written out
once as straight-line code (`straight`).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

from spectrax_core.schedules import Schedule

from .._comm import is_transfer
from .._env import configured_run_ahead
from ..errors import MpmdError
from .run_ahead import Gates, gates
from .slots import InputKind, LossAccumulator, Output
from .straight import straight_line


class Step(NamedTuple):
    """One plan step: `fn(*buf[ins])` fills `buf[outs]`, then `buf[frees]` are released."""

    fn: Any
    ins: tuple
    outs: tuple
    frees: tuple = ()


@dataclass(frozen=True)
class Plan:
    """A compiled, ordered program for one call signature; immutable once sealed.

    `steps` run in order; `input_keys` are `(slot, Input(kind, leaf, rank))` of the
    argument leaves placed on each rank and `input_shardings` their shardings;
    `output_slots` name the slots holding the call's results. `issued` are the steps
    `run` issues where they differ from `steps`: runs of cells fused into one program
    each (`spectrax_mpmd._plan.fusion`); `steps` stay cell by cell for the
    measurements that replay them. The rest describes the steps for measurement
    and inspection: `log` / `action_steps` map each
    issued schedule action to its steps, `cells` the cell specs by
    `(stage, kind)`, `slot_names` each slot's typed key.
    """

    steps: list = field(default_factory=list)
    issued: list = field(default_factory=list)  # the steps `run` issues (empty: `steps`)
    issued_of: tuple = ()  # per step, the issued step that runs it (empty: itself)
    issued_specs: tuple = ()  # per step `run` issues, the CellSpec of its program (None: a copy)
    log: list = field(default_factory=list)  # (rank, action, cell label) in issue order
    n_slots: int = 0
    const_slots: dict = field(default_factory=dict)
    input_keys: list = field(default_factory=list)
    input_shardings: list = field(default_factory=list)
    output_slots: dict = field(default_factory=dict)
    stage_ranks: tuple = ()
    cells: dict = field(default_factory=dict)
    activation_slots: dict = field(default_factory=dict)  # slot -> (rank, stage, microbatch)
    forward_steps: dict = field(default_factory=dict)  # step -> [(stage, microbatch)] it starts
    action_steps: list = field(default_factory=list)  # (rank, action, first step, end step)
    device_rank: dict = field(default_factory=dict)  # device -> pipeline rank
    graph: object = None  # the StageGraph the plan runs
    saved: dict = field(default_factory=dict)  # (stage, kind) -> trailing outputs kept per microbatch
    ran: frozenset = frozenset()  # the (stage, kind) cells the plan runs, alone or fused
    schedule: Schedule | None = None  # the schedule it runs (regions merged into one)
    slot_names: dict = field(default_factory=dict)  # slot -> its typed key (last alias wins)
    # multi-process only: the cross-process transport, the ranks this process runs (None: all),
    # and (slot, global array without local shards) of outputs held elsewhere
    transport: object = None
    local_ranks: frozenset | None = None
    remote_outputs: list = field(default_factory=list)
    # the most cells a rank may have issued ahead of its oldest unfinished one (None: no bound;
    # see `run_ahead`), and per rank the most it had outstanding in the last run
    run_ahead: int | None = field(default_factory=configured_run_ahead)
    outstanding: list = field(default_factory=list)

    def buffers(self, placed_inputs: Sequence) -> list:
        """A fresh buffer list holding the constants and `placed_inputs` (aligned with `input_keys`)."""
        buf = self._constants_only.copy()
        for slot, value in zip(self._input_slots, placed_inputs):
            buf[slot] = value
        return buf

    @functools.cached_property
    def _constants_only(self) -> list:
        """The buffer list with the constants in place (copied by every call)."""
        buf: list = [None] * self.n_slots
        for slot, value in self.const_slots.items():
            buf[slot] = value
        return buf

    @functools.cached_property
    def _input_slots(self) -> tuple:
        return tuple(slot for slot, _ in self.input_keys)

    def run(self, placed_inputs: Sequence) -> list:
        """Run every step; `placed_inputs` are aligned with `input_keys`. Returns the buffers."""
        if self.transport is not None:
            self.transport.begin()
        buf = self._run_steps(placed_inputs)
        if self.transport is not None:
            self.transport.end()  # waits for this call's cross-process receives, up to the timeout
            for slot, value in self.remote_outputs:
                buf[slot] = value
        return buf

    @functools.cached_property
    def _run_steps(self):
        """The issued steps as one straight-line function (`straight`), with the run-ahead bound
        where it applies (one process, see `run_ahead`)."""
        bounded = self.run_ahead is not None and self.transport is None
        bound = (self.run_ahead, self.gates, self.outstanding) if bounded else None
        return straight_line(self.hot_steps, self.n_slots, self._input_slots, self.const_slots, bound)

    def accumulator_starts(self) -> list:
        """`(slot, value)` of what the step's accumulators start from: each output of the rank
        setup programs issued before the first action (its `out_info`), and each loss
        accumulator's zero, a constant."""
        first = min((a for _, _, a, _ in self.action_steps), default=len(self.steps))
        made = [
            (slot, info)
            for fn, ins, outs, _ in self.steps[:first]
            if not ins and hasattr(fn, "out_info")
            for slot, info in zip(outs, fn.out_info)
        ]
        loss = [(s, v) for s, v in self.const_slots.items() if isinstance(self.slot_names.get(s), LossAccumulator)]
        return made + loss

    @property
    def hot_steps(self) -> list:
        """The steps `run` issues: the fused ones where there are, else `steps`."""
        return self.issued or self.steps

    @functools.cached_property
    def gates(self) -> Gates:
        """Where each rank's cells start and end among the steps (for the run-ahead bound)."""
        return gates(self)

    def check_single_process(self, what: str) -> None:
        """Refuse a diagnostic that walks the steps itself: in a multi-process plan the steps are
        this process's share, and their transfers pair up only inside `run`."""
        if self.transport is not None:
            raise MpmdError(
                f"{what} runs the plan step by step in one process; in a multi-process run it is not "
                "available. Profile the same model in one process (a mesh over local devices)."
            )

    def with_public_transfers(self) -> "Plan":
        """This plan with every transfer through the public `jax.device_put` (for checking the
        fast path: both must give the same values on the same shardings)."""

        def public(steps):
            return [Step(fn.public() if is_transfer(fn) else fn, *rest) for fn, *rest in steps]

        return dataclasses.replace(self, steps=public(self.steps), issued=public(self.issued))

    def produced_shardings(self) -> dict:
        """`slot -> sharding` of every buffer an issued step or a constant fills (a value a fused
        program keeps inside is not among them)."""
        produced = {slot: value.sharding for slot, value in self.const_slots.items()}
        for fn, _, outs, _ in self.hot_steps:
            shardings = fn.targets if is_transfer(fn) else getattr(fn, "output_shardings", None)
            if shardings is not None:
                produced.update(zip(outs, shardings))
        return produced

    def grad_shardings(self, n_leaves: int) -> dict:
        """`leaf -> sharding` of each parameter leaf's gradient in a training plan (where the step
        keeps that leaf): the sharding its gradient is made with (in a multi-process run, for a leaf
        of another process's rank, the sharding of its global array here), else its first reader's."""
        produced = self.produced_shardings()
        produced.update((slot, value.sharding) for slot, value in self.remote_outputs)
        readers: dict = {}
        for (_, key), sharding in zip(self.input_keys, self.input_shardings):
            if key.kind == InputKind.PARAM:
                readers.setdefault(key.leaf, sharding)
        grads = self.output_slots[Output.GRADS]
        out = {}
        for a in range(n_leaves):
            sharding = produced.get(grads.get(a), readers.get(a))
            if sharding is not None:
                out[a] = sharding
        return out
