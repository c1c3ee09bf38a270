"""`Runner`: a forward function plus what to do with it (train or forward), on any mesh.

On a mesh with a pipeline axis the forward's stage markers cut it into
per-rank programs (`sxvalue_and_grad` / `sxjit`); on a mesh without one it is
one `jax.jit` over the mesh, microbatches accumulated by `lax.scan`. Both
paths compute the same numbers: the microbatches are weighed alike
(`spectrax_mpmd._trace.weights`), and a PRNG key in `extra` reaches microbatch
`i` as `jax.random.fold_in(key, i)` on both.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_core import sharding as core_sharding

from .._api.apply import apply_step
from .._api.grad import _StepFunction
from .._api.jit import _JitFunction
from .._mesh import MpmdMesh
from .._settings import StepSettings
from .._trace.args import fold_key, is_prng_key
from .._trace.context import methods_outside_context_mesh
from .._trace.exact_loss import BATCH, OTHER, PARAM
from .._trace.weights import microbatched_loss
from ..errors import MpmdError

DATA_AXES = ("dp", "fsdp")


def call_with(fn: Callable, first: Any, inputs: Any) -> Any:
    """`fn(first, inputs)` for an array, `fn(first, *inputs)` for a tuple, `fn(first, **inputs)` for a dict."""
    if isinstance(inputs, tuple):
        return fn(first, *inputs)
    if isinstance(inputs, dict):
        return fn(first, **inputs)
    return fn(first, inputs)


def pipeline_stages(mesh, schedule=None) -> int:
    """How many stages a run on `mesh` cuts the model into: the schedule's model stages, ranks x
    virtual stages for the named schedules (n for DualPipe, which runs each twice; 1 without a
    pipeline axis)."""
    return StepSettings("pipeline_stages", mesh=mesh, schedule=schedule).model_stages()


def fold_keys(extra: Any, i) -> Any:
    """Every PRNG key leaf of `extra` folded with microbatch index `i`."""

    def fold(x):
        dtype = getattr(x, "dtype", None)
        return fold_key(x, i) if dtype is not None and is_prng_key(jnp.shape(x), dtype) else x

    return jax.tree.map(fold, extra)


def refuse_shared_buffers(name: str, donated: tuple, kept: tuple) -> None:
    """Refuse, before any device work, an array passed twice when one of its places is consumed
    (`params`, `opt_state`): the call could not read it again (an optimizer state holding the
    parameter arrays themselves, a batch that is a parameter)."""
    places: dict[int, list[tuple[str, bool]]] = {}
    named = [
        *zip(donated, ("params", "opt_state"), (True, True)),
        *zip(kept, ("extra", "inputs", "targets"), (False,) * 3),
    ]
    for tree, label, consumed in named:
        for path, x in jax.tree_util.tree_leaves_with_path(tree):
            if isinstance(x, jax.Array):
                places.setdefault(id(x), []).append((label + jax.tree_util.keystr(path), consumed))
    for found in places.values():
        gone = [where for where, consumed in found if consumed]
        if len(found) > 1 and gone:
            other = next(where for where, _ in found if where != gone[0])
            raise MpmdError(
                f"{name}: {other} is the same array as {gone[0]}, which the update consumes (donates), "
                "so it cannot read that array again. An optimizer state that holds the parameter arrays "
                "themselves (an init returning `params`) does this, and so does a batch that is a "
                "parameter. Pass a copy (`jax.tree.map(jnp.copy, opt_state)`)."
            )


def accumulated(name: str, loss: Callable, args: tuple, m: int, has_aux: bool, weight_fn) -> tuple:
    """`(value, grads)` of `loss(params, extra, inputs, targets)` with its `m` microbatches
    accumulated in one program (`lax.scan`; aux stacked per microbatch), each weighed as the
    pipelined step weighs it, so both give the same numbers."""
    params, extra = args[:2]
    leaves = jax.tree.leaves(args)
    n_p, n_x = len(jax.tree.leaves(params)), len(jax.tree.leaves(extra))
    kinds = {a: PARAM if a < n_p else OTHER if a < n_p + n_x else BATCH for a in range(len(leaves))}
    keys = frozenset(a for a in range(n_p, n_p + n_x) if is_prng_key(leaves[a].shape, leaves[a].dtype))
    piece, scaled, out_tree = microbatched_loss(name, loss, args, kinds, m, weight_fn=weight_fn, keys=keys)
    p_tree = jax.tree.structure(params)

    def one(i):
        def value(p_leaves):
            outs = piece(i, [*p_leaves, *leaves[n_p:]])
            return scaled(i, leaves, outs[0]), outs

        (loss_i, outs), grads = jax.value_and_grad(value, has_aux=True)(leaves[:n_p])
        aux = jax.tree.unflatten(out_tree, outs)[1] if has_aux else None
        return (loss_i.astype(outs[0].dtype), jax.tree.unflatten(p_tree, grads)), aux

    def body(carry, i):  # also for m == 1, so aux is stacked per microbatch on both paths
        part, aux = one(i)
        return jax.tree.map(jnp.add, carry, part), aux

    zero = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(lambda: one(0)[0]))
    (total, grads), aux = jax.lax.scan(body, zero, jnp.arange(m))
    return ((total, aux) if has_aux else total), grads


def train_loss(forward: Callable, loss_fn: Callable) -> Callable:
    """`loss(params, extra, inputs, targets)`: `loss_fn` of `forward`'s outputs, as a run trains it."""

    def loss(params, extra, inputs, targets):
        out = forward(params, extra, inputs)
        return loss_fn(out, targets) if targets is not None else loss_fn(out)

    return loss


