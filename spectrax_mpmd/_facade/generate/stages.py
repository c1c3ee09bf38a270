"""Each stage's share of a staged LM, placed on its rank once.

A stage's view is the LM with every field the stage does not run set to None:
the first stage keeps the embedding, the last the final norm and head (and the
embedding too when the head is tied to it), every stage its own blocks. A leaf
already on its rank's devices (as a pipelined training step leaves it) is used
as it is; any other leaf is copied there once.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import jax
from jax.sharding import NamedSharding, PartitionSpec

from ..._mesh import MpmdMesh
from ..._stages import StagedStack
from ...errors import MpmdError


@dataclass(frozen=True)
class StageLayout:
    """Where the stages run: `ranks[s]` holds stage `s`; `shardings[r]` replicates over rank r's devices."""

    ranks: tuple[int, ...]
    shardings: tuple[NamedSharding, ...]

    @classmethod
    def of(cls, mesh: MpmdMesh, n_stages: int, schedule=None) -> StageLayout:
        n = mesh.mpmd_dim
        ranks = tuple(s if schedule is None else schedule.rank_of(s, n) for s in range(n_stages))
        shardings = tuple(NamedSharding(mesh.submesh(r), PartitionSpec()) for r in range(n))
        return cls(ranks, shardings)

    def sharding(self, stage: int) -> NamedSharding:
        return self.shardings[self.ranks[stage]]


def local_stages(layout: StageLayout, n_stages: int) -> tuple[bool, ...]:
    """Whether this process holds stage s's rank."""
    me = jax.process_index()
    return tuple(all(d.process_index == me for d in layout.sharding(s).device_set) for s in range(n_stages))


def stage_views(lm) -> tuple:
    """One view of the staged `lm` (blocks a `StagedStack`) per stage."""
    parts = lm.blocks.parts
    last, tied = len(parts) - 1, lm.head is None
    return tuple(
        dataclasses.replace(
            lm,
            embed=lm.embed if s == 0 or (s == last and tied) else None,
            blocks=part,
            norm=lm.norm if s == last else None,
            head=lm.head if s == last else None,
        )
        for s, part in enumerate(parts)
    )


def place_views(views: tuple, layout: StageLayout) -> tuple:
    """`views` with every leaf on its stage's rank: leaves already there kept, the rest copied in one
    call (the views of another process's stages are left as they are: that process runs them)."""
    moves, targets = [], []
    flat = [jax.tree.flatten(v) for v in views]
    mine = local_stages(layout, len(views))
    for s, (leaves, _) in enumerate(flat):
        if not mine[s]:
            continue
        devices = layout.sharding(s).device_set
        for k, leaf in enumerate(leaves):
            if not (isinstance(leaf, jax.Array) and leaf.sharding.device_set == devices):
                moves.append((s, k))
                targets.append((leaf, layout.sharding(s)))
    if moves:
        placed = jax.device_put([t[0] for t in targets], [t[1] for t in targets])
        for (s, k), leaf in zip(moves, placed):
            flat[s][0][k] = leaf
    return tuple(jax.tree.unflatten(treedef, leaves) for leaves, treedef in flat)


def _signature(tree) -> tuple:
    return jax.tree.structure(tree), [(x.shape, x.dtype) for x in jax.tree.leaves(tree)]


def same_model(old, new) -> bool:
    """Whether `new` is staged like `old` with the same structure, shapes and dtypes."""
    staged = isinstance(new.blocks, StagedStack) and new.blocks.sizes == old.blocks.sizes
    return staged and _signature(old) == _signature(new)


def check_same_model(old, new) -> None:
    """Raise unless `new` has `old`'s structure, shapes and dtypes (new weights, same model)."""
    if not isinstance(new.blocks, StagedStack) or new.blocks.sizes != old.blocks.sizes:
        raise MpmdError(
            "PipelineDecoder.update: params must be staged like the decoder's model "
            f"(blocks per stage {old.blocks.sizes}); pass the params the pipelined step returned, or "
            "build a new PipelineDecoder for another model."
        )
    if _signature(old) != _signature(new):
        raise MpmdError(
            "PipelineDecoder.update: params differ from the decoder's model in structure, shapes or "
            "dtypes; update takes new values of the same model. Build a new PipelineDecoder for another one."
        )
