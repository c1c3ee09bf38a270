"""How each stage's input reaches its rank in the generation wavefront, within and across processes.

Stage s > 0 reads the residual stream stage s−1 made; stage 0 reads, from the
second round on, the token the last stage sampled. Between two ranks of this
process the value is copied (JAX's C++ per-device copy between one-device
ranks, else `jax.device_put`). Between processes it goes through the job's
cross-process transport: the producer's process sends and the consumer's
receives when their walk of the one issue order every process follows reaches
the consuming cell, so the two-sided transport pairs them in the same order
on both sides. One transfer group per round, group and link, numbered
identically on every process (each allocates the groups of every
cross-process link, in the same order); each process issues only its own
ranks' cells.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import SingleDeviceSharding

from ..._comm import transfer
from ...errors import MpmdError
from ..gather import _first_device, _transport
from .stages import StageLayout


@dataclass(frozen=True)
class Link:
    """Into one stage: `copy` (both ranks in this process, not the same rank), or the process `src`
    that makes the value and the process `dst` that uses it when they differ (`cross`)."""

    copy: Callable | None
    src: int
    dst: int
    source: jax.sharding.Sharding
    target: jax.sharding.Sharding

    @property
    def cross(self) -> bool:
        return self.src != self.dst


def _process_of(sharding, stage: int) -> int:
    owners = {d.process_index for d in sharding.device_set}
    if len(owners) != 1:
        raise MpmdError(
            f"generate: stage {stage}'s rank spans processes {sorted(owners)}; a pipeline rank's devices "
            "must belong to one process (build the mesh with each process's devices on its own ranks)."
        )
    return owners.pop()


def _mover(src, dst) -> Callable:
    """`x -> x on dst` for an array or a tuple of them: JAX's C++ per-device copy between one-device
    ranks (where the layout cannot differ), else `jax.device_put` (which also re-lays out an output
    the stage left sharded)."""
    if not (len(src.device_set) == 1 and len(dst.device_set) == 1):
        return lambda x: jax.device_put(x, dst)
    copies: dict[int, Callable] = {}  # one copy per number of arrays moved together

    def move(x):
        leaves, tree = jax.tree.flatten(x)
        if len(leaves) not in copies:
            copies[len(leaves)] = transfer([src] * len(leaves), [dst] * len(leaves))
        return jax.tree.unflatten(tree, copies[len(leaves)](*leaves))

    return move


def make_links(layout: StageLayout, n_stages: int) -> tuple[Link, ...]:
    """`links[s]`: how stage s's input arrives (stage 0's: the last stage's token)."""
    me, out = jax.process_index(), []
    for s in range(n_stages):
        prev = (s - 1) % n_stages
        source, target = layout.sharding(prev), layout.sharding(s)
        src, dst = _process_of(source, prev), _process_of(target, s)
        local = src == dst == me and layout.ranks[prev] != layout.ranks[s]
        out.append(Link(_mover(source, target) if local else None, src, dst, source, target))
    return tuple(out)


class Transfers:
    """The cross-process moves of generations: transfer groups per `(groups, round, group, stage)`,
    allocated up to the longest generation so far, and one group per process for the final tokens."""

    def __init__(self, links: tuple[Link, ...]):
        self.links, (self.transport, self.exchange) = links, _transport()
        self.ids: dict[tuple, int] = {}
        self.rounds: dict[int, int] = {}
        self.owner = links[0].src  # the last stage's process, which holds the tokens
        self.result = {
            p: self.transport.new_group(f"generated tokens for process {p}", self.owner)
            for p in range(jax.process_count())
            if p != self.owner
        }

    def begin(self, groups: int, rounds: int) -> None:
        """Start a generation of `rounds` rounds of `groups` groups (same call on every process)."""
        for t in range(self.rounds.get(groups, 0), rounds):
            for i in range(groups):
                for s, link in enumerate(self.links):
                    if link.cross:
                        what = f"generation round {t}, group {i}, input of stage {s}"
                        self.ids[groups, t, i, s] = self.transport.new_group(what, link.src)
        self.rounds[groups] = max(rounds, self.rounds.get(groups, 0))
        self.transport.begin()

    def send(self, key: tuple, x) -> None:
        """Send `x` (an array or a tuple of them) into the stage of `key`."""
        link, leaves = self.links[key[-1]], jax.tree.leaves(x)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=link.target) for a in leaves]
        self.transport.send_step(self.ids[key], link.dst, [link.source] * len(leaves), specs)(*leaves)

    def receive(self, key: tuple, spec):
        """The value sent into the stage of `key`, shaped as `spec` (a `ShapeDtypeStruct` or a tuple)."""
        link, (specs, tree) = self.links[key[-1]], jax.tree.flatten(spec)
        specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=link.target) for a in specs]
        got = self.transport.recv_step(self.ids[key], link.src, [link.source] * len(specs), specs)()
        return jax.tree.unflatten(tree, list(got))

    def finish(self, tokens, shape) -> jax.Array:
        """The tokens on every process: the last stage's process sends them to each other one."""
        me, home = jax.process_index(), SingleDeviceSharding(_first_device(self.owner))
        if me == self.owner:
            tokens = jax.device_put(tokens, home)
            for p, group in self.result.items():
                spec = jax.ShapeDtypeStruct(
                    shape, tokens.dtype, sharding=SingleDeviceSharding(_first_device(p))
                )
                self.transport.send_step(group, p, [home], [spec])(tokens)
        else:
            spec = jax.ShapeDtypeStruct(shape, jnp.int32, sharding=SingleDeviceSharding(_first_device(me)))
            tokens = self.transport.recv_step(self.result[me], self.owner, [home], [spec])()[0]
        self.transport.end()
        self.exchange.allgather("generated")  # a sender's arrays stay posted until every receiver has them
        return tokens
