"""A plan under construction: named slots and steps in issue order.

The emitting passes append to one `Draft` (slots, steps, what each action
became); a pass that rearranges steps (`hoist`) returns a new draft whose records
of step positions follow their steps; `seal` turns it into a runnable `Plan`.
Nothing outside `_plan/` touches a draft.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .._compile.compiler import CellSpec
from .._runtime.plan import Step


@dataclass
class Draft:
    """Slots by typed key, steps (cell specs not compiled yet, or transfers), and what each
    issued action became."""

    count: int = 0
    named: dict = field(default_factory=dict)  # typed key -> slot
    steps: list = field(default_factory=list)
    constants: dict = field(default_factory=dict)  # slot -> (host value, sharding), placed when sealed
    log: list = field(default_factory=list)  # (rank, action, cell label)
    action_steps: list = field(default_factory=list)  # (rank, action, first step, end step)
    forward_steps: dict = field(default_factory=dict)  # step -> [(stage, microbatch)] it starts
    fused: dict = field(default_factory=dict)  # tuple of cell specs -> their fused spec
    outputs: dict = field(default_factory=dict)  # what the call returns, as slots
    input_specs: dict = field(default_factory=dict)  # Input key -> PartitionSpec, where not a param's
    # multi-process only (`localize`): the transport, the ranks this process runs (None: all),
    # (slot, global array without local shards) of outputs held by other processes, and the Input
    # keys a receive from another process fills (the call does not place them)
    transport: object = None
    local_ranks: frozenset | None = None
    remote_outputs: list = field(default_factory=list)
    received: set = field(default_factory=set)

    def new(self) -> int:
        """A fresh unnamed slot."""
        self.count += 1
        return self.count - 1

    def slot(self, key) -> int:
        """The slot named `key` (allocated on first use)."""
        if key not in self.named:
            self.named[key] = self.new()
        return self.named[key]

    def alias(self, key, slot: int) -> None:
        """Name an existing slot `key` as well (a move that needs no copy)."""
        self.named[key] = slot

    def add(self, fn, ins, outs) -> None:
        self.steps.append(Step(fn, tuple(ins), tuple(outs)))

    def record(self, rank: int, action, start: int, label: str) -> None:
        """Note that `action`, issued on `rank`, became the steps from `start` on."""
        self.log.append((rank, action, label))
        self.action_steps.append((rank, action, start, len(self.steps)))

    def fuse_since(self, start: int) -> None:
        """Merge the cell steps added since `start` into one executable; transfers that move what
        the cells made follow it, those that bring what they read (a reload from host memory)
        precede it."""
        new = self.steps[start:]
        cells = [st for st in new if isinstance(st.fn, CellSpec)]
        if len(cells) < 2:
            return
        parts = tuple(st.fn for st in cells)
        if parts not in self.fused:  # one fused spec per combination of cells, reused per microbatch
            spec = parts[0]
            for other in parts[1:]:
                spec = spec.fuse(other)
            self.fused[parts] = spec
        ins = [i for st in cells for i in st.ins]
        outs = [o for st in cells for o in st.outs]
        rest = [st for st in new if not isinstance(st.fn, CellSpec)]
        made = set(outs)
        before = [st for st in rest if not made.intersection(st.ins)]
        after = [st for st in rest if made.intersection(st.ins)]
        self.steps[start:] = [*before, Step(self.fused[parts], tuple(ins), tuple(outs)), *after]

    def inserting(self, inserted: dict[int, list], start: int) -> Draft:
        """This draft's first `start` steps with the steps `inserted[k]` placed before step `k`
        (`k == start`: after the last), the steps from `start` on dropped (they are among the
        inserted ones): a new draft whose records of step positions follow their steps."""
        steps, shift = [], {}
        for k in range(start + 1):
            steps.extend(inserted.get(k, ()))
            shift[k] = len(steps) - k
            if k < start:
                steps.append(self.steps[k])
        return dataclasses.replace(
            self,
            steps=steps,
            action_steps=[
                (rank, action, first + shift[first], end + shift[first])
                for rank, action, first, end in self.action_steps
            ],
            forward_steps={k + shift[k]: v for k, v in self.forward_steps.items()},
        )
