"""`Rngs`: named random streams held as Variables (collection `"rngs"`).

Each draw folds a per-stream counter into the stream's key and increments the
counter. The counter is a Variable write, so transforms always let the
`"rngs"` collection change (a draw under `jit` advances the stream).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from ._module import Module
from ._variable import Variable


class RngKey(Variable):
    """A stream's base key (collection `"rngs"`)."""

    __slots__ = ()
    default_kind = "rngs"


class RngCount(Variable):
    """A stream's draw counter (collection `"rngs"`)."""

    __slots__ = ()
    default_kind = "rngs"


class RngStream(Module):
    """One named stream: `stream()` returns a fresh key."""

    def __init__(self, seed: int | jax.Array):
        key = jax.random.key(seed) if isinstance(seed, int) else seed
        self.key = RngKey(key)
        self.count = RngCount(jnp.zeros((), jnp.uint32))

    def __call__(self) -> jax.Array:
        count = self.count.value
        self.count.value = count + 1
        return jax.random.fold_in(self.key.value, count)


class Rngs(Module):
    """Named random streams: `Rngs(0)`, `Rngs(0, dropout=1)`, `Rngs(params=0, dropout=1)`.

    `rngs()` or `rngs.default()` draws from the default stream; `rngs.NAME()`
    draws from stream NAME, falling back to the default stream when NAME was
    not given.
    """

    def __init__(self, seed: int | jax.Array | None = None, /, **streams: int | jax.Array):
        if seed is None and not streams:
            raise ValueError("Rngs: give a seed (`Rngs(0)`) or named streams (`Rngs(params=0)`).")
        if seed is not None:
            self.default = RngStream(seed)
        for name, s in streams.items():
            setattr(self, name, RngStream(s))

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "default":
            raise AttributeError(name)
        default = self.__dict__.get("default")
        if default is None:
            raise AttributeError(
                f"Rngs has no stream {name!r} and no default stream; pass Rngs(seed) or Rngs({name}=seed)."
            )
        return default

    def __call__(self) -> jax.Array:
        return self.default()
