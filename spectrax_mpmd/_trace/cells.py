"""Per-stage cell functions: forward, backward, its I/W halves, and the fused last stage.

Every cell is a plain function over flat lists of arrays, ready for `jax.jit`.
A stage's inputs come in four groups, always in this order:

* `P`  the differentiated parameter leaves it reads,
* `X`  broadcast arguments it reads (the same for every microbatch; a PRNG key
       among them is folded with the microbatch index),
* `Bf` whole batch leaves it reads (leading axis `microbatches x micro_batch`),
  followed by one int32 microbatch index `idx` (the cell slices its microbatch),
* `A`  the activations it receives from earlier stages.

The backward of a stage is first written as one function of `(residuals,
cotangents)`; the I/W split partitions that function's jaxpr by what each
output needs, so the I cell computes the input cotangents only and the W cell
only what the weight gradients need beyond I's stash.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp

from .args import fold_key
from .graph import Stage, StageGraph
from .jax_private import Literal, Var
from .jaxpr import CALL_PRIMITIVES, eval_eqns, inline_calls, needed_eqns, read, resolve
from .weights import LossWeights


def _is_float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.inexact)


@dataclass
class StageIO:
    """How one stage's inputs and outputs map onto the function's flat arguments and edges."""

    stage: Stage
    params: tuple[int, ...]
    fixed: tuple[int, ...]
    batch: tuple[int, ...]
    diff_in: tuple[int, ...]
    diff_out: tuple[int, ...]
    ct_edges: tuple[tuple[int, ...], ...]
    loss_result: int | None
    microbatches: int = 1
    folded: tuple[bool, ...] = ()  # per `fixed` leaf: a PRNG key folded per microbatch

    @classmethod
    def build(
        cls,
        graph: StageGraph,
        s: int,
        diff_args: set[int],
        batch_args: set[int],
        loss: bool,
        microbatches: int = 1,
        keys: frozenset = frozenset(),
    ):
        stage = graph.stages[s]
        args = stage.arg_inputs
        consumers = graph.consumers(s)
        diff_out = tuple(j for j, v in enumerate(stage.edge_outputs) if _is_float(v.aval))
        edge_pos = {e: k for k, e in enumerate(graph.edges)}
        fixed = tuple(a for a in args if a not in diff_args and a not in batch_args)
        return cls(
            stage=stage,
            params=tuple(a for a in args if a in diff_args),
            fixed=fixed,
            batch=tuple(a for a in args if a in batch_args),
            diff_in=tuple(k for k, e in enumerate(stage.edge_inputs) if e.differentiable),
            diff_out=diff_out,
            ct_edges=tuple(tuple(edge_pos[e] for e in consumers[stage.edge_outputs[j]]) for j in diff_out),
            loss_result=0 if loss else None,
            microbatches=microbatches,
            folded=tuple(a in keys for a in fixed),
        )

    @property
    def n_in(self) -> int:
        return len(self.params) + len(self.fixed) + len(self.batch) + 1 + len(self.stage.edge_inputs)

    def apply(self, P, X, Bf, idx, A) -> tuple[list, list]:
        """Run the stage on microbatch `idx`: returns `(edge outputs, results)`."""
        B = [_microbatch(b, idx, self.microbatches) for b in Bf]
        X = [fold_key(x, idx) if fold else x for x, fold in zip(X, self.folded)]
        by_arg = dict(zip(self.params, P)) | dict(zip(self.fixed, X)) | dict(zip(self.batch, B))
        return self.stage.run([by_arg[a] for a in self.stage.arg_inputs], A)

    def split_inputs(self, flat: Sequence[Any]):
        np_, nx, nb = len(self.params), len(self.fixed), len(self.batch)
        P = list(flat[:np_])
        X = list(flat[np_ : np_ + nx])
        Bf = list(flat[np_ + nx : np_ + nx + nb])
        idx = flat[np_ + nx + nb]
        A = list(flat[np_ + nx + nb + 1 :])
        return P, X, Bf, idx, A

    def differentiable_fn(self, X, Bf, idx, A) -> Callable:
        """`f(P, A_diff) -> (diff edge outputs, (other edge outputs, results))` for `jax.vjp`."""

        def f(P, A_diff):
            merged = list(A)
            for k, a in zip(self.diff_in, A_diff):
                merged[k] = a
            E, R = self.apply(P, X, Bf, idx, merged)
            diff = [E[j] for j in self.diff_out]
            rest = [E[j] for j in range(len(E)) if j not in self.diff_out]
            return diff, (rest, R)

        return f

    def merge_outputs(self, diff, rest) -> list:
        E, d, r = [], iter(diff), iter(rest)
        for j in range(len(self.stage.edge_outputs)):
            E.append(next(d) if j in self.diff_out else next(r))
        return E


class StageCells:
    """The cell functions of one stage (see the module docstring for argument order)."""

    def __init__(self, io: StageIO, microbatches: int, remat, in_avals: Sequence, weights: LossWeights):
        """`remat`: False (the backward reads the vjp's residuals), True (it reads the stage's inputs
        and recomputes the forward) or a `jax.checkpoint_policies` name (the vjp of the stage under
        `jax.checkpoint` with that policy: its residuals are what the policy saves)."""
        self.io, self.remat = io, remat is True
        self.policy = getattr(jax.checkpoint_policies, remat) if isinstance(remat, str) else None
        self.weights, self.microbatches = weights, microbatches
        self.in_avals = list(in_avals)

    def _vjp(self, flat):
        """`jax.vjp` of the stage w.r.t. its parameters and differentiable inputs."""
        P, X, Bf, idx, A = self.io.split_inputs(flat)
        A_diff = [A[k] for k in self.io.diff_in]
        f = self.io.differentiable_fn(X, Bf, idx, A)
        if self.policy is not None:
            f = jax.checkpoint(f, policy=self.policy)
        return jax.vjp(f, P, A_diff, has_aux=True)

    # -- forward ---------------------------------------------------------------------
    def forward_only(self, *flat):
        """Forward without residuals: `(edge outputs, results)` flattened."""
        E, R = self.io.apply(*self.io.split_inputs(flat))
        return (*E, *R)

    def forward(self, *flat):
        """Forward keeping what the backward needs: edge outputs, results, and the residuals it
        computes (residuals that are cell inputs are not returned: see `residual_sources`)."""
        if self.remat:
            return self.forward_only(*flat)
        diff, vjp_fn, (rest, R) = self._vjp(flat)
        produced = [leaf for leaf in jax.tree.leaves(vjp_fn) if _input_position(leaf, flat) is None]
        return (*self.io.merge_outputs(diff, rest), *R, *produced)

    # -- backward as one function of (residuals, cotangents) -------------------------
    @functools.cached_property
    def _residuals(self) -> tuple[list, tuple, Any]:
        """One trace of the stage's vjp: residual avals, their sources, the pullback's treedef."""
        if self.remat:
            return list(self.in_avals), tuple(range(len(self.in_avals))), None
        found = []

        def probe(*flat):
            leaves, treedef = jax.tree.flatten(self._vjp(flat)[1])
            found.append((tuple(_input_position(leaf, flat) for leaf in leaves), treedef))
            return leaves

        avals = jax.eval_shape(probe, *self.in_avals)
        return list(avals), *found[0]

    @property
    def residual_avals(self) -> list:
        """What the backward reads: the residuals of the stage's vjp, or with remat its inputs."""
        return self._residuals[0]

    @property
    def residual_sources(self) -> tuple:
        """Per residual: the position of the cell input it is, or None when the forward computes it.

        A parameter or a received activation that the backward needs as it is (`x @ w`
        keeps both) is read from its own buffer; returning it from the forward would
        make XLA copy it on every microbatch (a weight copy per forward, alive until its
        backward). With remat every residual is an input.
        """
        return self._residuals[1]

    @property
    def produced_residual_avals(self) -> list:
        """The avals of the residuals the forward returns (those that are not inputs)."""
        return [a for a, src in zip(self.residual_avals, self.residual_sources) if src is None]

    def ct_avals(self):
        outs = self.io.stage.edge_outputs
        return [
            jax.ShapeDtypeStruct(outs[j].aval.shape, outs[j].aval.dtype)
            for j, consumers in zip(self.io.diff_out, self.io.ct_edges)
            for _ in consumers
        ]

    def _sum_cts(self, cts):
        out, it = [], iter(cts)
        for consumers in self.io.ct_edges:
            parts = [next(it) for _ in consumers]
            total = parts[0]
            for p in parts[1:]:
                total = total + p
            out.append(total)
        return out

    @functools.cached_property
    def backward_core(self) -> Callable:
        """`bwd(residuals, cotangents) -> (param grads, input cotangents)`, flat lists."""
        if self.remat:

            def bwd(res, cts):
                gP, gA = self._vjp(res)[1](self._sum_cts(cts))
                return list(gP), list(gA)

        else:
            treedef = self._residuals[2]

            def bwd(res, cts):
                gP, gA = jax.tree.unflatten(treedef, res)(self._sum_cts(cts))
                return list(gP), list(gA)

        return bwd

    def backward(self, *flat):
        """Full backward: `(residuals, cotangents, grad accumulators) -> (accumulators, input cts)`."""
        n_res = len(self.residual_avals)
        n_ct = len(self.ct_avals())
        res, cts, acc = flat[:n_res], flat[n_res : n_res + n_ct], flat[n_res + n_ct :]
        gP, gA = self.backward_core(list(res), list(cts))
        return (*[a + g.astype(a.dtype) for a, g in zip(acc, gP)], *gA)

    # -- the I / W split ---------------------------------------------------------------
    def split_backward(self) -> tuple[Callable, Callable, int, tuple[frozenset, frozenset]]:
        """Partition the backward into an I cell and a W cell; returns `(I, W, stash size, reads)`.

        I: `(residuals, cotangents) -> (input cotangents, stash)`.
        W: `(residuals, cotangents, stash, accumulators) -> accumulators`.
        `reads`: the positions of the residuals I reads, and of those W reads (others are ignored).
        """
        res_avals = self.residual_avals
        ct_avals = self.ct_avals()
        n_res, n_ct = len(res_avals), len(ct_avals)
        n_p = len(self.io.params)

        def flat_bwd(*flat):
            gP, gA = self.backward_core(list(flat[:n_res]), list(flat[n_res:]))
            return (*gP, *gA)

        closed = jax.make_jaxpr(flat_bwd)(*res_avals, *ct_avals)
        eqns, mapping, inner_consts, _ = inline_calls(
            closed.jaxpr, lambda eqn: eqn.primitive.name in CALL_PRIMITIVES
        )
        outvars = [resolve(v, mapping) for v in closed.jaxpr.outvars]
        consts = dict(zip(closed.jaxpr.constvars, closed.consts)) | inner_consts
        invars = list(closed.jaxpr.invars)
        grad_vars, ct_vars = outvars[:n_p], outvars[n_p:]
        in_i = needed_eqns(eqns, ct_vars)
        in_w = needed_eqns(eqns, grad_vars) - in_i
        i_eqns = [eqns[k] for k in sorted(in_i)]
        w_eqns = [eqns[k] for k in sorted(in_w)]
        made_by_i = {v for q in i_eqns for v in q.outvars}
        stash = list(
            dict.fromkeys(
                v
                for q in w_eqns
                for v in q.invars
                if isinstance(v, Var) and not isinstance(v, Literal) and v in made_by_i
            )
        )
        stash += [v for v in grad_vars if isinstance(v, Var) and v in made_by_i and v not in stash]

        def i_cell(*flat):
            env = dict(consts)
            env.update(zip(invars, flat))
            eval_eqns(i_eqns, env)
            return (*[read(env, v) for v in ct_vars], *[env[v] for v in stash])

        def w_cell(*flat):
            env = dict(consts)
            env.update(zip(invars, flat[: n_res + n_ct]))
            env.update(zip(stash, flat[n_res + n_ct : n_res + n_ct + len(stash)]))
            eval_eqns(w_eqns, env)
            acc = flat[n_res + n_ct + len(stash) :]
            grads = [_grad_value(env, v, a) for v, a in zip(grad_vars, acc)]
            return tuple(a + g.astype(a.dtype) for a, g in zip(acc, grads))

        def read_by(cell_eqns, outs) -> frozenset:
            ids = {id(v) for q in cell_eqns for v in q.invars} | {id(v) for v in outs}
            return frozenset(k for k, v in enumerate(invars[:n_res]) if id(v) in ids)

        return i_cell, w_cell, len(stash), (read_by(i_eqns, ct_vars), read_by(w_eqns, grad_vars))

    # -- the last stage: loss forward and backward in one cell ---------------------------
    def loss_step(self, *flat):
        """`(inputs, accumulators, loss accumulator) -> (accumulators, input cts, loss acc, other results)`.

        Differentiates the microbatch's loss weighed by `weights` (`LossWeights`), so the
        accumulated gradients and loss are the step's.
        """
        n_in, n_p = self.io.n_in, len(self.io.params)
        inputs, acc, loss_acc = flat[:n_in], flat[n_in : n_in + n_p], flat[n_in + n_p]
        P, X, Bf, idx, A = self.io.split_inputs(inputs)
        A_diff = [A[k] for k in self.io.diff_in]
        f = self.io.differentiable_fn(X, Bf, idx, A)
        scale = self.weights.scaler(self.io, X, Bf, idx, self.microbatches)

        def scaled_loss(P, A_diff):
            _, (_, R) = f(P, A_diff)
            return scale(R[self.io.loss_result]), R

        (scaled, R), (gP, gA) = jax.value_and_grad(scaled_loss, argnums=(0, 1), has_aux=True)(P, A_diff)
        others = [r for k, r in enumerate(R) if k != self.io.loss_result]
        acc_out = [a + g.astype(a.dtype) for a, g in zip(acc, gP)]
        return (*acc_out, *gA, loss_acc + scaled.astype(loss_acc.dtype), *others)


def _input_position(leaf, flat) -> int | None:
    """The position of `leaf` among the traced cell inputs `flat` (by identity), or None."""
    for k, x in enumerate(flat):
        if leaf is x:
            return k
    return None


def _microbatch(batch, idx, microbatches: int):
    """Rows `[idx * mb, (idx + 1) * mb)` of a whole-batch leaf, `mb = len(batch) // microbatches`
    (with one microbatch, the leaf itself)."""
    if microbatches == 1:
        return batch
    size = batch.shape[0] // microbatches
    return jax.lax.dynamic_slice_in_dim(batch, idx * size, size)


def _grad_value(env, v, like):
    if isinstance(v, Literal):
        return jnp.full(like.shape, v.val, like.dtype)
    return env[v]
