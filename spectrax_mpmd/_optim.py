"""Optimizer steps that stay on each pipeline rank.

Gradients from `sxvalue_and_grad` live on the submesh of the rank that owns
each parameter. `StagedOptimizer` groups leaves by the devices they live on
and runs one jitted optax update per group there, so a training loop never
gathers parameters on one device. Global-norm clipping is done across ranks:
each group computes its sum of squares, every group's update program receives
all of them (one batched transfer of scalars) and computes the norm and the
scale itself, so a step runs two programs per group and nothing else.

In a multi-process run each process updates only the groups it holds (a
gradient leaf of another process's rank is a global array without local
shards: its parameter and state are left as they are here), and the global
norm adds the processes' partial sums, exchanged through the `jax.distributed`
key-value store (`_comm.exchange`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import NamedSharding, PartitionSpec

from ._trace.context import methods_outside_context_mesh


class StagedOptState(NamedTuple):
    """Per-group optax states; `groups[k]` lists the flat leaf indices of group `k`."""

    groups: tuple[tuple[int, ...], ...]
    states: tuple[Any, ...]


def _device_key(x) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in x.sharding.device_set))


@methods_outside_context_mesh
class StagedOptimizer:
    """Apply an optax transformation rank by rank.

    Args:
      tx: the optax transformation. It sees each rank's parameters as a flat
        list of leaves, so use transformations that act leaf-wise (adam, sgd,
        weight decay, schedules); do not put `optax.clip_by_global_norm` in
        it — a norm inside `tx` would be per rank. Use `max_grad_norm` instead.
      max_grad_norm: if set, gradients are scaled so that their global norm,
        over all ranks, is at most this value (as `optax.clip_by_global_norm`).

    Every program runs with fixed input and output shardings (a parameter on
    its gradient's sharding, its state entries alike, shared entries such as a
    step count replicated on the group's devices), so each group's update
    compiles once per signature and step 1 reuses step 0's program.
    """

    def __init__(self, tx: optax.GradientTransformation, *, max_grad_norm: float | None = None):
        self.tx = tx
        self.max_grad_norm = max_grad_norm
        self._exchange = None  # multi-process: the key-value all-gather of partial sums, made on first use
        self._programs: dict = {}  # (kind, shardings) -> jitted program with those shardings

    def _groups(self, grads) -> tuple[tuple[int, ...], ...]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for k, g in enumerate(jax.tree.leaves(grads)):
            groups.setdefault(_device_key(g), []).append(k)
        return tuple(tuple(v) for v in groups.values())

    def _abstract_state(self, leaves: list, shardings: list):
        """One group's state as `jax.ShapeDtypeStruct`s on their shardings (nothing computed)."""
        specs = [_struct(x) for x in leaves]
        abstract = jax.eval_shape(self.tx.init, specs)
        places = state_shardings(abstract, shardings, [s.shape for s in specs])
        return jax.tree.map(
            lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), abstract, places
        )

    def _program(self, kind: str, fn, out_shardings):
        key = (kind, jax.tree.structure(out_shardings), tuple(jax.tree.leaves(out_shardings)))
        if key not in self._programs:
            self._programs[key] = jax.jit(fn, out_shardings=out_shardings)
        return self._programs[key]

    def init(self, params, grads_like=None) -> StagedOptState:
        """Initialise per-group states; `grads_like` (e.g. the first gradients) fixes the placement.

        Without `grads_like`, leaves are grouped by where `params` live. A group
        held by another process gets its state as global arrays without local
        shards.
        """
        ref = params if grads_like is None else grads_like
        groups = self._groups(ref)
        p_leaves = jax.tree.leaves(params)
        r_leaves = jax.tree.leaves(ref)
        states = []
        for idx in groups:
            shardings = [r_leaves[k].sharding for k in idx]
            abstract = self._abstract_state([p_leaves[k] for k in idx], shardings)
            if not _local(r_leaves[idx[0]]):
                states.append(jax.tree.map(remote_array, abstract))
                continue
            leaves = [_placed(p_leaves[k], sh) for k, sh in zip(idx, shardings)]
            init = self._program("init", self.tx.init, jax.tree.map(lambda x: x.sharding, abstract))
            states.append(init(leaves))
        return StagedOptState(groups, tuple(states))

    def global_norm(self, grads) -> jax.Array:
        """The L2 norm of all gradient leaves across every rank."""
        leaves = jax.tree.leaves(grads)
        groups = self._groups(grads)
        mine = [idx for idx in groups if _local(leaves[idx[0]])]
        partial = [self._sum_squares([leaves[k] for k in idx]) for idx in mine]
        if len(mine) == len(groups):
            home = partial[0].sharding
            return _sqrt_sum(jax.device_put(partial, [home] * len(partial)))
        if self._exchange is None:  # other processes hold the other groups
            from ._comm import Exchange

            self._exchange = Exchange("grad_norm")
        total = sum(float(x) for x in partial)
        return jnp.sqrt(jnp.float32(sum(float(v) for v in self._exchange.allgather(repr(total)))))

    def _sum_squares(self, leaves: list) -> jax.Array:
        home = _replicated_like(leaves[0].sharding)
        return self._program("sum_squares", _sum_squares, home)(leaves)

    def _group_update(self, params, grads, state, partials):
        if partials:  # global-norm clipping: every group's sum of squares (or their total)
            norm = jnp.sqrt(sum(partials))
            max_norm = jnp.float32(self.max_grad_norm)
            scale = jnp.where(norm < max_norm, 1.0, max_norm / norm)
            grads = [g * scale.astype(g.dtype) for g in grads]
        updates, state = self.tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def _norm_inputs(self, g_leaves: list, groups, local: list[int]) -> dict[int, tuple]:
        """What each local group's update reads to clip by the global norm: every group's sum of
        squares on its own devices (one batched transfer), or, where other processes hold some
        groups, the total over processes; empty tuples without `max_grad_norm`."""
        if self.max_grad_norm is None:
            return {g: () for g in local}
        partial = [self._sum_squares([g_leaves[k] for k in groups[g]]) for g in local]
        if len(local) < len(groups):  # other processes hold the other groups
            if self._exchange is None:
                from ._comm import Exchange

                self._exchange = Exchange("grad_norm")
            mine = sum(float(x) for x in partial)
            total = np.float32(sum(float(v) for v in self._exchange.allgather(repr(mine))))
            return {g: (total,) for g in local}
        homes = [_replicated_like(g_leaves[groups[g][0]].sharding) for g in local]
        moved = iter(jax.device_put(partial * len(local), [h for h in homes for _ in partial]))
        return {g: tuple(next(moved) for _ in partial) for g in local}

    def update(self, grads, state: StagedOptState, params):
        """One optimizer step: returns `(new_params, new_state)`, each leaf on its owner rank.

        In a multi-process run a leaf of a group another process holds comes
        back as a global array without local shards (never the stale value
        this process was given): read it on its owner, or with `mp.gather`.
        """
        p_leaves, treedef = jax.tree.flatten(params)
        g_leaves = jax.tree.leaves(grads)
        local = [g for g, idx in enumerate(state.groups) if _local(g_leaves[idx[0]])]
        norm_inputs = self._norm_inputs(g_leaves, state.groups, local)
        new = list(p_leaves)
        states = []
        for g, (idx, st) in enumerate(zip(state.groups, state.states)):
            shardings = [g_leaves[k].sharding for k in idx]
            if g not in norm_inputs:  # another process updates it
                for k, sh in zip(idx, shardings):
                    new[k] = remote_array(_struct(p_leaves[k], sh))
                states.append(st)
                continue
            out = (shardings, jax.tree.map(lambda x: x.sharding, st))
            step = self._program("update", self._group_update, out)
            leaves = [_placed(p_leaves[k], sh) for k, sh in zip(idx, shardings)]
            out_p, st = step(leaves, [g_leaves[k] for k in idx], st, norm_inputs[g])
            for k, p in zip(idx, out_p):
                new[k] = p
            states.append(st)
        return jax.tree.unflatten(treedef, new), StagedOptState(state.groups, tuple(states))


