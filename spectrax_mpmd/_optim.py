"""Optimizer steps that stay on each pipeline rank.

Gradients from `sxvalue_and_grad` live on the submesh of the rank that owns
each parameter. `StagedOptimizer` groups leaves by the devices they live on
and runs one jitted optax update per group there, so a training loop never
gathers parameters on one device. Global-norm clipping is done across ranks:
each group computes its sum of squares, the scalars are summed once, and the
resulting scale is sent back to every group.

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
import optax
from jax.sharding import NamedSharding, PartitionSpec


class StagedOptState(NamedTuple):
    """Per-group optax states; `groups[k]` lists the flat leaf indices of group `k`."""

    groups: tuple[tuple[int, ...], ...]
    states: tuple[Any, ...]


def _device_key(x) -> tuple[int, ...]:
    return tuple(sorted(d.id for d in x.sharding.device_set))


class StagedOptimizer:
    """Apply an optax transformation rank by rank.

    Args:
      tx: the optax transformation. It sees each rank's parameters as a flat
        list of leaves, so use transformations that act leaf-wise (adam, sgd,
        weight decay, schedules); do not put `optax.clip_by_global_norm` in
        it — a norm inside `tx` would be per rank. Use `max_grad_norm` instead.
      max_grad_norm: if set, gradients are scaled so that their global norm,
        over all ranks, is at most this value (as `optax.clip_by_global_norm`).
    """

    def __init__(self, tx: optax.GradientTransformation, *, max_grad_norm: float | None = None):
        self.tx = tx
        self.max_grad_norm = max_grad_norm
        self._update = jax.jit(self._group_update)
        self._exchange = None  # multi-process: the key-value all-gather of partial sums, made on first use
        self._sq = jax.jit(lambda leaves: sum(jnp.sum(jnp.square(g.astype(jnp.float32))) for g in leaves))

    def _groups(self, grads) -> tuple[tuple[int, ...], ...]:
        groups: dict[tuple[int, ...], list[int]] = {}
        for k, g in enumerate(jax.tree.leaves(grads)):
            groups.setdefault(_device_key(g), []).append(k)
        return tuple(tuple(v) for v in groups.values())

    def _align(self, params, grads):
        """Params leaves moved to their gradients' shardings (a no-op after the first step)."""
        p_leaves = jax.tree.leaves(params)
        g_leaves = jax.tree.leaves(grads)
        moved = [
            p
            if getattr(p, "sharding", None) == g.sharding or not g.is_fully_addressable
            else jax.device_put(p, g.sharding)
            for p, g in zip(p_leaves, g_leaves)
        ]
        return moved, g_leaves

    def init(self, params, grads_like=None) -> StagedOptState:
        """Initialise per-group states; `grads_like` (e.g. the first gradients) fixes the placement.

        Without `grads_like`, leaves are grouped by where `params` live.
        """
        ref = params if grads_like is None else grads_like
        groups = self._groups(ref)
        p_leaves = jax.tree.leaves(params)
        r_leaves = jax.tree.leaves(ref)
        states = []
        for idx in groups:
            if not _local(r_leaves[idx[0]]):
                states.append(None)  # held by another process
                continue
            leaves = [jax.device_put(p_leaves[k], r_leaves[k].sharding) for k in idx]
            states.append(jax.jit(self.tx.init)(leaves))
        return StagedOptState(groups, tuple(states))

    def global_norm(self, grads) -> jax.Array:
        """The L2 norm of all gradient leaves across every rank."""
        leaves = jax.tree.leaves(grads)
        groups = [idx for idx in self._groups(grads) if _local(leaves[idx[0]])]
        partial = [self._sq([leaves[k] for k in idx]) for idx in groups]
        if len(groups) == len(self._groups(grads)):
            home = partial[0].sharding
            return jnp.sqrt(sum(jax.device_put(partial, [home] * len(partial))))
        if self._exchange is None:  # other processes hold the other groups
            from ._comm import Exchange

            self._exchange = Exchange("grad_norm")
        mine = sum(float(x) for x in partial)
        return jnp.sqrt(jnp.float32(sum(float(v) for v in self._exchange.allgather(repr(mine)))))

    def _group_update(self, params, grads, state, scale):
        grads = [g * scale.astype(g.dtype) for g in grads]
        updates, state = self.tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    def update(self, grads, state: StagedOptState, params):
        """One optimizer step: returns `(new_params, new_state)`, each leaf on its owner rank."""
        p_leaves, g_leaves = self._align(params, grads)
        treedef = jax.tree.structure(params)
        if self.max_grad_norm is not None:
            norm = self.global_norm(grads)
            scale = jnp.where(norm < self.max_grad_norm, 1.0, self.max_grad_norm / norm)
        else:
            scale = jnp.ones((), jnp.float32)
        new = list(p_leaves)
        states = []
        for idx, st in zip(state.groups, state.states):
            sharding = g_leaves[idx[0]].sharding
            if not _local(g_leaves[idx[0]]):
                states.append(st)  # another process updates it
                continue
            local_scale = jax.device_put(scale, _replicated_like(sharding))
            out_p, st = self._update([p_leaves[k] for k in idx], [g_leaves[k] for k in idx], st, local_scale)
            for k, p in zip(idx, out_p):
                new[k] = p
            states.append(st)
        return jax.tree.unflatten(treedef, new), StagedOptState(state.groups, tuple(states))


def _local(x) -> bool:
    """Whether this process holds array `x` (in a multi-process run, other ranks' leaves are not)."""
    return getattr(x, "is_fully_addressable", True)


def _replicated_like(sharding):
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    return jax.sharding.SingleDeviceSharding(next(iter(sharding.device_set)))
