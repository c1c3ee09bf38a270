"""A program's random draws hashed by one call each wave, with the bits JAX's draws give.

Each of JAX's random draws (`random_bits`) and key splits (`random_split`) lowers to a
threefry hash of its own, and XLA compiles each hash as a loop of its own: an init that
makes many parameters compiles one loop per parameter. On XLA:CPU nine normal draws of a
transformer block's shapes compile in 1.0 s, one draw of their total size in 0.16 s.

Threefry hashes every element from its key and its counter alone. So the draws of a
program that need no other draw's result can be hashed by one call on their keys and
counters laid end to end, each draw's bits then sliced back out: the same bits, element
for element. `waves` orders a program's equations so that the draws of each wave are
hashed together after the equations they read; `hash_together` hashes them.

This follows how JAX counts a draw's elements with `jax_threefry_partitionable` (its
default): element `j` of a key's draw (row-major in the draw's shape) is hashed with the
counter `(j >> 32, j & 0xffffffff)`, and a split's new key is the two words of that hash.
With another key implementation, the flag off, 64-bit draws or more than 2**32 elements per
key, a draw is bound on its own as JAX writes it. A call hashes at most `MAX_ELEMENTS`
(a larger draw is bound on its own), so its temporaries stay about those of one draw.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .jax_private import private

THREEFRY = private("jax.extend.random.threefry2x32_p")  # None: every draw bound on its own
HASHED = frozenset({"random_bits", "random_split"})
MAX_ELEMENTS = 1 << 20  # per hash call: its keys, counters and bits (about 24 bytes an element)
_BITS = {8: np.uint8, 16: np.uint16, 32: np.uint32}


class Draw(NamedTuple):
    """One draw to hash: `name` (`random_bits` or `random_split`), its keys, its params, and
    `bind()`, the draw computed on its own (the fallback)."""

    name: str
    keys: jax.Array
    params: dict
    bind: Callable[[], jax.Array]


def waves(reads: Sequence[Sequence[int]], is_draw: Sequence[bool]) -> list[tuple[list[int], list[int]]]:
    """`(equations to run in order, draws to hash together)` per wave, for equations whose
    inputs are made by the equations `reads[i]` (earlier ones): a draw's wave is the number
    of draws on its longest chain of inputs, so every draw of a wave reads only the waves
    before it and the equations run before it in its own."""
    level: list[int] = []
    for i, producers in enumerate(reads):
        level.append(max((level[p] + is_draw[p] for p in producers), default=0))
    out: list[tuple[list[int], list[int]]] = [([], []) for _ in range(max(level, default=-1) + 1)]
    for i, lv in enumerate(level):
        out[lv][1 if is_draw[i] else 0].append(i)
    return out


def _shape(draw: Draw) -> tuple:
    return tuple(draw.params["shape"])


def _hashable(draw: Draw) -> bool:
    """Whether `draw` is a threefry draw this module counts as JAX does."""
    shape = _shape(draw)
    return (
        THREEFRY is not None
        and jax.config.jax_threefry_partitionable
        and str(jax.random.key_impl(draw.keys)) == "threefry2x32"
        and all(isinstance(d, int) for d in shape)
        and math.prod(shape) < 2**32
        and (draw.name == "random_split" or draw.params.get("bit_width") in _BITS)
    )


def _size(draw: Draw) -> int:
    return math.prod(draw.keys.shape) * math.prod(_shape(draw))


def _inputs(draw: Draw) -> list:
    """The draw's keys' two words and its counters, one element per hashed element, flat."""
    batch, per_key = tuple(draw.keys.shape), math.prod(_shape(draw))
    words = jax.random.key_data(draw.keys)
    full = (*batch, per_key)

    def spread(x):
        return lax.broadcast_in_dim(x, full, tuple(range(len(batch)))).reshape(-1)

    counter = lax.broadcast_in_dim(lax.iota(np.uint32, per_key), full, (len(batch),)).reshape(-1)
    return [spread(words[..., 0]), spread(words[..., 1]), jnp.zeros_like(counter), counter]


def _finish(draw: Draw, high, low):
    """The draw's value from its elements' two hash words."""
    shape = (*draw.keys.shape, *_shape(draw))
    high, low = high.reshape(shape), low.reshape(shape)
    if draw.name == "random_split":
        return jax.random.wrap_key_data(jnp.stack([high, low], axis=-1), impl=jax.random.key_impl(draw.keys))
    return lax.convert_element_type(high ^ low, _BITS[draw.params["bit_width"]])


def hash_together(draws: Sequence[Draw]) -> list:
    """Each draw's value: the hashable ones by one threefry call per `MAX_ELEMENTS` of them,
    the others (and one alone) bound on their own."""
    out: list = [None] * len(draws)
    group: list[int] = []
    total = 0

    def flush() -> None:
        if len(group) == 1:
            out[group[0]] = draws[group[0]].bind()
        elif group:
            parts = [_inputs(draws[k]) for k in group]
            high, low = THREEFRY.bind(*(jnp.concatenate(column) for column in zip(*parts)))
            start = 0
            for k in group:
                end = start + _size(draws[k])
                out[k] = _finish(draws[k], high[start:end], low[start:end])
                start = end
        group.clear()

    for k, draw in enumerate(draws):
        if not _hashable(draw) or not 0 < _size(draw) <= MAX_ELEMENTS:
            out[k] = draw.bind()
            continue
        if total + _size(draw) > MAX_ELEMENTS:
            flush()
            total = 0
        group.append(k)
        total += _size(draw)
    flush()
    return out
