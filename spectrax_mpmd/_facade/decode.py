"""Pipelined greedy decoding: each rank keeps its own blocks and their KV caches.

The LM's blocks are cut into stages (`stage_blocks`); one `sxjit` program per
stage runs a prefill or a one-token step. A stage's KV caches are read and
written by that stage only, so they are placed on its rank once and never
move; only the residual stream of the new tokens crosses ranks.

A cache write past `max_len` would be clamped inside the compiled program, so
the decoder checks the lengths on the host before each step: it remembers how
many positions each cache it made or returned holds (a cache it has not seen
is asked once, by reading its index).
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence

import jax
import numpy as np
from jaxtyping import Array

from spectrax_core import apply
from spectrax_core.models import greedy_decode, init_cache
from spectrax_core.nn import KVCache

from .._api import sxjit
from .._mesh import as_mpmd_mesh
from .._stages import stage_blocks
from ..errors import MpmdError


def _decode_step(lm, tokens, cache):
    return apply(lm, tokens, cache=cache)


class PipelineDecoder:
    """Prefill and token-by-token decoding of a core LM (e.g. `TransformerLM`) across pipeline ranks."""

    def __init__(self, lm, *, mesh, schedule=None, stage_sizes: Sequence[int] | None = None):
        mesh = as_mpmd_mesh(mesh)
        v = schedule.virtual_stages if schedule is not None else 1
        self.lm = stage_blocks(lm, mesh.mpmd_dim * v, stage_sizes)
        self._step = sxjit(_decode_step, mesh=mesh, schedule=schedule, donate_argnums=2)
        self._written: dict[int, tuple[weakref.ref, int]] = {}  # id(cache index) -> (its ref, positions)

    def init_cache(self, batch: int, max_len: int):
        """Empty caches, one per stage's blocks."""
        cache = init_cache(self.lm, batch, max_len)
        self._remember(cache, 0)
        return cache

    def step(self, tokens: Array, cache) -> tuple[Array, tuple]:
        """`(logits, new_cache)` for `tokens` `(batch, length)` continuing `cache` (donated).

        Raises `MpmdError` when the cache has no room for the tokens (its
        positions written plus `length` exceed its `max_len`).
        """
        written, length = self._positions(cache), np.shape(tokens)[-1]
        max_len = _first_cache(cache).max_len
        if written is not None and written + length > max_len:
            raise MpmdError(
                f"PipelineDecoder.step: the cache holds {written} positions and {length} more tokens need "
                f"{written + length}, but its max_len is {max_len}; allocate a longer cache "
                f"(init_cache(batch, max_len={written + length}) or more) or stop decoding earlier."
            )
        logits, cache = self._step(self.lm, tokens, cache)
        if written is not None:
            self._remember(cache, written + length)
        return logits, cache

    def generate(self, prompt: Array, steps: int, *, max_len: int | None = None) -> Array:
        """The `steps` greedy tokens after `prompt`, as `spectrax_core.models.greedy_decode`."""
        return greedy_decode(self.lm, prompt, steps, max_len=max_len, step=self.step)

    def _remember(self, cache, written: int) -> None:
        index = _first_cache(cache).index
        key, table = id(index), self._written
        table[key] = (weakref.ref(index, lambda _: table.pop(key, None)), written)

    def _positions(self, cache) -> int | None:
        """Positions `cache` holds: remembered, else read from its index (None if this process cannot)."""
        index = _first_cache(cache).index
        ref, written = self._written.get(id(index), (None, None))
        if ref is not None and ref() is index:
            return written
        if isinstance(index, jax.Array) and not index.is_fully_addressable:
            return None
        return int(np.max(np.asarray(index)))


def _first_cache(cache) -> KVCache:
    found = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, KVCache))
    if not found or not isinstance(found[0], KVCache):
        raise MpmdError(
            f"PipelineDecoder.step: cache must be the caches of init_cache(batch, max_len), got "
            f"{type(cache).__name__}."
        )
    return found[0]
