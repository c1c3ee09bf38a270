"""Where generation's stages run, and the check that new weights are the same staged model."""

from __future__ import annotations

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
