"""`treduce`: a loop over microbatches whose per-microbatch results are reduced.

`treduce(fn, xs, schedule, operation=...)` calls `fn` on each microbatch of
`xs` (every leaf has the microbatches along `axis`) and reduces each output
over them with `Add`, `Mean`, `Max` or `Concat`.

Inside an `sxjit` function that differentiates it, the loop is the pipeline:
`fn`'s first output is the loss (reduced by `Mean` or `Add`), its stage
markers cut it into stages, `schedule` orders the microbatches, and
`jax.grad` / `jax.value_and_grad` of the result are the pipeline's exact
gradients (with respect to every floating-point value `fn` closes over); the
other outputs come back reduced as asked. Anywhere else it is a plain Python
loop over the microbatches, with the same results.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from .._trace.pipelined import inside_train_step, train_step_owner
from ..errors import MpmdError
from .grad import step_function


@dataclass(frozen=True)
class Reduction:
    """How one output of `treduce` combines its per-microbatch values (stacked on axis 0)."""

    name: str
    reduce: Callable

    def __repr__(self) -> str:
        return self.name


Add = Reduction("Add", lambda x: jnp.sum(x, axis=0))
Mean = Reduction("Mean", lambda x: jnp.mean(x, axis=0))
Max = Reduction("Max", lambda x: jnp.max(x, axis=0))
Concat = Reduction("Concat", lambda x: jnp.reshape(x, (-1, *x.shape[2:])) if x.ndim > 1 else x)


def _operations(operation, out) -> list[Reduction]:
    """One reduction per output leaf: `operation` is one `Reduction` or a tree prefix of them."""
    if isinstance(operation, Reduction):
        return [operation] * len(jax.tree.leaves(out))
    try:
        return jax.tree.leaves(
            jax.tree.map(
                lambda op, sub: [op] * len(jax.tree.leaves(sub)),
                operation,
                out,
                is_leaf=lambda x: isinstance(x, Reduction),
            ),
        )
    except ValueError as err:
        raise MpmdError(
            f"treduce: operation={operation!r} does not match the structure of fn's output "
            f"{jax.tree.structure(out)}; pass one Reduction (Add, Mean, Max, Concat) or a tree prefix of them."
        ) from err


def _microbatch(xs, i: int, axis: int):
    return jax.tree.map(lambda x: jnp.take(x, i, axis=axis), xs)


def _length(xs, axis: int) -> int:
    sizes = {np.shape(x)[axis] for x in jax.tree.leaves(xs)}
    if len(sizes) != 1:
        raise MpmdError(
            f"treduce: every leaf of xs needs the same number of microbatches on axis {axis}, got {sorted(sizes)}."
        )
    return sizes.pop()


def treduce(fn: Callable, xs, schedule=None, *, axis: int = 0, operation=Add):
    """Reduce `fn(microbatch)` over the microbatches of `xs` (see the module docstring)."""
    if not jax.tree.leaves(xs):
        raise MpmdError("treduce: xs holds no arrays; pass the microbatched batch.")
    m = _length(xs, axis)
    if inside_train_step() and schedule is not None:
        return _pipelined(fn, xs, schedule, axis, operation, m)
    outs = [fn(_microbatch(xs, i, axis)) for i in range(m)]
    tree = jax.tree.structure(outs[0])
    stacked = [jnp.stack(leaves) for leaves in zip(*(jax.tree.leaves(o) for o in outs))]
    ops = _operations(operation, outs[0])
    return jax.tree.unflatten(tree, [op.reduce(x) for op, x in zip(ops, stacked)])


def _pipelined(fn, xs, schedule, axis: int, operation, m: int):
    if axis != 0:
        raise MpmdError(f"treduce: inside sxjit the microbatches lie on axis 0 of xs; got axis={axis}.")
    if m != schedule.microbatches:
        raise MpmdError(
            f"treduce: xs has {m} microbatches on axis 0 but schedule.microbatches={schedule.microbatches}."
        )
    first = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), xs)
    out_shape = jax.eval_shape(fn, first)
    ops = _operations(operation, out_shape)
    leaves = jax.tree.leaves(out_shape)
    if not leaves or leaves[0].shape != () or ops[0] not in (Add, Mean):
        raise MpmdError(
            "treduce: inside sxjit fn's first output is the loss, a scalar reduced by Mean or Add; got "
            f"{leaves[0] if leaves else 'no output'} reduced by {ops[0] if ops else None}."
        )
    converted, consts = jax.closure_convert(fn, first)
    tree = jax.tree.structure(out_shape)

    def loss(consts, xs):
        out = jax.tree.leaves(converted(_microbatch(xs, 0, 0), *consts))
        return out[0], tuple(out[1:])

    owner = train_step_owner()
    step = step_function(
        loss,
        compiler=owner.compiler,
        mesh=owner.mesh,
        schedule=schedule,
        has_aux=True,
        batch_argnums=1,
        reduce="sum" if ops[0] is Add else "mean",
    )

    @jax.custom_vjp
    def run(consts, xs):
        return step(consts, xs)[0]

    def forward(consts, xs):
        value, grads = step(consts, xs)
        return value, (grads, xs)

    def backward(res, ct):
        grads, xs = res
        scale = ct[0]
        zeros = jax.tree.map(
            lambda x: (
                np.zeros(x.shape, jax.dtypes.float0)
                if not jnp.issubdtype(x.dtype, jnp.inexact)
                else jnp.zeros_like(x)
            ),
            xs,
        )
        return jax.tree.map(lambda g: scale * g, grads), zeros

    run.defvjp(forward, backward)
    value, aux = run(list(consts), xs)
    reduced = [value, *(op.reduce(x) for op, x in zip(ops[1:], aux))]
    return jax.tree.unflatten(tree, reduced)