def state_shardings(state, shardings: list, shapes: list):
    """Where each entry of one group's optax `state` lives (`state` may be abstract).

    An entry in a per-parameter list (AdamW's `mu`, `nu`) with its parameter's
    shape takes that parameter's sharding; one of another shape, and any
    shared entry (a step count), is replicated on the group's devices.
    """
    n = len(shardings)
    is_list = lambda x: isinstance(x, list) and len(x) == n  # noqa: E731

    def place(node):
        if not is_list(node):
            return jax.tree.map(lambda _: _replicated_like(shardings[0]), node)
        return [
            jax.tree.map(
                lambda x, i=i: (
                    shardings[i] if tuple(x.shape) == tuple(shapes[i]) else _replicated_like(shardings[i])
                ),
                elem,
            )
            for i, elem in enumerate(node)
        ]

    return jax.tree.map(place, state, is_leaf=is_list)


def remote_array(spec: jax.ShapeDtypeStruct) -> jax.Array:
    """A global array of `spec`'s shape, dtype and sharding with no shard on this process.

    What another process's leaf is here: reading it raises, it holds no memory
    here, and a program over it runs only on its owner.
    """
    return jax.make_array_from_single_device_arrays(spec.shape, spec.sharding, [], dtype=spec.dtype)


def _struct(x, sharding=None) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x), sharding=sharding)


def _placed(x, sharding):
    """`x` on `sharding` (a no-op after the first step, when it already lives there)."""
    return x if getattr(x, "sharding", None) == sharding else jax.device_put(x, sharding)


def _sum_squares(leaves):
    return sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves)


@jax.jit
def _sqrt_sum(partial):
    return jnp.sqrt(sum(partial))


def _local(x) -> bool:
    """Whether this process holds array `x` (in a multi-process run, other ranks' leaves are not)."""
    return getattr(x, "is_fully_addressable", True)


def _replicated_like(sharding):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec(), memory_kind=sharding.memory_kind)
    return jax.sharding.SingleDeviceSharding(next(iter(sorted(sharding.device_set, key=lambda d: d.id))))
