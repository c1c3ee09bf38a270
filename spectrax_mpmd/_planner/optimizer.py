"""What an optax update adds to a pipelined step: its state's bytes on each rank, its time, its validation.

The one-plan training step (`sxvalue_and_grad_and_apply`) keeps each optimizer
state leaf laid out like its parameter, on the rank that owns the parameter's
gradient, and runs each leaf's update there. So, from the transformation alone:

* state bytes: `jax.eval_shape(tx.init, params)` says every state leaf's shape;
  `optax.tree_map_params` says which leaves are copies of the parameter tree
  (Adam's two moments) and so which parameter each belongs to; a leaf that is no
  parameter's (a step count) is counted on every rank;
* the validation: when one leaf's update reads another rank's gradients (a
  global norm for clipping, a finiteness check) a global verdict gates it, as
  the step's validation says (`with_update(validation="sync")`: every rank
  waits for the last backward; `"post"`: each updates after its own last cell,
  then waits for the verdict), and until the verdict a rank holds its reduced
  gradients next to their accumulators (one more copy of its gradients);
  otherwise nothing gates it: each rank updates right after its own last cell
  (`validation="none"`);
* the time: the update of the whole tree is timed once on one device and
  shared among the ranks in proportion to the parameter bytes each updates.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import jax
import numpy as np
import optax

from .._mesh import rank_holding
from .._trace.jax_private import Literal

ASSUMED_STATES = 2  # without a transformation: Adam's two moments per parameter


@dataclass(frozen=True)
class Owners:
    """Per parameter leaf (flat, in the order of `jax.tree.leaves(params)`): the rank that owns
    its gradient and updates it, and its bytes on one device there."""

    rank: tuple[int, ...]
    device_bytes: tuple[int, ...]

    @staticmethod
    def of(plan, params) -> "Owners":
        """Read from a training plan whose first argument is `params`."""
        leaves = jax.tree.leaves(params)
        shardings = plan.grad_shardings(len(leaves))
        ranks, sizes = [], []
        for a, leaf in enumerate(leaves):
            sharding = shardings[a]
            ranks.append(rank_holding(plan.device_rank, sharding))
            shard = sharding.shard_shape(tuple(np.shape(leaf)))
            sizes.append(int(math.prod(shard)) * np.dtype(leaf.dtype).itemsize)
        return Owners(tuple(ranks), tuple(sizes))

    def per_rank(self, ranks: int) -> tuple[int, ...]:
        """Parameter bytes each rank updates."""
        total = [0] * ranks
        for r, b in zip(self.rank, self.device_bytes):
            total[r] += b
        return tuple(total)


def _nbytes(x) -> int:
    return int(math.prod(np.shape(x))) * np.dtype(x.dtype).itemsize


def state_bytes(tx, params, owners: Owners, ranks: int) -> tuple[int, ...]:
    """Per rank, the bytes of `tx`'s state on one device: each per-parameter leaf on its
    parameter's owner (laid out like it), every other leaf on every rank."""
    state = jax.eval_shape(tx.init, params)
    index = jax.tree.unflatten(jax.tree.structure(params), range(len(owners.rank)))
    total = [0] * ranks
    param_leaves = jax.tree.leaves(params)

    def owned(leaf, a):
        full = _nbytes(param_leaves[a])
        share = owners.device_bytes[a] / full if full else 1.0
        total[owners.rank[a]] += int(round(_nbytes(leaf) * share))
        return leaf

    def everywhere(leaf):
        for r in range(ranks):
            total[r] += _nbytes(leaf)
        return leaf

    optax.tree_map_params(tx, owned, state, index, transform_non_params=everywhere)
    return tuple(total)


def crosses_ranks(tx, params, owners: Owners) -> bool:
    """Whether the update of some leaf reads the gradient of a leaf another rank owns (a global
    norm, a finiteness check): then every rank's update waits for all backwards."""
    shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), x.dtype), params)
    state = jax.eval_shape(tx.init, shapes)

    def updates(grads, state, params):
        return tx.update(grads, state, params)[0]

    closed = jax.make_jaxpr(updates)(shapes, state, shapes)
    jaxpr, n = closed.jaxpr, len(owners.rank)
    reads = {v: 1 << a for a, v in enumerate(jaxpr.invars[:n])}
    for eqn in jaxpr.eqns:  # an equation's outputs read all its inputs read (sub-programs included)
        mask = 0
        for v in eqn.invars:
            if not isinstance(v, Literal):
                mask |= reads.get(v, 0)
        for v in eqn.outvars:
            reads[v] = mask
    for a, out in enumerate(jaxpr.outvars):
        mask = 0 if isinstance(out, Literal) else reads.get(out, 0)
        if any(owners.rank[b] != owners.rank[a] for b in range(n) if mask >> b & 1):
            return True
    return False


def update_seconds(tx, params, rounds: int) -> float:
    """The least measured time of `tx.update` + `optax.apply_updates` on the whole tree, on one
    device (compiled once, then timed `rounds` times)."""
    device = jax.devices()[0]
    params = jax.device_put(params, device)
    grads = jax.tree.map(lambda x: x * 0.5, params)
    state = jax.device_put(tx.init(params), device)

    @jax.jit
    def apply(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    jax.block_until_ready(apply(grads, state, params))
    best = math.inf
    for _ in range(rounds):
        start = time.perf_counter()
        jax.block_until_ready(apply(grads, state, params))
        best = min(best, time.perf_counter() - start)
    return best


def with_sync_copy(peaks: tuple[int, ...], memory, sync: bool) -> tuple[int, ...]:
    """`peaks` raised, when `sync` (a verdict gates the update), to what a rank holds until the
    verdict: everything it holds for the whole step plus its reduced gradients (as many bytes as
    its accumulators)."""
    if not sync:
        return peaks
    return tuple(max(p, memory.static(r) + memory.accumulators[r]) for r, p in enumerate(peaks))
