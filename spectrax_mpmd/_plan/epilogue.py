"""The code after the pipelined backward (an optimizer update, clipping, metrics), run by ownership.

An `Epilogue` is a traced program whose inputs are the step's parameters, its
other inputs (an optimizer state, a learning rate) and what the pipeline made
(the loss, each parameter's gradient, the stacked auxiliary results).
`emit_epilogue` partitions it (`spectrax_mpmd._trace.ownership`) and appends its
pieces to the plan: each piece one cell on its rank's submesh, each value a
piece on another rank reads sent there once. Inputs owned by nobody are placed on
every rank that reads them, laid out like the parameter they are updated with;
donated inputs are consumed by the last cell that reads them, except those the
step returns as they came (a frozen leaf), which come back alive as outputs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import numpy as np

from .._comm import transfer
from .._compile.compiler import CellSpec, shape_spec
from .._runtime.slots import Input, InputKind, Output
from .._trace.jax_private import Literal
from .._trace.ownership import Partition, Program, partition
from .draft import Draft
from .gradients import grad_stage
from .layout import Layout


class RoleKind(StrEnum):
    """What an epilogue input is."""

    PARAM = "param"  # a parameter leaf (on the rank that owns its gradient)
    GRAD = "grad"  # a parameter leaf's gradient
    LOSS = "loss"  # the loss
    AUX = "aux"  # an auxiliary output, stacked over microbatches
    INPUT = "input"  # an argument leaf owned by nobody (an optimizer state's)


class Role(NamedTuple):
    """An epilogue input's kind, and the leaf or output it is (`index`; 0 for the loss)."""

    kind: RoleKind
    index: int = 0


@dataclass(frozen=True, eq=False)
class Epilogue:
    """A traced program and the `Role` of each of its inputs; `donated` holds the roles of the
    inputs the call may consume.
    `function_leaves[a]` is the function's leaf that pipeline leaf `a` reads: the plan numbers
    its inputs as the function does."""

    program: Program
    roles: tuple
    donated: frozenset = frozenset()
    function_leaves: tuple = ()


@dataclass
class _Emitter:
    draft: Draft
    layout: Layout
    part: Partition
    specs: dict  # var -> PartitionSpec of the owned input it is laid out like
    where: dict  # (var, rank) -> (slot, sharding)
    inputs: dict  # unowned input var -> its leaf

    def sharding(self, v, rank: int):
        return self.layout.on_rank(rank, self.specs.get(v))

    def locate(self, names, rank: int) -> list[tuple[int, object]]:
        """The slots holding `names` on `rank`: placed there (unowned inputs), or sent from their
        homes, every value from another rank in one transfer step."""
        moves = []
        for v in names:
            if (v, rank) in self.where:
                continue
            sh = self.sharding(v, rank)
            if v in self.inputs:
                key = Input(InputKind.AFTER, self.inputs[v], rank)
                self.draft.input_specs[key] = self.specs.get(v)
                self.where[(v, rank)] = (self.draft.slot(key), sh)
            else:
                src, src_sh = self.where[(v, self.part.home[v])]
                self.where[(v, rank)] = (self.draft.new(), sh)
                moves.append((src, src_sh, self.where[(v, rank)][0], sh))
        if moves:
            src, src_sh, dst, sh = zip(*moves)
            self.draft.add(transfer(list(src_sh), list(sh)), src, dst)
        return [self.where[(v, rank)] for v in names]


