"""`StagesArray`: one array held on a chosen set of pipeline ranks, one shard per rank.

A container for values that live on several ranks at once (a tied embedding, a
per-rank statistic): shards share one shape and dtype and are keyed by rank.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclass(frozen=True)
class StagesArray:
    """`shards`: `{rank: jax.Array}`, all of one shape and dtype; `replicated`: the shards hold
    one value (a hint for reductions, not checked)."""

    shards: Mapping[int, jax.Array]
    replicated: bool = field(default=False)

    def __post_init__(self) -> None:
        if not self.shards:
            raise ValueError("StagesArray: needs at least one shard, got none.")
        shards = {int(k): v for k, v in sorted(self.shards.items())}
        object.__setattr__(self, "shards", shards)
        arrays = [v for v in shards.values() if hasattr(v, "shape")]
        if len({tuple(a.shape) for a in arrays}) > 1:
            raise ValueError(
                f"StagesArray: shards must share one shape; got {[tuple(a.shape) for a in arrays]}."
            )
        if len({a.dtype for a in arrays}) > 1:
            raise ValueError(f"StagesArray: shards must share one dtype; got {[a.dtype for a in arrays]}.")

    @property
    def mpmd_idxs(self) -> frozenset[int]:
        """The ranks holding a shard."""
        return frozenset(self.shards)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(next(iter(self.shards.values())).shape)

    @property
    def dtype(self) -> Any:
        return next(iter(self.shards.values())).dtype

    @property
    def process_index(self) -> int:
        return jax.process_index()

    @property
    def local_shards(self) -> dict[int, jax.Array]:
        """The shards whose devices belong to this process."""
        return {k: v for k, v in self.shards.items() if _is_local(v)}

    @property
    def remote_mpmd_idxs(self) -> frozenset[int]:
        """The ranks whose shard lives in another process."""
        return self.mpmd_idxs - frozenset(self.local_shards)

    @property
    def partially_addressable(self) -> bool:
        return bool(self.remote_mpmd_idxs)

    def __len__(self) -> int:
        return len(self.shards)

    def __iter__(self) -> Iterator[jax.Array]:
        """The shards in rank order."""
        return iter(self.shards.values())

    def __getitem__(self, mpmd_idx: int) -> jax.Array:
        if mpmd_idx not in self.shards:
            raise KeyError(f"StagesArray: no shard on rank {mpmd_idx}; ranks {sorted(self.shards)}.")
        return self.shards[mpmd_idx]

    def __contains__(self, mpmd_idx: object) -> bool:
        return mpmd_idx in self.shards

    def with_shard(self, mpmd_idx: int, array: jax.Array) -> StagesArray:
        """A copy with rank `mpmd_idx`'s shard set to `array` (same shape and dtype)."""
        if tuple(array.shape) != self.shape or array.dtype != self.dtype:
            raise ValueError(
                f"StagesArray.with_shard: got {array.dtype}{list(array.shape)}, "
                f"expected {self.dtype}{list(self.shape)}."
            )
        return StagesArray({**self.shards, int(mpmd_idx): array}, self.replicated)

    def to_local_array(self) -> jax.Array:
        """The one shard (an error when there are several)."""
        if len(self.shards) != 1:
            raise ValueError(
                f"StagesArray.to_local_array: needs exactly one shard; has {len(self.shards)} on "
                f"ranks {sorted(self.shards)}."
            )
        return next(iter(self.shards.values()))

    def reduce_sum(self) -> jax.Array:
        """The sum of the shards, computed on the host."""
        return jnp.asarray(sum(np.asarray(jax.device_get(v)) for v in self.shards.values()))

    def replicated_value(self) -> jax.Array:
        """Any shard of a `replicated=True` array."""
        if not self.replicated:
            raise ValueError("StagesArray.replicated_value: needs StagesArray(..., replicated=True).")
        return next(iter(self.shards.values()))


def _is_local(value: Any) -> bool:
    devices = getattr(value, "devices", None)
    return devices is None or all(d.process_index == jax.process_index() for d in devices())


jax.tree_util.register_pytree_node(
    StagesArray,
    lambda a: (tuple(a.shards.values()), (tuple(a.shards), a.replicated)),
    lambda aux, leaves: StagesArray(dict(zip(aux[0], leaves)), aux[1]),
)


def abstract_stages_array(
    shape: tuple[int, ...], dtype: Any, mpmd_idxs: Any, *, replicated: bool = False
) -> StagesArray:
    """A `StagesArray` of zeros of `shape` and `dtype` on each rank of `mpmd_idxs`."""
    ranks = sorted({int(i) for i in mpmd_idxs})
    return StagesArray({r: jnp.zeros(shape, dtype) for r in ranks}, replicated)
