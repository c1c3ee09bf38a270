"""A pipelined step called on traced arguments inside `sxjit`: one `sxpipeline_p` equation."""

from __future__ import annotations

from typing import Sequence

import jax

from .._trace.args import signature
from .._trace.pipelined import PipelineCall, sxpipeline_p


def bind_pipeline(step, args: Sequence):
    """`step(*args)` on traced arguments inside `sxjit`: one `sxpipeline_p` equation, returning
    what the step returns (`(value, grads)` or, for `sxgrad`, the gradients)."""
    sig = signature(step.name, step.fn, args, step.static_argnums, traced=True)
    pipe = step.pipeline(sig)
    m = pipe.schedule.microbatches
    aux = [jax.core.ShapedArray((m, *a.shape), a.dtype) for a in pipe.graph.out_avals[1:]]
    params = [a for k in pipe.argnums for a in pipe.ranges[k]]
    grads = [jax.core.ShapedArray(sig.types[a][0], sig.types[a][1]) for a in params]
    call = PipelineCall(step, sig, pipe, (pipe.graph.out_avals[0], *aux, *grads), len(aux))
    outs = sxpipeline_p.bind(*sig.leaves, call=call)
    loss, aux_leaves, grad_leaves = outs[0], outs[1 : 1 + len(aux)], iter(outs[1 + len(aux) :])
    trees = [
        jax.tree.unflatten(
            sig.in_tree.children()[sig.positions.index(k)], [next(grad_leaves) for _ in pipe.ranges[k]]
        )
        for k in pipe.argnums
    ]
    return step.result(pipe.out_tree, loss, aux_leaves, trees)
