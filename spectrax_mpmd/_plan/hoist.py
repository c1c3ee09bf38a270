"""Issue the steps after the schedule as early as their inputs allow.

The gradient reduction and an epilogue (an optimizer update) are appended after
every schedule action, but most of them read one rank's values only: rank 3's
update needs rank 3's last backward, not rank 0's. `hoist` moves each such step
up to just after the action that makes the last of its inputs (and, for an input
it donates, after the last step that reads it), never inside an action, keeping
the order of the moved steps among themselves. Every process of a job builds the
same draft, so every process moves the same steps the same way.
"""

from __future__ import annotations

import bisect

from .._compile.compiler import CellSpec
from .draft import Draft


def hoist(draft: Draft, start: int) -> Draft:
    """`draft` with the steps from `start` on moved up to the earliest action boundary their
    inputs allow."""
    head, tail = draft.steps[:start], draft.steps[start:]
    if not tail or not draft.action_steps:
        return draft
    boundaries = sorted({end for *_, end in draft.action_steps if end <= start} | {0, start})
    written: dict = {}
    accessed: dict = {}
    for k, step in enumerate(head):
        for slot in step.outs:
            written[slot] = k
        for slot in (*step.ins, *step.outs):
            accessed[slot] = k
    placed: list[tuple[int, int]] = []  # (boundary, order) of each tail step
    made_at: dict = {}  # slot -> boundary of the tail step making it
    read_at: dict = {}  # slot -> latest boundary of a tail step reading it
    for order, step in enumerate(tail):
        donated = [
            slot for j, slot in enumerate(step.ins) if isinstance(step.fn, CellSpec) and j in step.fn.donate
        ]
        needs = [written.get(slot, -1) for slot in step.ins] + [accessed.get(slot, -1) for slot in donated]
        boundary = boundaries[bisect.bisect_left(boundaries, max(needs, default=-1) + 1)]
        boundary = max(
            [boundary, *(made_at.get(s, 0) for s in step.ins), *(read_at.get(s, 0) for s in donated)]
        )
        placed.append((boundary, order))
        for slot in step.outs:
            made_at[slot] = boundary
        for slot in step.ins:
            read_at[slot] = max(read_at.get(slot, 0), boundary)
    moved = sorted(range(len(tail)), key=lambda j: placed[j])
    return draft.inserting({b: [tail[j] for j in moved if placed[j][0] == b] for b, _ in placed}, start)
