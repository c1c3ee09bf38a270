"""Gradient accumulators: created zero before the first action, summed across the stages that
share a parameter leaf after the last, cast back to each leaf's dtype."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .._comm import transfer
from .._compile.compiler import CellSpec, shape_spec
from .._runtime.slots import GradAccumulator, LossAccumulator, Output, Result, ZeroGrad
from .draft import Draft
from .layout import Layout, PlanArgs
from .programs import StageProgram


def accumulator_cells(
    draft: Draft, layout: Layout, programs: list[StageProgram], args: PlanArgs
) -> list[tuple[CellSpec, list[int]]]:
    """One program per rank creating the zero gradient accumulators of its stages, with the
    slots it fills.

    A parameter leaf that no stage reads gets its zero gradient here too, on the
    first stage's rank: a fresh array every call, so donating it is safe. A loss
    stage's loss accumulator starts from a zero scalar placed once, with the
    plan's constants (its cells do not donate it): ranks whose parameters have
    the same shapes then share one program, whichever computes the loss.
    """
    per_rank: dict[int, tuple[list, list, list]] = {}
    read = {a for p in programs for a in p.io.params}
    for a in args.params:
        if a not in read:
            s = grad_stage(layout, a)
            shardings, avals, outs = per_rank.setdefault(layout.ranks[s], ([], [], []))
            shardings.append(layout.param(a, s))
            avals.append(layout.graph.in_avals[a])
            outs.append(draft.slot(ZeroGrad(a)))
    for s, p in enumerate(programs):
        shardings, avals, outs = per_rank.setdefault(layout.ranks[s], ([], [], []))
        shardings += [layout.param(a, s) for a in p.io.params]
        avals += [layout.accumulator_aval(a) for a in p.io.params]
        outs += [draft.slot(GradAccumulator(s, a)) for a in p.io.params]
        if layout.is_loss(s):
            aval = layout.accumulator_aval("loss")
            zero = (np.zeros(aval.shape, aval.dtype), layout.named(s, None))
            draft.constants[draft.slot(LossAccumulator(s))] = zero
    return [
        (CellSpec(_zeros(tuple(avals)), (), tuple(shardings)), outs)
        for _, (shardings, avals, outs) in sorted(per_rank.items())
        if outs
    ]


def grad_stage(layout: Layout, a: int) -> int:
    """The logical stage whose rank holds parameter leaf `a`'s gradient (and the update of `a`
    after the backward): the first stage reading it, or the first stage for a leaf no stage reads."""
    return next((s for s, stage in enumerate(layout.graph.stages) if a in stage.arg_inputs), 0)


def reduce_gradients(draft: Draft, layout: Layout, programs: list[StageProgram], args: PlanArgs) -> dict:
    """Sum the gradients of shared parameter leaves (a tied weight, the copies of a stage) on
    their owner (`grad_stage`) and the loss of every loss stage on the last
    stage, cast accumulators back, stack each auxiliary result over microbatches. Returns
    the output slots: `{"loss": slot, "grads": {leaf: slot}, "aux": {output: slot}}`."""
    users: dict[int, list[int]] = {}
    for s, p in enumerate(programs):
        for a in p.io.params:
            users.setdefault(a, []).append(s)
    grads = {a: draft.slot(ZeroGrad(a)) for a in args.params if a not in users}
    for a, stages in users.items():
        owner = grad_stage(layout, a)
        sh = layout.param(a, owner)
        stages = [owner, *(s for s in stages if s != owner)]  # summed on the owner, into its accumulator
        parts = [(draft.slot(GradAccumulator(s, a)), layout.param(a, s)) for s in stages]
        slot = _sum_on(draft, parts, sh, layout.accumulator_aval(a))
        grads[a] = _cast_back(draft, slot, layout.accumulator_aval(a), layout.graph.in_avals[a], sh)
    sh = layout.named(layout.last, None)
    losses = [(draft.slot(LossAccumulator(s)), layout.named(s, None)) for s in layout.loss_stages[::-1]]
    total = _sum_on(draft, losses, sh, layout.accumulator_aval("loss"))
    loss = _cast_back(draft, total, layout.accumulator_aval("loss"), layout.graph.out_avals[0], sh)
    aux = {}
    for j in range(1, len(layout.graph.out_avals)):
        sh = layout.named(layout.graph.result_stage[j], None)
        stack = CellSpec(_stack, (shape_spec(layout.graph.out_avals[j], sh),) * layout.m, (sh,))
        aux[j] = draft.new()
        draft.add(stack, [draft.slot(Result(j, i)) for i in range(layout.m)], [aux[j]])
    return {Output.LOSS: loss, Output.GRADS: grads, Output.AUX: aux}


def _sum_on(draft: Draft, parts: list[tuple[int, object]], sh, acc) -> int:
    """The sum of the accumulators `(slot, sharding)` (the first on `sh`), on `sh`."""
    slot = parts[0][0]
    for moved, at in parts[1:]:
        if at != sh:
            source, moved = moved, draft.new()
            draft.add(transfer([at], [sh]), [source], [moved])
        total = draft.new()
        draft.add(CellSpec(_add, (shape_spec(acc, sh),) * 2, (sh,), (0,)), [slot, moved], [total])
        slot = total
    return slot


def _cast_back(draft: Draft, slot: int, acc, aval, sharding) -> int:
    """A step casting an accumulator to its parameter's (or the loss's) dtype, if they differ."""
    if acc.dtype == aval.dtype:
        return slot
    out = draft.new()
    draft.add(CellSpec(_caster(aval.dtype), (shape_spec(acc, sharding),), (sharding,)), [slot], [out])
    return out


def _zeros(avals: tuple):
    def zeros():
        return tuple(jnp.zeros(v.shape, v.dtype) for v in avals)

    return zeros


def _add(x, y):
    return (x + y,)


def _stack(*xs):
    return (jnp.stack(xs),)


def _caster(dtype):
    def cast(x):
        return (x.astype(dtype),)

    return cast
