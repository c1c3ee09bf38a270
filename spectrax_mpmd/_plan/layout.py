"""Where a plan's stages run and how each value is laid out there."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_core.schedules import Schedule

from .._mesh import MpmdMesh
from .._runtime.slots import CellKind
from .._trace.graph import StageGraph
from .._trace.weights import LossWeights
from ..errors import MeshError
from .copies import copy_stages

REPLICATED = PartitionSpec()


class StageOrder:
    """The layout used when a forward call has no schedule: stage s on rank s, one microbatch."""

    microbatches = 1
    virtual_stages = 1

    def rank_of(self, stage: int, n: int) -> int:
        return stage


@dataclass(frozen=True)
class PlanArgs:
    """What the call's arguments are: differentiated parameter leaves, batch leaves (split into
    microbatches, with their whole-batch avals), PRNG keys folded per microbatch, donated
    leaves, parameter PartitionSpecs (`(leaf, rank) -> spec`), how microbatch losses are weighed
    (`LossWeights`), what each model stage
    keeps for its backward (`remat`: one value or one per model stage; `offload`: one `Offload` per
    model stage, empty for none; see `spectrax_mpmd._trace.policy`), and the program run on
    the gradients after the backward (an `Epilogue`; None: the gradients are the results)."""

    params: tuple = ()
    batch: tuple = ()
    batch_avals: dict = field(default_factory=dict)
    keys: frozenset = frozenset()
    donated: frozenset = frozenset()
    param_specs: dict = field(default_factory=dict)
    weights: LossWeights = LossWeights()
    remat: bool | str | tuple = False
    offload: tuple = ()
    epilogue: object = None


@dataclass(frozen=True, eq=False)
class Layout:
    """Stage `s` runs on rank `ranks[s]`'s submesh of `mesh`; `m` microbatches. `graph` holds the
    schedule's logical stages (`copy_stages`); logical stage `s` runs model stage `model[s]`."""

    graph: StageGraph
    schedule: Schedule
    mesh: MpmdMesh
    ranks: tuple
    m: int
    param_specs: dict
    unsharded: bool  # nothing in the pipeline is sharded: every intermediate is replicated
    model: tuple = ()

    @classmethod
    def of(cls, graph: StageGraph, schedule, mesh: MpmdMesh, args: PlanArgs, microbatches: int) -> "Layout":
        n = mesh.mpmd_dim
        graph, model = copy_stages(graph, schedule, n)
        unsharded = not any(spec is not None for spec in args.param_specs.values()) and all(
            e.spec is None for e in graph.edges
        )
        ranks = tuple(schedule.rank_of(s, n) for s in range(len(graph.stages)))
        if not mesh.uniform:
            check_rank_shapes(graph, model, ranks, mesh)
        return cls(graph, schedule, mesh, ranks, microbatches, args.param_specs, unsharded, model)

    @functools.cached_property
    def edge_index(self) -> dict:
        """Each edge's position in the graph's edge list."""
        return {e: k for k, e in enumerate(self.graph.edges)}

    @property
    def n(self) -> int:
        return self.mesh.mpmd_dim

    @property
    def last(self) -> int:
        """The last logical stage: a loss stage, where the loss of every microbatch is gathered."""
        return len(self.graph.stages) - 1

    def is_loss(self, s: int) -> bool:
        """Whether stage `s` computes the loss (runs the model's last stage)."""
        return self.model[s] == self.model[self.last]

    @property
    def loss_stages(self) -> tuple[int, ...]:
        return tuple(s for s in range(len(self.graph.stages)) if self.is_loss(s))

    def splits(self) -> bool:
        """Whether the schedule splits backwards into I and W cells."""
        if not hasattr(self.schedule, "actions"):
            return False
        return any(
            p.kind in (CellKind.INPUT_GRAD, CellKind.WEIGHT_GRAD)
            for rank in self.schedule.actions(self.n)
            for a in rank
            for p in a.parts
        )

    def batch_leaf(self, a: int, i: int) -> int:
        """The flat leaf microbatch `i` reads for batch leaf `a`: the whole-batch leaf itself (the
        cell slices its rows; `spectrax_mpmd._plan.buckets` gives each microbatch leaves of its own)."""
        return a

    def submesh(self, s: int):
        return self.mesh.submesh(self.ranks[s])

    def named(self, s: int, spec) -> NamedSharding:
        """A sharding on stage `s`'s submesh (`None`: replicated)."""
        return self.on_rank(self.ranks[s], spec)

    def on_rank(self, rank: int, spec) -> NamedSharding:
        """A sharding on pipeline rank `rank`'s submesh (`None`: replicated)."""
        return NamedSharding(self.mesh.submesh(rank), spec if spec is not None else REPLICATED)

    def param_spec(self, a: int, rank: int):
        """Parameter leaf `a`'s PartitionSpec on pipeline rank `rank` (None: replicated)."""
        return self.param_specs.get((a, rank))

    def param(self, a: int, s: int) -> NamedSharding:
        """Parameter leaf `a` as stage `s` reads it."""
        return self.named(s, self.param_spec(a, self.ranks[s]))

    def output(self, var, s: int) -> NamedSharding:
        """Stage `s`'s output `var` as it is made: the spec of its edge to a stage on the same
        rank, else of its first edge."""
        edges = [e for e in self.graph.edges if e.var is var and e.src == s]
        same_rank = [e for e in edges if self.ranks[e.dst] == self.ranks[s]]
        return self.named(s, (same_rank or edges)[0].spec)

    def edge(self, e) -> NamedSharding:
        """Edge `e`'s value as its consumer reads it."""
        return self.named(e.dst, e.spec)

    def free(self, s: int) -> NamedSharding | None:
        """The sharding of stage `s`'s residuals and stash, when it is known before compiling.

        On a one-device submesh, or when nothing in the pipeline is sharded, every
        intermediate is replicated, so backward cells can be compiled alongside the
        forward ones; otherwise (None) XLA picks and the forward is compiled first.
        """
        return self.named(s, None) if self.unsharded or self.submesh(s).size == 1 else None

    def accumulator_aval(self, a):
        """The accumulator of parameter leaf `a` (or of the loss, `a="loss"`): float32 for 16-bit
        floats, so summing microbatches adds no rounding beyond the reference's."""
        aval = self.graph.out_avals[0] if a == "loss" else self.graph.in_avals[a]
        if jnp.dtype(aval.dtype).itemsize < 4 and jnp.issubdtype(aval.dtype, jnp.floating):
            return aval.update(dtype=jnp.float32)
        return aval


