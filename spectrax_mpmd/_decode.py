"""Pipelined greedy decoding: each rank keeps its own blocks and their KV caches.

The LM's blocks are cut into stages (`stage_blocks`); one `sxjit` program per
stage runs a prefill or a one-token step. A stage's KV caches are read and
written by that stage only, so they are placed on its rank once and never
move; only the residual stream of the new tokens crosses ranks.
"""

from __future__ import annotations

from collections.abc import Sequence

from jaxtyping import Array

from spectrax_core import apply
from spectrax_core.models import greedy_decode, init_cache

from ._api import sxjit
from ._mesh import as_mpmd_mesh
from ._stages import stage_blocks


def _decode_step(lm, tokens, cache):
    return apply(lm, tokens, cache=cache)


class PipelineDecoder:
    """Prefill and token-by-token decoding of a core LM (e.g. `TransformerLM`) across pipeline ranks."""

    def __init__(self, lm, *, mesh, schedule=None, stage_sizes: Sequence[int] | None = None):
        mesh = as_mpmd_mesh(mesh)
        v = schedule.virtual_stages if schedule is not None else 1
        self.lm = stage_blocks(lm, mesh.mpmd_dim * v, stage_sizes)
        self._step = sxjit(_decode_step, mesh=mesh, schedule=schedule, donate_argnums=2)

    def init_cache(self, batch: int, max_len: int):
        """Empty caches, one per stage's blocks."""
        return init_cache(self.lm, batch, max_len)

    def step(self, tokens: Array, cache) -> tuple[Array, tuple]:
        """`(logits, new_cache)` for `tokens` `(batch, length)` continuing `cache` (donated)."""
        return self._step(self.lm, tokens, cache)

    def generate(self, prompt: Array, steps: int, *, max_len: int | None = None) -> Array:
        """The `steps` greedy tokens after `prompt`, as `spectrax_core.models.greedy_decode`."""
        return greedy_decode(self.lm, prompt, steps, max_len=max_len, step=self.step)
