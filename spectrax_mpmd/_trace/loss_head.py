"""The exact loss of a pipelined step: microbatches emit partial sums, the whole batch scales them.

`loss_form` proves a loss `L = h(S, r; c)`: affine in sums over rows `S` (additive
over microbatches), with parameter terms `r` free of rows and coefficients `c`
computed from the batch alone. The stage programs compute, per microbatch `i`,
the inputs of `h` that come from the rows — its partial sums `S_i` (in at least
float32) and the terms `r` — packed into the loss output (`body`). The loss cell
then evaluates `h` with `c` computed on the whole batch (`coefficients`): its
linear part on `S_i` (a `jax.jvp` at `S = 0`) for every microbatch, plus `h(0, r)`
once (microbatch 0), so the microbatches add up to `L` on the whole batch.
`h` is the whole-batch trace's own equations, evaluated in at least float32
(a cast to a narrower float is applied once, to the step's total).
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .jax_private import ClosedJaxpr, Jaxpr, Literal, Var
from .jaxpr import read
from .pruned import CALLS, PER_OPERAND, evaluate, reads


def widest(dtypes) -> np.dtype:
    out = jnp.dtype(jnp.float32)
    for d in dtypes:
        if jnp.issubdtype(d, jnp.floating):
            out = jnp.promote_types(out, d)
    return out


def _narrowing(eqn) -> bool:
    src, dst = eqn.invars[0].aval.dtype, eqn.params["new_dtype"]
    return (
        jnp.issubdtype(src, jnp.floating)
        and jnp.issubdtype(dst, jnp.floating)
        and (jnp.dtype(dst).itemsize < max(jnp.dtype(src).itemsize, 4))
    )


def _bind(eqn, vals):
    params = eqn.primitive.get_bind_params(eqn.params)
    with eqn.ctx.manager:
        out = eqn.primitive.bind(*vals, **params)
    return out if eqn.primitive.multiple_results else [out]


def eval_wide(eqns, env: dict) -> None:
    """Evaluate `eqns` into `env` as JAX would, but never in a float narrower than float32: a
    narrowing cast is skipped and mixed float operands are promoted to the widest."""
    for eqn in eqns:
        name = eqn.primitive.name
        vals = [] if name in PER_OPERAND else [read(env, v) for v in eqn.invars]
        if name == "convert_element_type" and _narrowing(eqn):
            outs = vals
        elif name in PER_OPERAND:  # only the operands the head computes with are at hand
            for v, x in zip(eqn.outvars, eqn.invars):
                if isinstance(x, Literal) or x in env:
                    env[v] = read(env, x)
            continue
        elif name in CALLS:
            body = eqn.params["call_jaxpr" if name.startswith("custom") else "jaxpr"]
            outs = _call_wide(body, vals)
        elif name == "cond":
            branches = [lambda *ops, b=b: _call_wide(b, list(ops)) for b in eqn.params["branches"]]
            outs = _switch(eqn, vals[0], branches, vals[1:])
        elif name in ("scan", "while"):
            outs = _bind(eqn, [jnp.asarray(x, v.aval.dtype) for x, v in zip(vals, eqn.invars)])
        else:
            to = widest(jnp.result_type(x) for x in vals)
            vals = [
                jnp.asarray(x, to) if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x for x in vals
            ]
            if name == "dot_general" and eqn.params.get("preferred_element_type") is not None:
                eqn = eqn.replace(
                    params={
                        **eqn.params,
                        "preferred_element_type": widest([eqn.params["preferred_element_type"], to]),
                    }
                )
            outs = _bind(eqn, vals)
        for v, x in zip(eqn.outvars, outs):
            if isinstance(v, Var):
                env[v] = x


def _call_wide(body, vals: list) -> list:
    jaxpr, consts = (body.jaxpr, body.consts) if isinstance(body, ClosedJaxpr) else (body, ())
    env = dict(zip(jaxpr.constvars, consts)) | dict(zip(jaxpr.invars, vals))
    eval_wide(jaxpr.eqns, env)
    return [read(env, v) for v in jaxpr.outvars]


def _switch(eqn, index, branches, ops) -> list:
    """`lax.switch` over branches evaluated wide, their outputs cast to one dtype each."""
    dts = [
        widest([v.aval.dtype]) if jnp.issubdtype(v.aval.dtype, jnp.floating) else v.aval.dtype
        for v in eqn.outvars
    ]
    fns = [lambda *o, f=f: [jnp.asarray(x, d) for x, d in zip(f(*o), dts)] for f in branches]
    return lax.switch(index, fns, *ops)


@dataclass(frozen=True, eq=False)
class LossHead:
    """How the loss cell turns one microbatch's packed partial sums into its share of the loss."""

    whole: Jaxpr  # the whole-batch trace (calls flattened)
    consts: tuple
    eqns: tuple  # the head: equations of `whole` after the rows are summed
    sources: tuple  # whole-trace variables of the partial sums (packed first)
    terms: tuple  # whole-trace variables of the row-free parameter terms (packed after)
    coefs: tuple  # whole-trace variables of the coefficients the head reads
    leaves: tuple[tuple[int, Var], ...]  # (flat leaf, whole invar) the coefficients read
    loss: object  # the whole-trace loss variable
    wide: np.dtype
    affine: bool = True  # whether `h` may have a constant part (a term, an added constant)

    @property
    def reads(self) -> tuple[int, ...]:
        return tuple(a for a, _ in self.leaves)

    def coefficients(self, leaves: dict) -> list:
        """The coefficients on the whole batch, from the flat leaves (`{leaf: value}`, batch leaves whole)."""
        inputs = {v: leaves[a] for a, v in self.leaves}
        return evaluate(self.whole, self.consts, inputs, self.coefs)

    def share(self, packed, coefs: list, first):
        """Microbatch `packed`'s share of the loss: `h`'s linear part on its sums, plus `h(0, r)` when
        `first`."""
        parts, at = [], 0
        for v in (*self.sources, *self.terms):
            size = int(np.prod(v.aval.shape))
            parts.append(packed[at : at + size].reshape(v.aval.shape))
            at += size
        sums, terms = parts[: len(self.sources)], parts[len(self.sources) :]

        def h(s):
            env = dict(zip(self.whole.constvars, self.consts)) | dict(zip(self.coefs, coefs))
            env.update(zip(self.sources, s))
            env.update(zip(self.terms, terms))
            eval_wide(self.eqns, env)
            return jnp.asarray(read(env, self.loss), self.wide)

        if not sums:
            return jnp.where(first, h([]), jnp.zeros((), self.wide))
        base, linear = jax.jvp(h, (list(map(jnp.zeros_like, sums)),), (sums,))
        if not self.affine:  # h(0) is zero (or 0 * inf for an infinite coefficient): not added
            return linear
        return linear + jnp.where(first, base, jnp.zeros((), self.wide))


