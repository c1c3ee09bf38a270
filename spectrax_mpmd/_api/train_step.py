"""The whole training step as one traced function: the pipeline, then any JAX code on its results.

Inside `sxjit`, a `sxvalue_and_grad` step called on the function's arguments
is one equation (`spectrax_mpmd._trace.pipelined`, bound by `bind`).
`build_train_step` makes one plan of the function: the pipeline's cells, then
every other equation (an optax update, clipping, metrics) split by ownership and
appended as an `Epilogue`, so each leaf's update runs on the rank holding it,
right after that rank's last backward, and only the small values several ranks
need cross.
"""

from __future__ import annotations

import dataclasses

from .._plan import Epilogue, Role, RoleKind, build_train_plan
from .._trace.ownership import Program
from .._trace.pipelined import FoundCall, PipelineCall
from ..errors import MpmdError
from .bucketed import BucketSignature, bucketed_plan
from .entry import Entry, build_plan


def build_train_step(function, sig, found: FoundCall, out_tree, donated_leaves: frozenset) -> Entry:
    """The plan of a traced training step: `found`'s pipeline, then the rest of the function.

    The plan reads the function's leaves: a leaf the pipeline reads keeps its role there
    (a parameter's placement is shared with its update), every other leaf the rest reads
    is placed on each rank that reads it."""
    call: PipelineCall = found.call
    pipe = call.pipeline
    eqn = found.eqns[found.index]
    invars = list(found.invars)
    leaf_of = {v: j for j, v in enumerate(invars)}
    step_to_fn = [leaf_of[v] for v in eqn.invars]  # the function leaf each pipeline leaf reads
    params = [a for k in pipe.argnums for a in pipe.ranges[k]]
    param_of = {step_to_fn[a]: a for a in params}
    roles = [
        Role(RoleKind.PARAM, param_of[j]) if j in param_of else Role(RoleKind.INPUT, j)
        for j in range(len(invars))
    ]
    roles += [Role(RoleKind.LOSS), *(Role(RoleKind.AUX, j) for j in range(1, call.n_aux + 1))]
    roles += [Role(RoleKind.GRAD, a) for a in params]
    donated = {Role(RoleKind.INPUT, j) for j in donated_leaves} | {
        Role(RoleKind.PARAM, param_of[j]) for j in donated_leaves if j in param_of
    }
    program = Program(
        tuple(e for k, e in enumerate(found.eqns) if k != found.index),
        (*invars, *eqn.outvars),
        tuple(found.outvars),
        found.consts,
    )
    function.last_graph = pipe.graph
    if isinstance(sig, BucketSignature):  # the microbatches' own leaves follow the function's
        n = len(sig.base.leaves)
        step_to_fn += range(n, len(sig.leaves))
    epilogue = Epilogue(program, tuple(roles), frozenset(donated), tuple(step_to_fn))
    if isinstance(sig, BucketSignature):
        plan = bucketed_plan(call.step, sig.inner, epilogue)
        return Entry(plan, out_tree, donated=donated_leaves, lengths=sig.rows.lengths)
    if call.step.settings.length_buckets is not None:
        raise MpmdError(
            f"{function.name}: the pipelined step it calls has length_buckets, which an sxjit function "
            "cannot pass on; build the whole step with sxvalue_and_grad_and_apply(..., length_buckets=...)."
        )
    args = dataclasses.replace(pipe.args, epilogue=epilogue)
    plan = build_plan(function.compiler, build_train_plan, pipe.graph, pipe.schedule, function.mesh, args)
    return Entry(plan, out_tree, donated=donated_leaves)
