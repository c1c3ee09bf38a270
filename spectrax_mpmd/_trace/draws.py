"""Random draws hashed without a loop, with the bits JAX's draws give.

JAX lowers each random draw (`random_bits`) and key split (`random_split`) to a threefry
hash, which on CPU it writes as a loop over the hash's five key injections; XLA:CPU
compiles every such loop on its own, so an init that makes many parameters compiles a loop
per parameter (and per split). `draw` computes the hash as Threefry-2x32's 20 rounds
written out instead (`threefry2x32`): plain integer arithmetic that XLA fuses with the
conversion reading the bits, one kernel per draw with nothing in memory but the result.
The bits are the same, element for element; a rank's init program of the main job's LM
compiles in about half the time and runs faster (`benchmarks/init_draws.py`).

This follows how JAX counts a draw's elements with `jax_threefry_partitionable` (its
default): element `j` of a key's draw (row-major in the draw's shape) is hashed with the
counter `(j >> 32, j & 0xffffffff)`, its bits are the two words' xor (in 8, 16 or 32 bits),
and a split's new keys are the two words. With another key implementation, the flag off,
64-bit draws or 2**32 elements or more per key, `hashable` is false and the draw is left
to JAX.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

HASHED = frozenset({"random_bits", "random_split"})
_BITS = {8: np.uint8, 16: np.uint16, 32: np.uint32}
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))  # Threefry-2x32's, alternating every 4 rounds
_PARITY = np.uint32(0x1BD11BDA)  # the key schedule's third word: k1 ^ k2 ^ this


def threefry2x32(k1, k2, x1, x2) -> tuple:
    """Threefry-2x32, 20 rounds (Salmon et al., 2011): the two words hashed from counters
    `(x1, x2)` under keys `(k1, k2)`, elementwise over uint32 arrays of one shape."""
    schedule = (k1, k2, k1 ^ k2 ^ _PARITY)
    a, b = x1 + k1, x2 + k2
    for block in range(5):  # four rounds, then the next key words injected
        for r in _ROTATIONS[block % 2]:
            a = a + b
            b = a ^ ((b << np.uint32(r)) | (b >> np.uint32(32 - r)))
        a = a + schedule[(block + 1) % 3]
        b = b + schedule[(block + 2) % 3] + np.uint32(block + 1)
    return a, b


def hashable(name: str, keys, params: dict) -> bool:
    """Whether the draw `name` (one of `HASHED`) of `keys` is one `draw` computes as JAX does."""
    shape = tuple(params["shape"])
    return (
        jax.config.jax_threefry_partitionable
        and str(jax.random.key_impl(keys)) == "threefry2x32"
        and all(isinstance(d, int) for d in shape)
        and math.prod(shape) < 2**32
        and (name == "random_split" or params.get("bit_width") in _BITS)
    )


def draw(name: str, keys, params: dict):
    """The value of JAX's `name` draw of `keys` with `params` (where `hashable`): per key, the
    hash of every element's counter, as bits or as new keys."""
    batch, shape = tuple(keys.shape), tuple(params["shape"])
    full = (*batch, *shape)
    words = jax.random.key_data(keys)
    key_axes, draw_axes = tuple(range(len(batch))), tuple(range(len(batch), len(full)))
    k1, k2 = (lax.broadcast_in_dim(words[..., w], full, key_axes) for w in (0, 1))
    counter = lax.broadcast_in_dim(lax.iota(np.uint32, math.prod(shape)).reshape(shape), full, draw_axes)
    high, low = threefry2x32(k1, k2, jnp.zeros_like(counter), counter)
    if name == "random_split":
        return jax.random.wrap_key_data(jnp.stack([high, low], axis=-1), impl=jax.random.key_impl(keys))
    return lax.convert_element_type(high ^ low, _BITS[params["bit_width"]])
