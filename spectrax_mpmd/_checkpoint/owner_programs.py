"""Each rank's leaves of `init(key)` made by compiled programs on that rank's devices.

Per device set (a rank's submesh, where `owners.kept_shardings` keeps its leaves) the
equations of `init`'s jaxpr that the set's leaves need, compiled with `jax.jit` with those
leaves' shardings as `out_shardings`, so each device keeps only its own share. A parameter
`init` stacks over blocks is computed on the rank's rows alone (`_trace.rows`): a rank
draws its own blocks, not every rank's, and its program takes its rows' starts as an
argument. A device set's leaves sliced from such stacks and its other leaves (an
embedding, a head) are made by two programs, so that ranks keeping the same rows'
shapes run one program for their blocks whatever else they keep: the first rank's
embedding does not make its blocks' program another compile. The programs go through
the stage programs' `Compiler`: distinct ones compile concurrently, and one that is the
same program on other devices is compiled once and loaded there.

The values are those of `jax.jit(init)(key)` on one device: the same equations compiled
by XLA, each random draw's hash written out with the same bits (`_trace.draws`: no loop to
compile per draw). JAX's PRNG gives the same bits however its output is sharded
(`jax_threefry_partitionable`, on by default), and elementwise arithmetic is exact per
element; only an init that reduces across a sharded axis could round differently.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from .._compile.compiler import CellSpec, Compiler
from .._optim import remote_array
from .._trace.rows import plan, rows_program


def groups(shardings: Sequence) -> dict[tuple[int, ...], list[int]]:
    """Leaf indices by the device set they are kept on (ids sorted), in leaf order."""
    found: dict[tuple[int, ...], list[int]] = {}
    for k, sh in enumerate(shardings):
        found.setdefault(tuple(sorted(d.id for d in sh.device_set)), []).append(k)
    return found


def replicated(sharding) -> NamedSharding:
    """A sharding replicating a value over `sharding`'s devices (on its mesh where it has one)."""
    if isinstance(sharding, NamedSharding):
        return NamedSharding(sharding.mesh, PartitionSpec())
    devices = sorted(sharding.device_set, key=lambda d: d.id)
    return NamedSharding(Mesh(np.array(devices), ("devices",)), PartitionSpec())


def rank_program(closed, key_leaves: Sequence, shardings: Sequence, outputs: Sequence[int]) -> tuple:
    """`(the program making closed's outputs `outputs` on their `shardings` from the row offsets and
    the key's leaves, replicated over those devices; the offsets to call it with)`."""
    on = replicated(shardings[outputs[0]])
    fn, offsets = rows_program(closed, outputs)
    starts = np.asarray(offsets, np.int32)
    in_specs = tuple(jax.ShapeDtypeStruct(np.shape(x), x.dtype, sharding=on) for x in (starts, *key_leaves))
    return CellSpec(fn, in_specs, tuple(shardings[k] for k in outputs)), starts


def by_offsets(closed, outputs: Sequence[int]) -> list[list[int]]:
    """`outputs` parted into those sliced from stacked values at an offset (rows a program
    takes the start of as an argument) and the rest, leaving out an empty part."""
    sliced = plan(closed, outputs).sliced
    parts = [[k for k, s in zip(outputs, sliced) if s], [k for k, s in zip(outputs, sliced) if not s]]
    return [part for part in parts if part]


def rank_programs(closed, key, shardings: Sequence) -> list[tuple]:
    """Per device set of this process holding leaves, per part of them (`by_offsets`): `(the
    leaf indices, their program, the row offsets to call it with)`."""
    key_leaves = jax.tree.leaves(key)
    return [
        (part, *rank_program(closed, key_leaves, shardings, part))
        for idx in groups(shardings).values()
        if shardings[idx[0]].is_fully_addressable
        for part in by_offsets(closed, idx)
    ]


def make_leaves(
    closed, key, shardings: Sequence, abstract: Sequence, compiler: Compiler | None = None, programs=None
) -> list:
    """The flat outputs of `closed` (the jaxpr of `make(key)`), each made on `shardings[k]` by its
    device set's compiled program (taken from `compiler` where it compiled them already;
    `programs`: their `rank_programs` for these shardings, where built already); leaves of
    another process's devices are global arrays without local shards here."""
    out: list = [None] * len(shardings)
    for k, sh in enumerate(shardings):
        if not sh.is_fully_addressable:
            spec = abstract[k]
            out[k] = remote_array(jax.ShapeDtypeStruct(spec.shape, spec.dtype, sharding=sh))
    programs = rank_programs(closed, key, shardings) if programs is None else programs
    compiler = Compiler() if compiler is None else compiler
    compiler.prefetch([spec for _, spec, _ in programs])
    for idx, spec, starts in programs:
        args = (starts, *jax.tree.leaves(key))
        placed = [jax.device_put(x, s.sharding) for x, s in zip(args, spec.in_specs)]
        for k, x in zip(idx, compiler.compile_spec(spec)(*placed)):
            out[k] = x
    return out
