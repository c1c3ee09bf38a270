"""What each cell waits for (`Flow`), and the one walk that issues a table in that order.

The dependency rule, shared by the simulator, the memory model, the region merge and
the MPMD runtime: the F of stage s waits for the F of every stage it reads (its stage
inputs); a B or I of s waits for its own F and for the B or I of every stage whose input
gradient it reads (its gradient inputs); a W waits for its own I. All on the same
microbatch. A fused cell waits for everything each of its parts waits for.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Iterable, NamedTuple, Sequence

from ._actions import Action, Cell, ScheduleError

_MEANING = {"F": "the forward", "G": "the input gradient", "W": "the weight gradient"}


class Dependency(NamedTuple):
    """Something a cell can wait for: `kind` `"F"` (the forward of `stage` on `microbatch`
    was issued), `"G"` (its input gradient: its B or I) or `"W"` (its weight gradient)."""

    kind: str
    stage: int
    microbatch: int

    def __str__(self) -> str:
        return f"{_MEANING[self.kind]} of stage {self.stage}, microbatch {self.microbatch}"


@dataclass(frozen=True)
class Flow:
    """Per logical stage, the stages whose forward output it reads (`inputs`) and the
    stages whose input gradient its backward reads (`gradient_inputs`).

    Entries are normalised to sorted tuples without repeats. `Flow.chain(S)` is a plain
    pipeline (stage s reads s − 1; also for a V layout, whose logical stages still form
    the chain 0..S−1); `Flow.from_edges` builds a graph with skip connections and edges
    that carry no gradient.
    """

    inputs: tuple[tuple[int, ...], ...]
    gradient_inputs: tuple[tuple[int, ...], ...]
    _reads: dict = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        stages = len(self.inputs)
        if len(self.gradient_inputs) != stages:
            raise ScheduleError(
                f"Flow: inputs has {stages} stage(s) but gradient_inputs has {len(self.gradient_inputs)}; "
                "give one entry per stage in both."
            )
        for name in ("inputs", "gradient_inputs"):
            table = getattr(self, name)
            for s, reads in enumerate(table):
                for t in reads:
                    if not _is_stage(t, stages) or t == s:
                        raise ScheduleError(
                            f"Flow: {name}[{s}] names stage {t!r}; it must be another stage in "
                            f"0..{stages - 1}."
                        )
            object.__setattr__(self, name, tuple(tuple(sorted(set(reads))) for reads in table))
        # per action kind and stage, the (kind, stage) of each dependency, in `needs` order
        backward = tuple(
            (("F", s),) + tuple(("G", c) for c in readers) for s, readers in enumerate(self.gradient_inputs)
        )
        reads = {
            "F": tuple(tuple(("F", p) for p in producers) for producers in self.inputs),
            "B": backward,
            "I": backward,
            "W": tuple((("G", s),) for s in range(stages)),
        }
        object.__setattr__(self, "_reads", reads)

    @classmethod
    def chain(cls, stages: int) -> Flow:
        """`stages` stages in a line: stage s reads s − 1, and its backward waits for s + 1."""
        _check_stages("Flow.chain", stages)
        return cls(
            tuple((s - 1,) if s else () for s in range(stages)),
            tuple((s + 1,) if s < stages - 1 else () for s in range(stages)),
        )

    @classmethod
    def from_edges(
        cls,
        stages: int,
        edges: Iterable[tuple[int, int]],
        gradient_edges: Iterable[tuple[int, int]] | None = None,
    ) -> Flow:
        """`edges` are `(source, destination)` stage pairs whose forward output the destination
        reads; `gradient_edges` those of them whose destination sends a gradient back to the
        source (default: all of `edges`)."""
        _check_stages("Flow.from_edges", stages)
        edges = tuple(edges)
        gradient_edges = edges if gradient_edges is None else tuple(gradient_edges)
        inputs: list[list[int]] = [[] for _ in range(stages)]
        gradient_inputs: list[list[int]] = [[] for _ in range(stages)]
        for name, pairs, by_dst, out in (
            ("edges", edges, True, inputs),
            ("gradient_edges", gradient_edges, False, gradient_inputs),
        ):
            for pair in pairs:
                src, dst = _edge(name, pair, stages)
                out[dst if by_dst else src].append(src if by_dst else dst)
        return cls(tuple(map(tuple, inputs)), tuple(map(tuple, gradient_inputs)))

    @property
    def stages(self) -> int:
        return len(self.inputs)

    @property
    def is_chain(self) -> bool:
        return self == Flow.chain(self.stages)

    def needs(self, action: Action) -> tuple[Dependency, ...]:
        """What `action` waits for, in a fixed order (the forward it reads first)."""
        return tuple(Dependency(*d) for d in self._needs(action))

    @staticmethod
    def makes(action: Action) -> Dependency:
        """What issuing `action` provides (a B and an I both provide the input gradient)."""
        return tuple.__new__(Dependency, _made(action))  # as Dependency(*...), without its slower __new__

    def _needs(self, action: Action) -> tuple[tuple[str, int, int], ...]:
        """`needs` as plain tuples, which equal and hash as the `Dependency`s (the walk's hot path)."""
        mb = action.microbatch
        return tuple([(kind, s, mb) for kind, s in self._reads[action.kind][action.stage]])


def _made(action: Action) -> tuple[str, int, int]:
    """`Flow.makes` as a plain tuple."""
    return ("G" if action.kind in ("B", "I") else action.kind, action.stage, action.microbatch)


def _check_stages(owner: str, stages) -> None:
    if isinstance(stages, bool) or not isinstance(stages, int) or stages < 0:
        raise ScheduleError(
            f"{owner}: stages must be a non-negative int (the number of stages), received {stages!r}."
        )


def _edge(name: str, raw, stages: int) -> tuple[int, int]:
    pair = tuple(raw) if isinstance(raw, (tuple, list)) else ()
    if len(pair) != 2 or not all(_is_stage(x, stages) for x in pair) or pair[0] == pair[1]:
        raise ScheduleError(
            f"Flow.from_edges: {name} holds {raw!r}; each edge is a (source, destination) pair of two "
            f"different stages in 0..{stages - 1}."
        )
    return pair


def _is_stage(x, stages: int) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < stages


@dataclass(frozen=True)
class Stuck:
    """A queue of a stalled walk: on `rank`, having issued `index` cells, its next `cell`
    waits for `waits_for`."""

    queue: int
    rank: int
    index: int
    cell: Cell
    waits_for: Dependency

    def __str__(self) -> str:
        return f"rank {self.rank} at cell {self.index} ({self.cell!r}) waits for {self.waits_for}"


class DeadlockError(ScheduleError):
    """A table stalls: every queue with cells left waits for something no issued cell provides.

    `stuck` names each such queue's next cell and what it waits for.
    """

    def __init__(self, message: str, stuck: tuple[Stuck, ...] = ()):
        super().__init__(message)
        self.stuck = tuple(stuck)


Queues = tuple[tuple[Cell, ...], ...]
Unblock = Callable[[Queues, Callable[[Action], bool]], Sequence[Sequence[Cell]] | None]


def issue_order(
    queues: Sequence[Sequence[Cell]],
    flow: Flow,
    *,
    ranks: Sequence[int] | None = None,
    unblock: Unblock | None = None,
) -> list[tuple[int, Cell]]:
    """Every cell of `queues` once, as `(rank, cell)` in the order one thread issues them.

    Round-robin over the queues (queue q runs on `ranks[q]`; default: rank q), one cell per
    queue per round, keeping each queue's order; a cell waits until everything it needs
    (`flow.needs` of each part) has been issued. When every queue waits, `unblock(left,
    ready)` may reorder the cells left (`left[q]`: queue q's, from its next one; `ready`
    says whether an action could be issued now) and return the new queues, one per queue,
    with a ready cell in front of one of them; returning None (or no `unblock`) raises
    `DeadlockError` naming each stuck queue's next cell.
    """
    return [(rank, cell) for rank, cell, _ in walk(queues, flow, ranks=ranks, unblock=unblock)]


def walk(
    queues: Sequence[Sequence[Cell]],
    flow: Flow,
    *,
    ranks: Sequence[int] | None = None,
    unblock: Unblock | None = None,
) -> list[tuple[int, Cell, tuple[tuple[str, int, int], ...]]]:
    """`issue_order` with what each cell waited for: `(rank, cell, needs)`, `needs` the needs
    of its parts in order as plain `(kind, stage, microbatch)` tuples (equal to the
    `Dependency`s). The simulator times each cell by them."""
    pending = [deque(q) for q in queues]
    ranks = tuple(range(len(pending))) if ranks is None else tuple(ranks)
    if len(ranks) != len(pending):
        raise ScheduleError(f"issue_order: ranks has {len(ranks)} entries for {len(pending)} queues.")
    _check_stages_in(pending, flow)
    done: set[tuple[str, int, int]] = set()
    issued: list[tuple[int, Cell, tuple]] = []

    def ready(action: Action) -> bool:
        return _missing(flow._needs(action), done) is None

    while True:
        issued += _drain(pending, flow, done)
        if not any(pending):
            return [(ranks[q], cell, needs) for q, cell, needs in issued]
        left = tuple(tuple(row) for row in pending)
        replaced = None if unblock is None else unblock(left, ready)
        if replaced is None:
            counts = [0] * len(left)
            for q, _, _ in issued:
                counts[q] += 1
            stuck = tuple(
                Stuck(q, ranks[q], counts[q], row[0], Dependency(*_missing(_cell_needs(flow, row[0]), done)))
                for q, row in enumerate(left)
                if row
            )
            raise DeadlockError(
                f"the table deadlocks: {'; '.join(map(str, stuck))}. Reorder the rows so every input "
                "is produced before it is needed.",
                stuck,
            )
        pending = [deque(row) for row in replaced]
        _check_stages_in(pending, flow)
        movable = any(row and _missing(_cell_needs(flow, row[0]), done) is None for row in pending)
        if len(pending) != len(left) or not movable:
            raise ScheduleError(
                "issue_order: unblock must return one queue per queue given, with a cell that can be "
                "issued now in front of one of them (or None when nothing can move)."
            )


def _check_stages_in(pending: list[deque], flow: Flow) -> None:
    for q, row in enumerate(pending):
        for cell in row:
            if any(a.stage >= flow.stages for a in cell.parts):
                raise ScheduleError(
                    f"issue_order: queue {q} holds {cell!r}, but the flow has {flow.stages} stage(s)."
                )


def _drain(pending: list[deque], flow: Flow, done: set) -> list[tuple[int, Cell, tuple]]:
    """Issue round by round until every queue is empty or waits: `(queue, cell, needs)` in order.

    A waiting queue is set aside until what it waits for is issued: woken by a queue
    before it in the round, it still gets its turn in this round, otherwise in the next;
    so each cell is looked at once per wake, and the order is the plain round-robin's.
    """
    issued = []
    waiting: dict[tuple, list[int]] = {}
    current = [q for q, row in enumerate(pending) if row]
    while current:
        later: list[int] = []
        while current:
            q = heapq.heappop(current)
            cell = pending[q][0]
            needs = _cell_needs(flow, cell)
            need = _missing(needs, done)
            if need is not None:
                waiting.setdefault(need, []).append(q)
                continue
            pending[q].popleft()
            issued.append((q, cell, needs))
            for a in cell.parts:
                made = _made(a)
                done.add(made)
                for w in waiting.pop(made, ()):
                    if w > q:
                        heapq.heappush(current, w)
                    else:
                        later.append(w)
            if pending[q]:
                later.append(q)
        current = sorted(later)
    return issued


def _cell_needs(flow: Flow, cell: Cell) -> tuple:
    """What `cell` waits for (plain tuples): what each of its parts waits for."""
    parts = cell.parts
    if len(parts) == 1:
        return flow._needs(parts[0])
    return tuple(d for a in parts for d in flow._needs(a))


def _missing(needs: tuple, done: set) -> tuple | None:
    """The first of `needs` that is not done (None: all are)."""
    for d in needs:
        if d not in done:
            return d
    return None