def pack(values: list, wide) -> jax.Array:
    return jnp.concatenate([jnp.ravel(jnp.asarray(x, wide)) for x in values])


def body_with_packed_loss(closed: ClosedJaxpr, inputs: list, wide, like) -> ClosedJaxpr:
    """`closed` whose first output is the head's inputs `inputs` (micro variables), packed by
    equations placed as the equation `like` (its source line and scopes: the stage region the loss
    was computed in)."""
    packer = jax.make_jaxpr(lambda *xs: pack(list(xs), wide))(*(v.aval for v in inputs))
    rename = dict(zip(packer.jaxpr.invars, inputs))
    eqns = [
        e.replace(
            invars=[rename.get(v, v) if not isinstance(v, Literal) else v for v in e.invars],
            source_info=e.source_info if like is None else like.source_info,
        )
        for e in packer.jaxpr.eqns
    ]
    out = packer.jaxpr.outvars[0]
    jaxpr = closed.jaxpr.replace(
        eqns=[*closed.jaxpr.eqns, *eqns],
        outvars=[rename.get(out, out), *closed.jaxpr.outvars[1:]],
        constvars=[*closed.jaxpr.constvars, *packer.jaxpr.constvars],
    )
    return ClosedJaxpr(jaxpr, [*closed.consts, *packer.consts])


def head_of(
    whole: ClosedJaxpr, head_idx: list[int], sources, terms, coefs, loss, wide, affine: bool
) -> LossHead:
    """The head over `whole`'s equations `head_idx` (see `LossHead`)."""
    jaxpr = whole.jaxpr
    needed = reads(jaxpr, coefs)
    leaves = tuple((a, v) for a, (v, n) in enumerate(zip(jaxpr.invars, needed)) if n)
    return LossHead(
        jaxpr,
        tuple(whole.consts),
        tuple(jaxpr.eqns[k] for k in head_idx),
        tuple(sources),
        tuple(terms),
        tuple(coefs),
        leaves,
        loss,
        wide,
        affine,
    )
