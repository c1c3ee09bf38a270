"""The issue order of one step: every rank's actions merged into one dependency-respecting sequence."""

from __future__ import annotations

from typing import Any

from .._trace.split import StageGraph
from ..errors import StageSplitError


def order_actions(schedule, n: int, graph: StageGraph) -> list[tuple[int, Any]]:
    """Merge the per-rank action lists into one issue order that respects data dependencies.

    Round-robin over ranks, one action at a time, keeping each rank's own order;
    an action waits until everything it reads has been issued.
    """
    table = schedule.actions(n)
    senders: dict[int, set[int]] = {s: set() for s in range(len(graph.stages))}
    receivers: dict[int, set[int]] = {s: set() for s in range(len(graph.stages))}
    for e in graph.edges:
        senders[e.dst].add(e.src)
        if e.differentiable:
            receivers[e.src].add(e.dst)
    done: set = set()

    def ready(a) -> bool:
        if a.kind == "F&B":
            return all(ready(p) for p in a.parts)
        s, i = a.stage, a.microbatch
        if a.kind == "F":
            return all(("F", p, i) in done for p in senders[s])
        if a.kind in ("B", "I"):
            return ("F", s, i) in done and all(
                ("B", t, i) in done or ("I", t, i) in done for t in receivers[s]
            )
        return ("I", s, i) in done

    def mark(a) -> None:
        for p in a.parts if a.kind == "F&B" else (a,):
            done.add((p.kind, p.stage, p.microbatch))

    pos = [0] * n
    order = []
    remaining = sum(len(t) for t in table)
    while remaining:
        progressed = False
        for r in range(n):
            if pos[r] < len(table[r]) and ready(table[r][pos[r]]):
                a = table[r][pos[r]]
                mark(a)
                order.append((r, a))
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: str(table[r][pos[r]]) for r in range(n) if pos[r] < len(table[r])}
            raise StageSplitError(
                f"schedule {schedule!r} cannot run this pipeline: no rank can proceed "
                f"(next actions {stuck}); the stage graph's dependencies conflict with the table."
            )
    return order
