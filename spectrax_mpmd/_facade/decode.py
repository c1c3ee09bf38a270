"""Pipelined decoding and generation: each rank keeps its own blocks and their KV caches.

The LM's blocks are cut into stages (`stage_blocks`), whose markers cut its
decode step `spectrax_core.models.lm_step` (the model's KV caches, each
token's entry written at its sequence's own position). `generate` runs that
step through `StepDecoder`: the same traced cells, wavefront, sampling and
transfers as a user's own step; `step` runs one prefill or one-token step of a caller-held cache through
`sxjit`. Either way a stage's KV caches are read and written by that stage
only, so they are placed on its rank once and never move; only the residual
stream of the new tokens crosses ranks.

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
from spectrax_core.models import Sampler, check_generate, init_cache, lm_step
from spectrax_core.nn import KVCache

from .._api import sxjit
from .._mesh import as_mpmd_mesh
from .._stages import stage_blocks
from .._trace.context import methods_outside_context_mesh
from ..errors import MpmdError
from .generate.stages import check_same_model
from .step_decode import StepDecoder


def _decode_step(lm, tokens, cache):
    return apply(lm, tokens, cache=cache)


@methods_outside_context_mesh
class PipelineDecoder:
    """Generation and token-by-token decoding of a core LM (`TransformerLM`) across pipeline ranks.

    Built from a fresh model or from the params a pipelined training step
    returned (then each leaf is used where the step left it); `update(params)`
    takes new values of the same model without recompiling.
    """

    def __init__(self, lm, *, mesh, schedule=None, stage_sizes: Sequence[int] | None = None):
        mesh = as_mpmd_mesh(mesh)
        v = schedule.virtual_stages if schedule is not None else 1
        self.lm = stage_blocks(lm, mesh.mpmd_dim * v, stage_sizes)
        self._steps = StepDecoder(lm_step, self.lm, self._new_cache, mesh=mesh, schedule=schedule)
        self._step = sxjit(_decode_step, mesh=mesh, schedule=schedule, donate_argnums=2)
        self._written: dict[int, tuple[weakref.ref, int]] = {}  # id(cache index) -> (its ref, positions)

    def update(self, params) -> PipelineDecoder:
        """Use `params` (new values of the same model, e.g. after an optimizer step) from now on.

        Leaves already on their stage's rank are used as they are; the
        compiled programs are reused (same shapes, dtypes and placements).
        """
        params = stage_blocks(params, len(self.lm.blocks.parts), self.lm.blocks.sizes)
        check_same_model(self.lm, params)
        self.lm = params
        self._steps.update(params)
        return self

    @property
    def views(self) -> tuple:
        """Each stage's weights (the model's leaves it reads) on its rank, as generation uses them
        (empty before the first generation)."""
        return self._steps.weights()

    def _new_cache(self, batch: int, max_len: int):
        return init_cache(self.lm, batch, max_len)

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

    def generate(
        self,
        prompt: Array,
        max_new_tokens,
        *,
        max_len: int | None = None,
        groups: int = 1,
        lengths=None,
        sampler: Sampler = Sampler(),
        keys=None,
        stop_tokens: Sequence[int] = (),
        pad_id: int = 0,
        record: list | None = None,
    ) -> Array:
        """New tokens `(batch, T)` after `prompt`, equal to `spectrax_core.models.generate`'s.

        The batch is split into `groups` consecutive groups decoded as a
        wavefront (`groups >= ranks` keeps every rank busy); a group whose
        sequences have all stopped is no longer issued (see `wavefront`). In a
        multi-process job every process makes the same call, issues its own
        ranks' cells and returns all the tokens. The other
        arguments are `spectrax_core.models.generate`'s: a left-padded
        `prompt` with its `lengths`, `max_new_tokens` (an int or one per
        sequence), a `sampler`, one PRNG key per sequence, stop tokens, and
        `pad_id` for positions after a sequence finished. `record`: a list
        that receives each cell's `(rank, stage, group, round, start, end)`,
        waiting for every cell (a measured timeline, not the fast path).
        """
        max_len = check_generate(prompt, lengths, max_new_tokens, max_len, "PipelineDecoder")[2]
        batch = prompt.shape[0]
        if not isinstance(groups, int) or groups < 1 or batch % groups:
            raise MpmdError(
                f"PipelineDecoder.generate: groups={groups!r} must be a positive int dividing the batch of "
                f"{batch} sequences; pick a divisor of {batch} (groups >= ranks keeps every rank busy)."
            )
        sampling = dict(sampler=sampler, keys=keys, stop_tokens=stop_tokens, pad_id=pad_id)
        shape = dict(groups=groups, lengths=lengths, max_len=max_len, record=record)
        return self._steps.generate(prompt, max_new_tokens, **shape, **sampling)

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
