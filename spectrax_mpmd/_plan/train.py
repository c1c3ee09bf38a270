"""The plan of one training step (`sxvalue_and_grad`), composed from the passes."""

from __future__ import annotations

from .._compile.compiler import Compiler
from .._runtime.plan import Plan
from .._runtime.slots import CellKind
from .._trace.graph import StageGraph
from ..errors import StageSplitError
from .draft import Draft
from .emit import emit_action
from .epilogue import emit_epilogue
from .gradients import accumulator_cells, reduce_gradients
from .hoist import hoist
from .layout import Layout, PlanArgs
from .order import order_actions
from .programs import StageProgram, backward_specs, forward_spec, programs_of, with_loss_spec
from .seal import describe_training, seal


def build_train_plan(graph: StageGraph, schedule, mesh, args: PlanArgs, compiler: Compiler) -> Plan:
    """Layout -> stage programs -> each action's steps in issue order -> gradient reduction ->
    the epilogue on the gradients, if any -> those issued as early as their inputs allow ->
    localize and seal."""
    check_loss_stage(graph)
    layout = Layout.of(graph, schedule, mesh, args, schedule.microbatches)
    draft = Draft()
    programs = programs_of(layout, args, layout.m, args.remat)
    setup = accumulator_cells(draft, layout, programs, args)
    programs = stage_programs(layout, programs, [spec for spec, _ in setup], compiler)
    for spec, outs in setup:
        draft.add(spec, (), outs)
    for rank, action in order_actions(schedule, layout.n, layout.graph):
        emit_action(draft, layout, programs, rank, action)
    return finish_training(draft, layout, programs, args, compiler)


def finish_training(draft: Draft, layout: Layout, programs: list, args: PlanArgs, compiler: Compiler) -> Plan:
    """After the schedule's actions: gradient reduction -> the epilogue on the gradients, if any
    -> those issued as early as their inputs allow -> localize and seal."""
    tail = len(draft.steps)
    draft.outputs = reduce_gradients(draft, layout, programs, args)
    if args.epilogue is not None:
        draft.outputs = emit_epilogue(draft, layout, args.epilogue, draft.outputs)
    draft = hoist(draft, tail)
    numbering = args.epilogue.function_leaves if args.epilogue is not None else None
    schedule, described = layout.schedule, describe_training(draft, layout, programs)
    return seal(draft, layout, compiler, schedule, numbering, **described)


def stage_programs(
    layout: Layout, programs: list[StageProgram], setup: list, compiler: Compiler
) -> list[StageProgram]:
    """Every stage's program with its cell specs. When some output shardings are only known once
    compiled (a sharded submesh), the programs that need no other program's output are compiled
    together first."""
    losses = {s: with_loss_spec(layout, programs[s], s) for s in layout.loss_stages}
    inner = [s for s in range(len(programs)) if not layout.is_loss(s)]
    if not all(layout.free(s) is not None for s in range(len(programs))):
        forwards = [
            forward_spec(layout, programs[s], s, residuals=not programs[s].cells.remat) for s in inner
        ]
        compiler.prefetch([*forwards, *setup, *(p.specs[CellKind.LOSS] for p in losses.values())])
    splits = layout.splits()
    return [
        losses[s] if s in losses else backward_specs(layout, p, s, compiler, splits)
        for s, p in enumerate(programs)
    ]


def check_loss_stage(graph: StageGraph) -> None:
    last = len(graph.stages) - 1
    if 0 not in graph.stages[last].results:
        raise StageSplitError(
            "the loss (the function's first output) must be computed in the last stage; it is "
            f"computed in stage {graph.result_stage[0]}. Move the loss after the last sxstage_iter."
        )
