"""The plan of one training step whose microbatches have different lengths (`LengthBuckets`).

Each bucket's loss is traced and split on its own (`spectrax_mpmd._api.bucketed`): one stage graph
per bucket, all with the same stages, parameters and edges, differing in shapes. The plan lays out
every bucket like a step of its own, then emits the one schedule's actions, each part with the
programs of its microbatch's bucket: one compiled program per (stage, cell kind, bucket), the
accumulators, gradient reduction and loss shared. Microbatch `i` reads batch leaves of its own
(already at its bucket's length), numbered after the call's leaves (`BucketLayout.batch_leaf`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from .._compile.compiler import Compiler
from .._runtime.plan import Plan
from .._trace.graph import StageGraph
from .draft import Draft
from .emit import emit_action
from .gradients import accumulator_cells
from .layout import Layout, PlanArgs
from .order import order_actions
from .programs import programs_of
from .train import check_loss_stage, finish_training, stage_programs


@dataclass(frozen=True, eq=False)
class BucketLayout(Layout):
    """A bucket's layout: its batch leaves are templates (numbered from `templates`), and
    microbatch `i` reads template `t`'s copy `t + i * stride`."""

    templates: int = 0
    stride: int = 0

    @classmethod
    def of_bucket(cls, graph: StageGraph, schedule, mesh, args: PlanArgs, templates: int) -> "BucketLayout":
        layout = Layout.of(graph, schedule, mesh, args, schedule.microbatches)
        own = {f.name: getattr(layout, f.name) for f in fields(Layout)}
        return cls(**own, templates=templates, stride=len(args.batch))

    def batch_leaf(self, a: int, i: int) -> int:
        return a + i * self.stride if a >= self.templates else a


def build_bucketed_train_plan(
    buckets: dict, lengths: tuple[int, ...], templates: int, schedule, mesh, epilogue, compiler: Compiler
) -> Plan:
    """The plan running `schedule` with microbatch `i` at length `lengths[i]`, then `epilogue` (an
    `Epilogue`, or None); `buckets` maps each length to its `(StageGraph, PlanArgs)`, whose batch
    leaves are the templates numbered from `templates`."""
    layouts, programs = {}, {}
    for length, (graph, args) in buckets.items():
        check_loss_stage(graph)
        layouts[length] = BucketLayout.of_bucket(graph, schedule, mesh, args, templates)
        programs[length] = programs_of(layouts[length], args, 1, args.remat)
    first = lengths[0]
    layout, args = layouts[first], buckets[first][1]
    draft = Draft()
    setup = accumulator_cells(draft, layout, programs[first], args)
    specs = [spec for spec, _ in setup]
    programs = {k: stage_programs(layouts[k], p, specs, compiler) for k, p in programs.items()}
    for spec, outs in setup:
        draft.add(spec, (), outs)

    def pick(part):
        length = lengths[part.microbatch]
        return layouts[length], programs[length]

    for rank, action in order_actions(schedule, layout.n, layout.graph):
        emit_action(draft, layout, programs[first], rank, action, pick)
    return finish_training(draft, layout, programs[first], replace(args, epilogue=epilogue), compiler)
