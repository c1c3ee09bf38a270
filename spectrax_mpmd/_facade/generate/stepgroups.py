"""The live values of a user step's groups, placed where their stages run, and their input shapes."""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp

from .requests import Request
from .rows import RowState, rows_of
from .stages import StageLayout, local_stages
from .wavefront import Group


class Places:
    """Where a user step's stages keep their values: each stage's params on its rank (placed once; a
    leaf already there is used as it is) and the makers of each stage's cache on its rank."""

    def __init__(self, layout: StageLayout, params, init_cache: Callable):
        self.layout, self.init_cache, self.params = layout, init_cache, params
        self.placed: dict[tuple, jax.Array] = {}  # (stage, flat param index) -> the leaf on its rank
        self.makers: dict[tuple, Callable] = {}  # (stage, size, max_len) -> the stage's cache maker

    def use(self, params) -> None:
        """Take new values of the params: placed again at their next use."""
        self.params, self.placed = params, {}

    def weights(self, s: int, index: tuple) -> list:
        """Stage `s`'s params `index` on its rank (none on another process's stage)."""
        if not local_stages(self.layout, len(self.layout.ranks))[s]:
            return []
        leaves, target = jax.tree.leaves(self.params), self.layout.sharding(s)
        missing = [i for i in index if (s, i) not in self.placed]
        moved = [i for i in missing if not _on(leaves[i], target)]
        self.placed.update(((s, i), leaves[i]) for i in missing if i not in moved)
        if moved:
            self.placed.update(
                ((s, i), a) for i, a in zip(moved, jax.device_put([leaves[i] for i in moved], target))
            )
        return [self.placed[s, i] for i in index]

    def caches(self, owned: tuple, size: int, max_len: int) -> Callable:
        """`s -> a group's new cache leaves of stage s`, made on its rank by the user's `init_cache`."""

        def make(s: int) -> list:
            key = (s, size, max_len)
            if key not in self.makers:
                pick = lambda: [jax.tree.leaves(self.init_cache(size, max_len))[c] for c in owned[s]]  # noqa: E731
                self.makers[key] = jax.jit(pick, out_shardings=self.layout.sharding(s))
            return self.makers[key]()

        return make


def _on(leaf, target) -> bool:
    return isinstance(leaf, jax.Array) and leaf.sharding.device_set == target.device_set


def step_groups(layout: StageLayout, n_stages: int, req: Request, state: RowState, cache: Callable) -> list:
    """Each group's prompt (stage 0), lengths (every stage), state (last stage) and caches
    (`cache(s)`: a new cache of stage s), on the ranks of this process that use them."""
    mine, last = local_stages(layout, n_stages), n_stages - 1

    def at(value, s):
        return jax.device_put(value, layout.sharding(s)) if mine[s] else None

    out = []
    for i in range(req.groups):
        part = req.part(i)
        out.append(
            Group(
                x=at(req.tokens[part], 0),
                caches=[cache(s) if mine[s] else None for s in range(n_stages)],
                starts=[at(req.lengths[part], s) for s in range(n_stages)],
                state=at(rows_of(state, part), last),
                rounds=int(req.budgets[part].max()),
                index=i,
            )
        )
    return out


def step_input_specs(req: Request, pre, dec, leaves: list, cache: list) -> tuple[list, list]:
    """Each stage's input shape in a decode round and in the prefill round (`specs[t == 0][s]`);
    `leaves` and `cache`: the params' and a group's cache leaves, abstract."""
    pos, owned = jax.ShapeDtypeStruct((req.size,), jnp.int32), dec[1]
    out = []
    for programs, x in ((dec[0], (req.size,)), (pre[0], (req.size, req.tokens.shape[1]))):
        row = [jax.ShapeDtypeStruct(x, jnp.int32)]
        for s in range(len(programs) - 1):
            weights = [leaves[i] for i in pre[1][s]]
            row.append(
                jax.eval_shape(programs[s], weights, row[-1], [cache[c] for c in owned[s]], pos, None)[0]
            )
        out.append(row)
    return out[0], out[1]


def serve_groups(layout, n_stages: int, state, groups: int, size: int, cache: Callable, rounds: int) -> list:
    """Groups of `size` idle rows for continuous batching: stage 0's first input (zeros), caches, and
    on the last stage the rows' state with every prompt's keys and budgets (`state`, a `GenState`)."""
    mine, last = local_stages(layout, n_stages), n_stages - 1
    rows = RowState(
        step=jnp.zeros((size,), jnp.int32),
        done=jnp.zeros((size,), bool),
        keys=state.keys[jnp.zeros((size,), jnp.int32)],
        max_new=jnp.zeros((size,), jnp.int32),
        stop=state.stop,
    )
    out = []
    for i in range(groups):
        x = jax.device_put(jnp.zeros((size,), jnp.int32), layout.sharding(0)) if mine[0] else None
        table = (
            jax.device_put((rows, state.keys, state.max_new), layout.sharding(last)) if mine[last] else None
        )
        caches = [cache(s) if mine[s] else None for s in range(n_stages)]
        out.append(Group(x, caches, [None] * n_stages, table, rounds, index=i))
    return out