@methods_outside_context_mesh
class Runner:
    """A run configuration, compiled on first use per argument signature.

    `runner(params, extra, inputs, targets=None)`: `mode="train"` returns
    `(loss, grads)` (`((loss, aux), grads)` with `has_aux`), `grads` shaped
    like `params`; `mode="forward"` returns the outputs, concatenated over
    microbatches in batch order. With an optax `tx`, `runner.update(params,
    opt_state, extra, inputs, targets)` is the whole training step. `remat` and
    `offload` (as `sxvalue_and_grad` takes them) set what each stage keeps for its
    backward on an MPMD mesh; a plain SPMD step ignores them.
    `microbatch_weight_fn(inputs, targets)` weighs each microbatch's loss (the
    step's loss is `sum(w_i * loss_i) / sum(w_i)`; see `sxvalue_and_grad`), on
    either kind of mesh; without it both give the loss of the whole batch for a
    loss ending in batch factors (a padded token mean). `length_buckets` (an
    `mp.LengthBuckets`; a path such as `("targets", "lengths")` names the lengths)
    runs each microbatch at its rows' length bucket on an MPMD mesh (see
    `sxvalue_and_grad`).
    """

    def __init__(
        self,
        forward: Callable,
        *,
        mesh,
        mode: str = "train",
        loss_fn: Callable | None = None,
        microbatches: int = 1,
        schedule=None,
        has_aux: bool = False,
        rules=None,
        name: str = "run",
        region_ranks: dict | None = None,
        tx: optax.GradientTransformation | None = None,
        remat=False,
        offload=False,
        microbatch_weight_fn: Callable | None = None,
        length_buckets=None,
    ):
        self._build(forward, loss_fn, StepSettings.of(name, locals()))

    @classmethod
    def of(cls, forward: Callable, loss_fn: Callable | None, settings: StepSettings) -> Runner:
        """The runner of `forward` and `loss_fn` with `settings` (as the keywords would give them)."""
        runner = cls.__new__(cls)
        runner._build(forward, loss_fn, settings)
        return runner

    def _build(self, forward: Callable, loss_fn: Callable | None, settings: StepSettings) -> None:
        if settings.mode == "train" and loss_fn is None:
            raise MpmdError(
                f"{settings.name}: mode='train' needs loss_fn=, a function (outputs, targets) -> scalar loss "
                "(e.g. spectrax_core.losses.softmax_cross_entropy); use mode='forward' for outputs."
            )
        self.forward, self.loss_fn = forward, loss_fn
        self.mpmd = settings.pipelined
        if not self.mpmd:
            mesh = settings.mesh
            self.settings, self.mesh = settings, mesh.jax_mesh if isinstance(mesh, MpmdMesh) else mesh
            self.step = jax.jit(self._spmd_train if settings.mode == "train" else self._spmd_forward)
            self.update_step = jax.jit(self._spmd_update, donate_argnums=(0, 1))
            return
        self.settings = settings = settings.with_schedule()
        self.mesh = settings.pipeline_mesh
        if settings.mode == "forward":
            self.step = _JitFunction(self._forward_only, settings.replace(batch_argnums=2), ())
            return
        step = settings.runner_step()
        if settings.tx is not None:
            self.update_step = apply_step(self._loss, step)
        self.step = _StepFunction(self._loss, step)

    # the settings other parts read (each is `self.settings`'s)
    name = property(lambda self: self.settings.name)
    mode = property(lambda self: self.settings.mode)
    tx = property(lambda self: self.settings.tx)
    rules = property(lambda self: self.settings.rules)

    schedule = property(lambda self: self.settings.schedule)
    microbatches = property(lambda self: self.settings.microbatches)

    # -- the traced functions ------------------------------------------------------------
    def _loss(self, params, extra, inputs, targets):
        return train_loss(self.forward, self.loss_fn)(params, extra, inputs, targets)

    def _forward_only(self, params, extra, inputs):
        return self.forward(params, extra, inputs)

    def _microbatch(self, tree, i):
        m = self.microbatches
        return jax.tree.map(
            lambda x: jax.lax.dynamic_slice_in_dim(x, i * (x.shape[0] // m), x.shape[0] // m), tree
        )

    def _spmd_train(self, params, extra, inputs, targets):
        args = (params, extra, inputs, targets)
        step = self.settings.runner_step()
        return accumulated(
            step.name, self._loss, args, step.microbatches, step.has_aux, step.microbatch_weight_fn
        )

    def _spmd_update(self, params, opt_state, extra, inputs, targets):
        value, grads = self._spmd_train(params, extra, inputs, targets)
        updates, opt_state = self.settings.tx.update(grads, opt_state, params)
        return value, optax.apply_updates(params, updates), opt_state

    def _spmd_forward(self, params, extra, inputs):
        m = self.microbatches
        if m == 1:
            return self.forward(params, fold_keys(extra, 0), inputs)
        outs = jax.lax.map(
            lambda i: self.forward(params, fold_keys(extra, i), self._microbatch(inputs, i)), jnp.arange(m)
        )
        return jax.tree.map(lambda y: y.reshape(y.shape[0] * y.shape[1], *y.shape[2:]), outs)

    # -- calling ---------------------------------------------------------------------------
    def _check_batch(self, inputs, targets) -> None:
        sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(inputs)}
        if None in sizes or len(sizes) != 1:
            raise MpmdError(
                f"{self.name}: every input leaf needs the same leading batch size, got {sorted(map(str, sizes))}."
            )
        (batch,) = sizes
        if batch % self.microbatches:
            raise MpmdError(
                f"{self.name}: the batch size {batch} is not divisible by microbatches={self.microbatches}; "
                f"use a batch that is a multiple of {self.microbatches}."
            )
        target_sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in jax.tree.leaves(targets)}
        if target_sizes and target_sizes != {batch}:
            raise MpmdError(
                f"{self.name}: targets have batch size {sorted(map(str, target_sizes))} but inputs have "
                f"{batch}; give one target row per input row."
            )

    def __call__(self, params, extra, inputs, targets=None):
        self._check_batch(inputs, targets)
        mode = self.settings.mode
        if mode == "forward" and targets is not None:
            raise MpmdError(f"{self.name}: mode='forward' takes no targets.")
        args = (params, extra, inputs) + ((targets,) if mode == "train" else ())
        if self.mpmd:
            return self.step(*args)
        with jax.set_mesh(self.mesh):
            return self.step(*self._spmd_place(args))

    def update(self, params, opt_state, extra, inputs, targets=None):
        """One training step with the runner's `tx`: `(loss, params, opt_state)`, the update run
        on each parameter's rank inside the pipelined plan (one SPMD program without a pipeline).
        `params` and `opt_state` (`tx.init(params)`) are consumed: keep what it returns."""
        if self.settings.tx is None:
            raise MpmdError(f"{self.name}: this runner has no optimizer; build it with tx=.")
        self._check_batch(inputs, targets)
        if self.mpmd:
            return self.update_step(params, opt_state, extra, inputs, targets)
        refuse_shared_buffers(self.name, (params, opt_state), (extra, inputs, targets))
        with jax.set_mesh(self.mesh):
            params, extra, inputs, targets = self._spmd_place((params, extra, inputs, targets))
            opt_state = jax.device_put(opt_state, NamedSharding(self.mesh, PartitionSpec()))  # one program
            return self.update_step(params, opt_state, extra, inputs, targets)

    def _spmd_place(self, args):
        """Parameters by `rules` (replicated without), batch leaves split over the data axes."""
        mesh = self.mesh
        params, extra, *batch = args
        if self.settings.rules is not None:
            specs = core_sharding.param_specs(params, self.settings.rules, mesh=mesh)
            params = jax.device_put(params, jax.tree.map(lambda s: NamedSharding(mesh, s), specs))
        else:
            params = jax.device_put(params, NamedSharding(mesh, PartitionSpec()))
        extra = jax.device_put(extra, NamedSharding(mesh, PartitionSpec()))
        axes = tuple(a for a in DATA_AXES if a in mesh.shape and mesh.shape[a] > 1)
        ways = 1
        for a in axes:
            ways *= mesh.shape[a]

        def place(x):
            ok = axes and jnp.ndim(x) and jnp.shape(x)[0] % (ways * self.microbatches) == 0
            return jax.device_put(x, NamedSharding(mesh, PartitionSpec(axes if ok else None)))

        return (params, extra, *jax.tree.map(place, batch))
