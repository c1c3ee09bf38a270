"""Issue a plan's transfers together: each waits for the first step that needs it, then goes out
with every other transfer waiting then, as one call.

A plan emits a transfer right after the cell that makes its value, so the host
issues one call per moved value (a 4-rank step of 8 microbatches moves 48 values;
with two virtual stages per rank, 112). A transfer may wait until a later step
reads what it moves, or reads, writes or releases what it reads: nothing between
can see the difference. Waiting ones meet, and the movers of `spectrax_mpmd._comm`
take any number of buffers, each with its own source and target, in one call (a
single C++ call for per-shard copies).

A transfer waits past at most `within` compiled calls (the plan passes its number
of ranks: about one round of the schedule's cells), so a value is never held back
for long: in JAX's asynchronous dispatch the delay is a few calls of host time,
which matters only when the host, not the devices, is behind, and that is when
fewer calls help. Moves between memory kinds (an offload to host memory and its
reload) keep their place: their point is to free device memory when they run.
Only movers within this process are batched; a cross-process transfer (its own
kind of step) stays where it is, and a batch never waits past one that reads its
values.
"""

from __future__ import annotations

from .._comm import is_transfer, transfer
from .._runtime.plan import Step


def batched_moves(steps: list, issued_of: tuple, within: int) -> tuple[list, tuple]:
    """`steps` with transfers batched, none waiting past more than `within` compiled calls
    (module docstring), and `issued_of` (per original plan step, the index of the step of
    `steps` that runs it; empty: `steps` are the plan's steps) mapped onto the new steps."""
    out: list = []
    moved_to: list = [None] * len(steps)  # index in `steps` -> index in `out`
    waiting: list = []  # (index in `steps`, step) of transfers not issued yet
    passed = 0  # compiled calls issued since the oldest waiting transfer's own place

    def issue() -> None:
        if not waiting:
            return
        for k, _ in waiting:
            moved_to[k] = len(out)
        out.append(_together([step for _, step in waiting]))
        waiting.clear()

    for k, step in enumerate(steps):
        touched = {*step.ins, *step.outs, *step.frees}
        if any(touched.intersection((*w.ins, *w.outs)) for _, w in waiting):
            issue()
        if _batchable(step):
            passed = passed if waiting else 0
            waiting.append((k, step))
            continue
        if passed >= within:
            issue()
        moved_to[k] = len(out)
        out.append(step)
        passed += not is_transfer(step.fn)
    issue()
    mapped = tuple(moved_to[k] for k in (issued_of or range(len(steps))))
    return out, mapped


def _batchable(step: Step) -> bool:
    """Whether `step` is a move within this process between device memories."""
    fn = step.fn
    if not is_transfer(fn) or step.frees or fn.sources is None:
        return False
    return all(s.memory_kind in (None, "device") for s in (*fn.sources, *fn.targets))


def _together(moves: list) -> Step:
    """One step making every move of `moves` (alone: the move itself)."""
    if len(moves) == 1:
        return moves[0]
    sources = [s for move in moves for s in move.fn.sources]
    targets = [t for move in moves for t in move.fn.targets]
    return Step(
        transfer(sources, targets),
        tuple(slot for move in moves for slot in move.ins),
        tuple(slot for move in moves for slot in move.outs),
    )
