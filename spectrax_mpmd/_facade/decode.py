"""Pipelined decoding and generation: each rank keeps its own blocks and their KV caches.

The LM's blocks are cut into stages (`stage_blocks`). `generate` runs a
wavefront of sequence groups through one program per stage (`generate/`);
`step` runs one prefill or one-token step of a caller-held cache through
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
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array

from spectrax_core import apply
from spectrax_core.models import GenState, Sampler, check_generate, gen_state, init_cache
from spectrax_core.nn import KVCache

from .._api import sxjit
from .._mesh import as_mpmd_mesh
from .._stages import stage_blocks
from .._trace.context import methods_outside_context_mesh
from ..errors import MpmdError
from .generate.links import Transfers, make_links
from .generate.programs import input_specs, lm_cells
from .generate.stages import StageLayout, check_same_model, place_views, stage_views
from .generate.wavefront import place_groups, run_wavefront


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
        self._layout = StageLayout.of(mesh, len(self.lm.blocks.parts), schedule)
        self._views = None  # each stage's share of `lm`, placed on its rank at first use
        self._links = make_links(self._layout, len(self.lm.blocks.parts))
        self._moves = None  # the cross-process transfers (False: none), made at the first generation
        self._step = sxjit(_decode_step, mesh=mesh, schedule=schedule, donate_argnums=2)
        self._written: dict[int, tuple[weakref.ref, int]] = {}  # id(cache index) -> (its ref, positions)

    def update(self, params) -> PipelineDecoder:
        """Use `params` (new values of the same model, e.g. after an optimizer step) from now on.

        Leaves already on their stage's rank are used as they are; the
        compiled programs are reused (same shapes, dtypes and placements).
        """
        params = stage_blocks(params, len(self.lm.blocks.parts), self.lm.blocks.sizes)
        check_same_model(self.lm, params)
        self.lm, self._views = params, None
        return self

    @property
    def views(self) -> tuple:
        """Each stage's share of the model (see `generate.stages`), on its rank."""
        if self._views is None:
            self._views = place_views(stage_views(self.lm), self._layout)
        return self._views

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
        starts, steps, max_len = check_generate(prompt, lengths, max_new_tokens, max_len, "PipelineDecoder")
        batch = prompt.shape[0]
        if not isinstance(groups, int) or groups < 1 or batch % groups:
            raise MpmdError(
                f"PipelineDecoder.generate: groups={groups!r} must be a positive int dividing the batch of "
                f"{batch} sequences; pick a divisor of {batch} (groups >= ranks keeps every rank busy)."
            )
        transfers = self._transfers()
        if record is not None and transfers is not None:
            raise MpmdError("PipelineDecoder.generate: record= measures a one-process run; drop it here.")
        state, size = gen_state(batch, max_new_tokens, keys, stop_tokens), batch // groups
        budgets = np.broadcast_to(np.asarray(max_new_tokens), (batch,))
        parts = [slice(i * size, (i + 1) * size) for i in range(groups)]
        prompt = np.asarray(prompt, np.int32)
        placed = place_groups(
            self.views,
            self._layout,
            [prompt[p] for p in parts],
            [starts[p] for p in parts],
            [_group_state(state, p) for p in parts],
            [budgets[p].max() for p in parts],
            max_len,
        )
        specs = None
        if transfers is not None:
            specs = input_specs(self.views, size, prompt.shape[1], max_len)
            transfers.begin(groups, steps)
        tokens = run_wavefront(
            lm_cells(self.views, placed[0].trees, sampler, pad_id),
            self._layout,
            placed,
            steps,
            pad_id,
            links=self._links,
            specs=specs,
            transfers=transfers,
            watch=transfers is None and len(stop_tokens) > 0,
            record=record,
        )
        if transfers is not None:
            return transfers.finish(tokens, (batch, steps))
        return jnp.asarray(tokens)

    def _transfers(self) -> Transfers | None:
        """The cross-process moves, when a link between stages crosses processes (made once)."""
        if self._moves is None:
            self._moves = Transfers(self._links) if any(link.cross for link in self._links) else False
        return self._moves or None

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


def _group_state(state: GenState, part: slice) -> GenState:
    """The state of the sequences in `part`."""
    return GenState(
        step=state.step,
        done=state.done[part],
        keys=state.keys[part],
        max_new=state.max_new[part],
        stop=state.stop,
    )


def _first_cache(cache) -> KVCache:
    found = jax.tree.leaves(cache, is_leaf=lambda x: isinstance(x, KVCache))
    if not found or not isinstance(found[0], KVCache):
        raise MpmdError(
            f"PipelineDecoder.step: cache must be the caches of init_cache(batch, max_len), got "
            f"{type(cache).__name__}."
        )
    return found[0]