def emit_epilogue(draft: Draft, layout: Layout, epilogue: Epilogue, outputs: dict) -> dict:
    """Append `epilogue`'s pieces after the pipeline's steps; returns the plan's outputs:
    `{"loss": slot, "results": [slot per epilogue output], "replicated": [slot]}`, the last the
    outputs every process of a job returns (scalars, such as an optimizer's step count or a
    metric, and what is owned by nobody), since a later call may read them on any rank. A donated
    input that is also an output (returned as it came) is never consumed."""
    owners, specs, where, inputs = [], {}, {}, {}
    grads = outputs[Output.GRADS]
    for v, (kind, index) in zip(epilogue.program.invars, epilogue.roles):
        if kind == RoleKind.INPUT:
            owners.append(None)
            inputs[v] = index
            continue
        if kind in (RoleKind.PARAM, RoleKind.GRAD):
            rank = layout.ranks[grad_stage(layout, index)]
            slot = grads[index] if kind == RoleKind.GRAD else draft.slot(Input(InputKind.PARAM, index, rank))
            specs[v] = layout.param_spec(index, rank)
        elif kind == RoleKind.LOSS:
            rank, slot = layout.ranks[layout.last], outputs[Output.LOSS]
        else:
            rank, slot = layout.ranks[layout.graph.result_stage[index]], outputs[Output.AUX][index]
        owners.append(rank)
        where[(v, rank)] = (slot, layout.on_rank(rank, specs.get(v)))
    default = layout.ranks[0]
    part = partition(epilogue.program, owners, default)
    for v, u in part.like.items():
        if u in specs:
            specs[v] = specs[u]
    em = _Emitter(draft, layout, part, specs, where, inputs)
    pending = []
    for piece in part.pieces:
        located = em.locate(piece.ins, piece.rank)
        outs = [draft.new() for _ in piece.outs]
        for v, slot in zip(piece.outs, outs):
            where[(v, piece.rank)] = (slot, em.sharding(v, piece.rank))
        pending.append((len(draft.steps), piece, located))
        draft.add(None, [s for s, _ in located], outs)  # the cell, made once donations are known
    results = [_output(em, v, default) for v in part.outvars]
    everywhere = [  # what every process returns: small values a later call may read on any rank
        slot
        for v, slot in zip(part.outvars, results)
        if isinstance(v, Literal) or v in part.unowned or v.aval.shape == ()
    ]
    donated = {v for v, role in zip(epilogue.program.invars, epilogue.roles) if role in epilogue.donated}
    donatable = {slot for (v, _), (slot, _) in where.items() if v in donated} - set(results)
    last_read = {}
    for k, step in enumerate(draft.steps):
        for i in step.ins:
            last_read[i] = k
    for k, piece, located in pending:
        donate = _donations(piece, located, k, last_read, donatable)
        spec = CellSpec(
            piece.function(part.consts),
            tuple(shape_spec(v.aval, sh) for v, (_, sh) in zip(piece.ins, located)),
            tuple(where[(v, piece.rank)][1] for v in piece.outs),
            donate,
        )
        draft.steps[k] = draft.steps[k]._replace(fn=spec)
    return {Output.LOSS: outputs[Output.LOSS], Output.RESULTS: results, Output.REPLICATED: everywhere}


def _output(em: _Emitter, v, default: int) -> int:
    """The slot of output `v`: where it was made, a constant for a literal, or a copy on the first
    rank of an unowned input passed through (every process returns it from there)."""
    if isinstance(v, Literal):
        slot = em.draft.new()
        em.draft.constants[slot] = (np.asarray(v.val), em.layout.on_rank(default, None))
        return slot
    if v in em.inputs:
        ((slot, sh),) = em.locate([v], default)
        copy = em.draft.new()
        em.draft.add(CellSpec(_identity, (shape_spec(v.aval, sh),), (sh,)), [slot], [copy])
        return copy
    home = em.part.home.get(v)
    return em.locate([v], default if home is None else home)[0][0]


def _identity(x):
    return (x,)


def _donations(piece, located, k: int, last_read: dict, donatable: set) -> tuple[int, ...]:
    """Inputs of the piece at step `k` it may consume: donated argument buffers no later step reads,
    each matched to an output of its shape and dtype (XLA reuses the buffer for it)."""
    free = [(v.aval.shape, v.aval.dtype) for v in piece.outs]
    donate = []
    for j, (v, (slot, _)) in enumerate(zip(piece.ins, located)):
        if slot in donatable and last_read.get(slot) == k and (v.aval.shape, v.aval.dtype) in free:
            free.remove((v.aval.shape, v.aval.dtype))
            donate.append(j)
    return tuple(donate)