def check_rank_shapes(graph: StageGraph, model: tuple, ranks: tuple, mesh: MpmdMesh) -> None:
    """On ranks of different shapes: every axis a stage boundary's sharding names is on both sides'
    submeshes, and a model stage run on several ranks (a schedule's copies) runs on equal ones."""
    for e in graph.edges:
        named = {a for entry in (e.spec or ()) for a in (entry if isinstance(entry, tuple) else (entry,))}
        for s in (e.src, e.dst):
            sub = mesh.submesh(ranks[s])
            lacks = sorted(named - {None, *sub.axis_names})
            if lacks:
                raise MeshError(
                    f"mesh: the value crossing stages {e.src} -> {e.dst} is sharded as {e.spec}, naming "
                    f"{lacks}, which stage {s}'s rank {ranks[s]} (submesh {dict(sub.shape)}) lacks; give "
                    "that rank the axis (size 1 is fine, e.g. {'fsdp': 1}) or name only axes every rank has."
                )
    seen: dict = {}
    for s, rank in enumerate(ranks):
        sub = mesh.submesh(rank)
        first = seen.setdefault(model[s], (rank, dict(sub.shape)))
        if first[1] != dict(sub.shape):
            raise MeshError(
                f"mesh: model stage {model[s]} runs on rank {first[0]} {first[1]} and on rank {rank} "
                f"{dict(sub.shape)}; a stage the schedule runs on several ranks needs equal submeshes "
                "there. Give those ranks one shape, or use a schedule that places each stage once."
            )
