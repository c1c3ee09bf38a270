"""Cutting a model's blocks into pipeline stages.

`stage_sizes` decides how many blocks each stage runs. `StagedStack` is a core
params type holding one `BlockStack` per stage: its apply runs the parts in
order with a stage marker between them, so a model that applies its `blocks`
through `spectrax_core.apply` (as `TransformerLM` does) is cut between blocks
by its own forward: what runs before the blocks lands on the first stage, what
runs after on the last. Each part is its own set of leaves, so each stage's
parameters (and, when decoding, its KV caches) live on that stage's rank only.
"""

from __future__ import annotations

from collections.abc import Sequence

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array

from spectrax_core import apply, register_apply
from spectrax_core.nn import BlockStack, KVCache

from ._mesh import default_device
from ._trace.context import outside_context_mesh
from ._trace.marker import sxstage_iter
from .errors import StageSplitError


def stage_sizes(n_blocks: int, n_stages: int, sizes: Sequence[int] | None = None) -> tuple[int, ...]:
    """Blocks per stage: `sizes` checked, or an even split.

    When the blocks do not divide evenly, the stages after the first get one
    more block each, in order (the first stage also embeds, the last also
    runs the head and loss).
    """
    if sizes is not None:
        sizes = tuple(int(k) for k in sizes)
        if len(sizes) != n_stages:
            raise StageSplitError(
                f"stage_sizes={sizes} gives {len(sizes)} stages; the mesh and schedule need {n_stages} "
                "(pipeline ranks x virtual stages). Give one block count per stage."
            )
        if sum(sizes) != n_blocks or min(sizes) < 1:
            raise StageSplitError(
                f"stage_sizes={sizes} must be positive and sum to the model's {n_blocks} blocks "
                f"(sum is {sum(sizes)}); every stage needs at least one block."
            )
        return sizes
    if n_blocks < n_stages:
        raise StageSplitError(
            f"the model has {n_blocks} blocks but the mesh and schedule need {n_stages} stages; "
            "use fewer pipeline ranks or virtual stages, or a deeper model."
        )
    base, extra = divmod(n_blocks, n_stages)
    return tuple(base + (1 <= k <= extra) for k in range(n_stages))


class StagedStack(eqx.Module):
    """Blocks cut into pipeline stages: `parts[k]` is stage `k`'s `BlockStack`."""

    parts: tuple[BlockStack, ...]

    @classmethod
    def from_stack(cls, stack: BlockStack, sizes: Sequence[int]) -> StagedStack:
        """Cut `stack` into consecutive parts of `sizes` blocks."""
        bounds = [0]
        for k in sizes:
            bounds.append(bounds[-1] + k)
        return cls(parts=tuple(stack.slice(a, b) for a, b in zip(bounds, bounds[1:])))

    @property
    def n_layers(self) -> int:
        return sum(p.n_layers for p in self.parts)

    @property
    def d_model(self) -> int:
        return self.parts[0].d_model

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(p.n_layers for p in self.parts)

    def to_stack(self) -> BlockStack:
        """The blocks as one `BlockStack` again (concatenates every part's arrays on the default
        device: `spectrax_mpmd._mesh.default_device`)."""
        device = default_device()
        layers = jax.tree.map(
            lambda *xs: jnp.concatenate([jax.device_put(x, device) for x in xs]),
            *(p.layers for p in self.parts),
        )
        return BlockStack(layers=layers, n_layers=self.n_layers)

    def init_cache(self, batch: int, max_len: int, *, dtype=None) -> tuple[KVCache, ...]:
        """One stacked cache per part, so each stage's cache stays with it."""
        return tuple(p.init_cache(batch, max_len, dtype=dtype) for p in self.parts)

    def logical_axes(self) -> dict[str, tuple]:
        return {}


@register_apply(StagedStack)
def apply_staged_stack(
    params: StagedStack,
    x: Array,
    *,
    mask: Array | None = None,
    cache: Sequence[KVCache] | None = None,
    positions: Array | None = None,
):
    """Run every part in order, with a stage marker between parts (the identity outside a pipeline);
    `positions` as `BlockStack`'s."""
    new_caches = []
    for k, part in enumerate(params.parts):
        if cache is None:
            x = apply(part, x, mask=mask, positions=positions)
        else:
            x, c = apply(part, x, mask=mask, cache=cache[k], positions=positions)
            new_caches.append(c)
        if k < len(params.parts) - 1:
            x = sxstage_iter(x)
    return x if cache is None else (x, tuple(new_caches))


@outside_context_mesh
def stage_blocks(model, n_stages: int, sizes: Sequence[int] | None = None):
    """`model` with its `blocks` (a `BlockStack`) cut into `n_stages` parts (`StagedStack`).

    Stage once before training so that each rank holds only its own blocks;
    `unstage_blocks` reverses it.
    """
    blocks = _blocks_of(model)
    if isinstance(blocks, StagedStack):
        if len(blocks.parts) != n_stages or (sizes is not None and tuple(sizes) != blocks.sizes):
            blocks = StagedStack.from_stack(blocks.to_stack(), stage_sizes(blocks.n_layers, n_stages, sizes))
        else:
            return model
    else:
        blocks = StagedStack.from_stack(blocks, stage_sizes(blocks.n_layers, n_stages, sizes))
    return eqx.tree_at(lambda m: m.blocks, model, blocks)


@outside_context_mesh
def unstage_blocks(model):
    """`model` with a `StagedStack` of blocks joined back into one `BlockStack`."""
    blocks = _blocks_of(model)
    return (
        model if isinstance(blocks, BlockStack) else eqx.tree_at(lambda m: m.blocks, model, blocks.to_stack())
    )


def _blocks_of(model):
    blocks = getattr(model, "blocks", None)
    if not isinstance(blocks, (BlockStack, StagedStack)):
        raise StageSplitError(
            f"{type(model).__name__} has no `blocks` field holding a BlockStack, so its stages cannot be "
            "found. Give the model a `blocks: BlockStack` that its apply runs through "
            "`spectrax_core.apply(model.blocks, x)`, or mark the stages yourself with sxstage_iter and "
            "use sxvalue_and_grad / sxjit."
        )
    return blocks
