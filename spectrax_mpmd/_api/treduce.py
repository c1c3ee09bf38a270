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

from .._settings import StepSettings
from .._trace.jaxpr import eval_eqns, read
from .._trace.pipelined import inside_train_step, traced_train_step
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


def _reduce(op: Reduction, stacked, weights):
    """`op` over the stacked per-microbatch values; `Mean` weighted by `weights` when given."""
    if weights is None or op is not Mean:
        return op.reduce(stacked)
    w = weights.reshape(-1, *([1] * (stacked.ndim - 1)))
    return jnp.sum(stacked * w, axis=0) / jnp.sum(weights)


def _weights(weight_fn, xs, axis: int, m: int):
    """The float32 weight of every microbatch (None without `weight_fn`)."""
    if weight_fn is None:
        return None
    return jnp.stack([jnp.asarray(weight_fn(_microbatch(xs, i, axis)), jnp.float32) for i in range(m)])


def treduce(fn: Callable, xs, schedule=None, *, axis: int = 0, operation=Add, microbatch_weight_fn=None):
    """Reduce `fn(microbatch)` over the microbatches of `xs` (see the module docstring).

    `microbatch_weight_fn(microbatch)` gives each microbatch a weight `w_i`: the `Mean`
    outputs (the loss among them) are then `sum(w_i * out_i) / sum(w_i)`.
    """
    settings = StepSettings.of("treduce", locals())
    if not jax.tree.leaves(xs):
        raise MpmdError("treduce: xs holds no arrays; pass the microbatched batch.")
    m = _length(xs, axis)
    if inside_train_step() and schedule is not None:
        return _pipelined(fn, xs, settings, axis, operation, m)
    outs = [fn(_microbatch(xs, i, axis)) for i in range(m)]
    tree = jax.tree.structure(outs[0])
    stacked = [jnp.stack(leaves) for leaves in zip(*(jax.tree.leaves(o) for o in outs))]
    ops = _operations(operation, outs[0])
    if microbatch_weight_fn is not None and ops[0] is Add:
        raise MpmdError("treduce: microbatch_weight_fn weighs Mean outputs; the loss is reduced by Add.")
    weights = _weights(microbatch_weight_fn, xs, axis, m)
    return jax.tree.unflatten(tree, [_reduce(op, x, weights) for op, x in zip(ops, stacked)])


def _pipelined(fn, xs, settings: StepSettings, axis: int, operation, m: int):
    schedule, weight_fn = settings.schedule, settings.microbatch_weight_fn
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
    converted, floats, others = _hoisted(fn, first)
    tree = jax.tree.structure(out_shape)

    def loss(floats, xs, others):
        out = jax.tree.leaves(converted(_microbatch(xs, 0, 0), floats, others))
        return out[0], tuple(out[1:])

    def weight(floats, xs, others):
        return weight_fn(_microbatch(xs, 0, 0))

    jitted = traced_train_step()
    step_settings = settings.replace(
        mesh=jitted.mesh,
        has_aux=True,
        batch_argnums=1,
        reduce=None if weight_fn is not None else "sum" if ops[0] is Add else "mean",
        microbatch_weight_fn=None if weight_fn is None else weight,
    )
    step = step_function(loss, step_settings, compiler=jitted.compiler, exact=False, fold_keys=False)

    @jax.custom_vjp
    def run(floats, xs, others):
        return step(floats, xs, others)[0]

    def forward(floats, xs, others):
        value, grads = step(floats, xs, others)
        return value, (grads, xs, others)

    def backward(res, ct):
        grads, xs, others = res
        return jax.tree.map(lambda g: ct[0] * g, grads), _zero_cotangents(xs), _zero_cotangents(others)

    run.defvjp(forward, backward)
    value, aux = run(floats, xs, others)
    weights = _weights(weight_fn, xs, 0, m)
    reduced = [value, *(_reduce(op, x, weights) for op, x in zip(ops[1:], aux))]
    return jax.tree.unflatten(tree, reduced)


def _zero_cotangents(tree):
    return jax.tree.map(
        lambda x: (
            np.zeros(x.shape, jax.dtypes.float0)
            if not jnp.issubdtype(x.dtype, jnp.inexact)
            else jnp.zeros_like(x)
        ),
        tree,
    )


def _hoisted(fn, first):
    """`fn` as `g(microbatch, floats, others)` of the traced values it closes over, with those
    values: the floating-point ones are differentiated, the others (PRNG keys, integers)
    reach every microbatch as they are, as in the plain loop."""
    closed = jax.make_jaxpr(fn)(first)
    jaxpr = closed.jaxpr
    traced = [k for k, c in enumerate(closed.consts) if isinstance(c, jax.core.Tracer)]
    is_float = {k: jnp.issubdtype(closed.consts[k].dtype, jnp.inexact) for k in traced}
    floats = [closed.consts[k] for k in traced if is_float[k]]
    others = [closed.consts[k] for k in traced if not is_float[k]]
    out_tree = jax.tree.structure(jax.eval_shape(fn, first))

    def converted(microbatch, floats, others):
        values, fl, ot = list(closed.consts), iter(floats), iter(others)
        for k in traced:
            values[k] = next(fl) if is_float[k] else next(ot)
        env = dict(zip(jaxpr.constvars, values))
        env.update(zip(jaxpr.invars, jax.tree.leaves(microbatch)))
        eval_eqns(jaxpr.eqns, env)
        return jax.tree.unflatten(out_tree, [read(env, v) for v in jaxpr.outvars])

    return converted, floats, others
