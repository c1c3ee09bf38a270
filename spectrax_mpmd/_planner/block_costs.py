"""Each block's cells and bytes measured on a pipeline rank of k devices, for the device split.

A rank of k devices runs its stage's program partitioned over its own submesh (the
step's `rules` resolve against it), so what a block costs there is measured on that
program: the model cut at every block, all blocks on one rank of k devices (each
block a stage of its own: `per_block_schedule`, which `balance` profiles on too),
profiled once per k. Per block this gives its forward and backward cells' seconds,
their FLOPs on one device, the bytes it keeps per microbatch and what its rank
holds for the whole step on one device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from spectrax_core import schedules as S
from spectrax_core.schedules import StageMemory

from .._api import step_function
from .._compile.compiler import Compiler
from .._mesh import MpmdMesh, create_mesh, mesh_of_ranks
from .._runtime.slots import GradAccumulator, Input, InputKind, LossAccumulator, MicrobatchIndex
from .._settings import StepSettings
from ..errors import MeshError

COST_MODELS = ("measured", "work")


@dataclass(frozen=True)
class BlockCosts:
    """Per device count `k` of `sizes`: each block's forward and backward seconds per microbatch
    as measured (`F[k]`, `B[k]`), its cells' FLOPs on one device (`flops[k]`), what its rank would hold
    for the whole step on one device (`params[k]`, `accumulators[k]`, `other[k]`:
    `block_bytes`), the per-block profile's bytes (`memory[k]`, block b its stage b, all on
    one rank), and the fixed seconds of one cell on the fewest devices (`overhead_s`)."""

    sizes: tuple[int, ...]
    F: Mapping[int, tuple[float, ...]]
    B: Mapping[int, tuple[float, ...]]
    flops: Mapping[int, tuple[float, ...]]
    params: Mapping[int, tuple[int, ...]]
    accumulators: Mapping[int, tuple[int, ...]]
    other: Mapping[int, tuple[int, ...]]
    memory: Mapping[int, StageMemory]
    overhead_s: float = 0.0

    @property
    def blocks(self) -> int:
        return len(self.F[self.sizes[0]])

    def cells(self, cost_model: str) -> tuple[dict, dict]:
        """`(F, B)`, each `k -> seconds per block`: as measured on k devices (`"measured"`), or
        (`"work"`) the seconds measured on the fewest devices profiled, less a cell's fixed cost
        `overhead_s`, scaled by the block's FLOPs on one device of k over those on that count,
        plus that fixed cost (a cell faster than it, or none, is kept as is): what k devices
        would take if each ran its share of the work as fast as the fewest do (separate
        accelerators)."""
        check_cost_model(cost_model)
        if cost_model == "measured":
            return dict(self.F), dict(self.B)
        base, o = self.sizes[0], self.overhead_s

        def scaled(table, k):
            ratio = [w / max(w0, 1.0) for w, w0 in zip(self.flops[k], self.flops[base])]
            return tuple(min(t, o) + max(t - o, 0.0) * r for t, r in zip(table[base], ratio))

        forward, backward = ({k: scaled(table, k) for k in self.sizes} for table in (self.F, self.B))
        return forward, backward

    def seconds(self, cost_model: str) -> dict[int, tuple[float, ...]]:
        """`k -> each block's forward plus backward seconds per microbatch` under `cost_model`."""
        forward, backward = self.cells(cost_model)
        return {k: tuple(f + b for f, b in zip(forward[k], backward[k])) for k in self.sizes}


def per_block_schedule(microbatches: int, n_blocks: int):
    """The schedule of the per-block profile: every block a stage on one rank, each cell alone."""
    if n_blocks == 1:
        return S.GPipe(microbatches=microbatches)
    return S.InterleavedGPipe(microbatches=microbatches, virtual_stages=n_blocks)


def fixed_cell_seconds(profile) -> float:
    """The fixed cost of one cell: the intercept of a least-squares line through the profile's
    forward and backward cells' measured seconds against XLA's FLOP counts, kept within
    [0, the fastest cell]."""
    cells = [c for c in profile.cells if c.kind in ("F", "B") and c.seconds is not None]
    if len(cells) < 3:
        return 0.0
    flops = np.array([c.flops for c in cells])
    seconds = np.array([c.seconds for c in cells])
    if np.ptp(flops) == 0:
        return 0.0
    slope, intercept = np.polyfit(flops, seconds, 1)
    return float(min(max(intercept, 0.0), seconds.min()))


def check_cost_model(cost_model) -> None:
    if cost_model not in COST_MODELS:
        raise ValueError(
            f"cost_model must be one of {COST_MODELS} (the seconds as measured on k devices, or the "
            f"measured seconds scaled by the FLOPs per device), received {cost_model!r}."
        )


def rank_mesh(mesh: MpmdMesh, k: int, axis: str) -> MpmdMesh:
    """A mesh of one pipeline rank of `k` of `mesh`'s devices, along its SPMD axis `axis` (every
    other axis of size 1): the submesh a stage given k devices runs on."""
    check_rank_mesh(mesh, (k,), axis)
    dims = tuple(k if n == axis else 1 for n in mesh.axis_names)
    return create_mesh(dims, mesh.axis_names, mpmd_axis=mesh.mpmd_axis, devices=list(mesh.devices.flat)[:k])


def rank_meshes(mesh: MpmdMesh) -> dict[int, MpmdMesh]:
    """Each rank size of `mesh` -> a mesh of its first rank of that size alone: where blocks are
    profiled for the ranks of that size (which must share their axes and shape)."""
    meshes: dict = {}
    for r, sub in enumerate(mesh.unstack()):
        first = meshes.setdefault(sub.size, mesh_of_ranks([sub], mpmd_axis=mesh.mpmd_axis))
        if dict(first.submesh(0).shape) != dict(sub.shape):
            raise MeshError(
                f"balance: ranks of {sub.size} devices have different shapes ({dict(first.submesh(0).shape)} "
                f"and rank {r}'s {dict(sub.shape)}), and blocks are profiled once per rank size; give ranks "
                "of one size the same axes, or give the stage sizes yourself."
            )
    return meshes


def check_rank_mesh(mesh: MpmdMesh, sizes: Sequence[int], axis: str) -> None:
    """Raise unless `mesh` has the SPMD axis `axis` and devices for a rank of each of `sizes`."""
    if axis not in mesh.axis_names or axis == mesh.mpmd_axis:
        spmd = tuple(n for n in mesh.axis_names if n != mesh.mpmd_axis)
        raise MeshError(f"device_axis must be one of the mesh's SPMD axes {spmd}, received {axis!r}.")
    if max(sizes) > mesh.devices.size:
        raise MeshError(
            f"device_sizes: a rank of {max(sizes)} devices needs more than the mesh's {mesh.devices.size}; "
            "profile on a mesh of all the devices to split."
        )


def _device_bytes(sharding, shape, dtype) -> int:
    return int(math.prod(sharding.shard_shape(tuple(shape)))) * np.dtype(dtype).itemsize


def block_bytes(plan, args: Sequence, n_blocks: int) -> dict[str, tuple[int, ...]]:
    """Per block (stage of the per-block plan, all on one rank), the bytes on one device its rank
    would hold for the whole step were it a rank of its own: `params` (the parameter leaves its
    cells read), `accumulators` (its gradient and loss accumulators) and `other` (the other
    argument leaves its cells read, and the microbatch indices)."""
    leaves = jax.tree.leaves(tuple(args))
    held = dict(zip(plan.input_keys, plan.input_shardings))
    out = {name: [0] * n_blocks for name in ("params", "accumulators", "other")}
    read: set = set()
    for step, starts in plan.forward_steps.items():
        for stage, _ in starts:
            read |= {(stage, key) for key in map(plan.slot_names.get, plan.steps[step][1])}
    for stage, key in read:
        if isinstance(key, Input):
            sharding = next(sh for (_, k), sh in held.items() if k == key)
            leaf = leaves[key.leaf]
            name = "params" if key.kind == InputKind.PARAM else "other"
            out[name][stage] += _device_bytes(sharding, np.shape(leaf), leaf.dtype)
        elif isinstance(key, MicrobatchIndex):
            out["other"][stage] += np.dtype(np.int32).itemsize
    for slot, value in plan.accumulator_starts():
        key = plan.slot_names.get(slot)
        if isinstance(key, (GradAccumulator, LossAccumulator)):
            out["accumulators"][key.stage] += _device_bytes(value.sharding, value.shape, value.dtype)
    return {name: tuple(v) for name, v in out.items()}


def profile_blocks(
    loss: Callable,
    args: tuple,
    settings: StepSettings,
    n_blocks: int,
    on: dict,
    rounds: int,
) -> BlockCosts:
    """`BlockCosts` of `loss` cut at each of its `n_blocks` blocks (a marker after each), on
    `args`, trained with `settings`, on a rank of each of `on["sizes"]` devices along
    `on["axis"]` of `settings.mesh` (or, given `on["meshes"]`, on its one-rank mesh of each
    size: `rank_meshes`), with `settings.schedule`'s microbatches."""
    mesh, per_block = settings.pipeline_mesh, per_block_schedule(settings.schedule.microbatches, n_blocks)
    table: dict = {name: {} for name in ("F", "B", "flops", "params", "accumulators", "other", "memory")}
    overhead = 0.0
    for k in on["sizes"]:
        rank = on["meshes"][k] if "meshes" in on else rank_mesh(mesh, k, on["axis"])
        step = step_function(loss, settings.replace(mesh=rank, schedule=per_block), compiler=Compiler())
        profile = step.profile_stages(*args, rounds=rounds)
        cost = profile.stage_cost()
        work = [0.0] * n_blocks
        for cell in profile.cells:
            work[cell.stage] += cell.flops
        table["F"][k], table["B"][k], table["flops"][k] = cost.F, cost.B, tuple(work)
        for name, values in block_bytes(step.plan_for(*args), args, n_blocks).items():
            table[name][k] = values
        table["memory"][k] = profile.memory
        if k == on["sizes"][0]:  # the work model scales from the fewest devices' cells
            overhead = fixed_cell_seconds(profile)
    return BlockCosts(tuple(on["sizes"]), **table, overhead_s=overhead)
