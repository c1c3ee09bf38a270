"""A decode-aware stage split: blocks per stage chosen from measured decode cell costs.

A decode cell runs one token of one group through a stage: its blocks, plus
the embedding on the first stage and the final norm, head and sampler on the
last. An even split leaves the last stage the slowest, and in a wavefront the
slowest stage sets every rank's pace. The costs are measured, not guessed,
and not assumed linear in the blocks (a stack of one block compiles to a
different program than a loop over several): one decode cell of each kind of
stage (first, middle, last) with each block count a split can give it, timed
on one rank's devices in `repeats` interleaved rounds, the least of them
taken (the figure other work on a shared machine disturbs least) and made
non-decreasing in the block count (more blocks are more work); the split
minimises the measured slowest stage.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from spectrax_core.models import Sampler, gen_state, init_cache, lm_step

from ..._mesh import as_mpmd_mesh
from ..._stages import StagedStack, unstage_blocks
from ..._trace.context import outside_context_mesh
from ...errors import StageSplitError
from .rows import row_state
from .stepcells import stage_program
from .traced import abstract, trace_step

KINDS = ("first", "middle", "last")


@dataclass(frozen=True)
class DecodeSplit:
    """`sizes`: blocks per stage; `predicted[s]`: seconds per decode cell of stage s; `measured`:
    seconds per decode cell by `(KINDS[kind], blocks)`."""

    sizes: tuple[int, ...]
    predicted: tuple[float, ...]
    measured: dict


def _kind(stage: int, n_stages: int) -> int:
    return 0 if stage == 0 else 2 if stage == n_stages - 1 else 1


def _staged(lm, kind: int, blocks: int) -> tuple:
    """`(staged LM, stage)`: the first `blocks` (+1 or +2) of `lm`'s blocks staged so that `stage` is
    a `kind` stage of `blocks` blocks (its neighbours one block each)."""
    sizes = ((blocks, 1), (1, blocks, 1), (1, blocks))[kind]
    stack = lm.blocks.slice(0, sum(sizes))
    return dataclasses.replace(lm, blocks=StagedStack.from_stack(stack, sizes)), min(kind, 1)


def _cell(lm, kind: int, blocks: int, size: int, max_len: int, sampler, device) -> Callable[[], float]:
    """A timer of one decode cell (the host waits for it) of a `kind` stage with `blocks` blocks: the
    program `PipelineDecoder.generate` runs for it (`lm_step` cut at its markers)."""
    staged, s = _staged(lm, kind, blocks)
    cache0 = jax.eval_shape(lambda: init_cache(staged, size, max_len))
    ints = jax.ShapeDtypeStruct((size, 1), jnp.int32)
    plan = trace_step(lm_step, abstract(staged), cache0, ints, ints, len(staged.blocks.parts), "decode_split")
    leaves = jax.tree.leaves(staged)
    programs = [stage_program(plan, k, plan.params[k], False, sampler, 0) for k in range(s + 1)]
    owned = [[jax.tree.leaves(cache0)[c] for c in plan.owned[k]] for k in range(s + 1)]
    pos, x = jax.ShapeDtypeStruct((size,), jnp.int32), jax.ShapeDtypeStruct((size,), jnp.int32)
    for k in range(s):  # the input's shape: the stages before it, abstractly
        x = jax.eval_shape(programs[k], [leaves[i] for i in plan.params[k]], x, owned[k], pos, None)[0]
    weights = jax.device_put([leaves[i] for i in plan.params[s]], device)
    x = jax.device_put(jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), x), device)
    pos = jax.device_put(jnp.zeros((size,), jnp.int32), device)
    state = row_state(gen_state(size, max_len)) if kind == 2 else None

    def seconds() -> float:
        cache = [jnp.zeros(a.shape, a.dtype, device=device) for a in owned[s]]  # donated
        fresh = jax.device_put(jax.tree.map(lambda a: a.copy(), state), device)  # donated
        jax.block_until_ready((cache, fresh))
        begin = time.perf_counter()
        jax.block_until_ready(programs[s](weights, x, cache, pos, fresh))
        return time.perf_counter() - begin

    seconds(), seconds()  # compile and warm up
    return seconds


def _best(n_blocks: int, n_stages: int, cost: dict) -> tuple[int, ...]:
    """Blocks per stage (each >= 1) minimising the slowest stage's cost `cost[kind, blocks]` (stage by
    stage, the best prefix for each block count; ties go to the lower total)."""
    best = {0: (0.0, 0.0, ())}  # blocks used -> (slowest so far, total so far, sizes)
    for s in range(n_stages):
        left, kind = n_stages - s - 1, _kind(s, n_stages)
        nxt: dict[int, tuple] = {}
        for used, (worst, total, sizes) in best.items():
            for k in range(1, n_blocks - used - left + 1):
                c = cost[kind, k]
                cand = (max(worst, c), total + c, sizes + (k,))
                if used + k not in nxt or cand < nxt[used + k]:
                    nxt[used + k] = cand
        best = nxt
    return best[n_blocks][2]


@outside_context_mesh
def decode_split(
    lm, *, mesh, group_size: int, max_len: int, sampler: Sampler = Sampler(), schedule=None, repeats: int = 15
) -> DecodeSplit:
    """The decode-aware split of `lm`'s blocks over `mesh`'s ranks (x the schedule's virtual stages),
    for groups of `group_size` sequences and caches of `max_len` positions.

    Use its `sizes` as `PipelineDecoder(..., stage_sizes=)` (or a training
    run's `stage_sizes=`, which a decoder built from its parameters then keeps).
    """
    mesh = as_mpmd_mesh(mesh)
    n_stages = mesh.mpmd_dim * (schedule.virtual_stages if schedule is not None else 1)
    lm = unstage_blocks(lm)
    n_blocks = lm.blocks.n_layers
    if n_blocks < max(2, n_stages):
        raise StageSplitError(
            f"decode_split: the model has {n_blocks} blocks for {n_stages} stages; a split needs at "
            "least one block per stage (and two stages)."
        )
    device = mesh.submesh(0).devices.flat[0]
    kinds = sorted({_kind(s, n_stages) for s in range(n_stages)})
    cells = {
        (k, b): _cell(lm, k, b, group_size, max_len, sampler, device)
        for k in kinds
        for b in range(1, n_blocks - n_stages + 2)
    }
    times: dict[tuple, list] = {key: [] for key in cells}
    for _ in range(repeats):  # interleaved rounds: a burst of other work hits every cell alike
        for key, seconds in cells.items():
            times[key].append(seconds())
    cost = {}
    for k, b in cells:  # more blocks never cost less: each count is at least the one before
        cost[k, b] = max(min(times[k, b]), cost.get((k, b - 1), 0.0))
    sizes = _best(n_blocks, n_stages, cost)
    predicted = tuple(cost[_kind(s, n_stages), k] for s, k in enumerate(sizes))
    return DecodeSplit(sizes, predicted, {(KINDS[k], b): t for (k, b), t in cost.items()})
