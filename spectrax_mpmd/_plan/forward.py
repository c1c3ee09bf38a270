"""The plan of a forward call (`sxjit`), composed from the passes.

Without microbatches: every stage once, in stage order, on the whole batch.
With `microbatches > 1`: the batch arguments are split, each microbatch runs
through the stages in the schedule's forward order (its F actions), and every
output is concatenated back in batch order.
"""

from __future__ import annotations

import jax.numpy as jnp

from .._compile.compiler import CellSpec, Compiler, shape_spec
from .._runtime.plan import Plan
from .._runtime.slots import CellKind, Output
from .._trace.graph import StageGraph
from ..errors import StageSplitError
from .draft import Draft
from .emit import emit_forward
from .layout import Layout, PlanArgs, StageOrder
from .order import order_actions
from .programs import StageProgram, forward_spec, programs_of
from .seal import seal


def build_forward_plan(graph: StageGraph, schedule, mesh, args: PlanArgs, compiler: Compiler) -> Plan:
    """Layout -> stage programs -> each forward's steps in issue order -> outputs in batch order
    -> localize and seal."""
    layout = Layout.of(
        graph, schedule or StageOrder(), mesh, args, schedule.microbatches if args.batch else 1
    )
    programs = programs_of(layout, args, layout.m, remat=False)
    draft = Draft()
    results: dict = {}
    for rank, s, i in _forward_order(layout):
        donate = _donatable(programs, s, args.donated) if layout.m == 1 else ()
        cell = forward_spec(layout, programs[s], s, residuals=False, donate=donate)
        start = len(draft.steps)
        made = emit_forward(draft, layout, programs[s], cell, s, i, 0)
        results.update(((j, i), slot) for j, slot in zip(programs[s].io.stage.results, made))
        draft.record(rank, (CellKind.FORWARD, s, i), start, CellKind.FORWARD)
    draft.outputs = {
        Output.RESULTS: [
            _batch_order(draft, layout, j, [results[j, i] for i in range(layout.m)])
            for j in range(len(graph.out_avals))
        ]
    }
    return seal(draft, layout, compiler, layout.schedule)


def _forward_order(layout: Layout) -> list[tuple[int, int, int]]:
    """`(rank, stage, microbatch)` of every forward, in issue order."""
    if layout.m == 1:
        return [(layout.ranks[s], s, 0) for s in range(len(layout.graph.stages))]
    return [
        (rank, p.stage, p.microbatch)
        for rank, action in order_actions(layout.schedule, layout.n, layout.graph)
        for p in action.parts
        if p.kind == CellKind.FORWARD
    ]


def _donatable(programs: list[StageProgram], s: int, donated: frozenset) -> tuple[int, ...]:
    """Input positions of stage `s` that may be donated: donated leaves read by this stage only."""
    readers: dict[int, int] = {}
    for p in programs:
        for a in p.io.fixed:
            readers[a] = readers.get(a, 0) + 1
    return tuple(k for k, a in enumerate(programs[s].io.fixed) if a in donated and readers[a] == 1)


def _batch_order(draft: Draft, layout: Layout, j: int, slots: list[int]) -> int:
    """Output `j` of every microbatch, concatenated along the leading (batch) axis."""
    if len(slots) == 1:
        return slots[0]
    aval = layout.graph.out_avals[j]
    if not aval.shape:
        raise StageSplitError(
            f"a forward over {layout.m} microbatches returns its outputs in batch order, so each "
            f"output needs a leading batch axis; output {j} is a scalar ({aval.str_short()}). "
            "Return per-example values, or run without microbatches."
        )
    sh = layout.named(layout.graph.result_stage[j], None)
    out = draft.new()
    draft.add(CellSpec(_concat, (shape_spec(aval, sh),) * layout.m, (sh,)), slots, [out])
    return out


def _concat(*xs):
    return (jnp.concatenate(xs, axis=0),)
