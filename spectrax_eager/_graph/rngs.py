"""`Rngs`: named random streams held as Variables (collection `"rngs"`).

Each draw folds a per-stream counter into the stream's key and increments the
counter. The counter is a Variable write, so transforms always let the
`"rngs"` collection change (a draw under `jit` advances the stream).

Outside a trace a stream is made and drawn from without JAX's context mesh,
and its key and counter are kept uncommitted (on the default device, free to
move): one `Rngs` then serves models built under different meshes (`with
mesh:` of one, then of another), each drawn key going where the code using it
runs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np

from .._scope import ambient
from .module import Module
from .variable import Variable


class RngKey(Variable):
    """A stream's base key (collection `"rngs"`)."""

    __slots__ = ()
    default_kind = "rngs"


class RngCount(Variable):
    """A stream's draw counter (collection `"rngs"`)."""

    __slots__ = ()
    default_kind = "rngs"


class RngStream(Module):
    """One named stream: `stream()` returns a fresh key (`counter`: the draws already made).

    `ref_id` is taken for code written for `spectrax-lib` and not kept: a stream's identity
    is the object's (share a stream by sharing the object)."""

    def __init__(self, seed: int | jax.Array, *, counter: int = 0, ref_id: int | None = None):
        del ref_id
        with _no_context_mesh():
            key = jax.random.key(seed) if isinstance(seed, int) else _uncommitted(seed)
            self.key = RngKey(key)
            self.count = RngCount(jax.device_put(np.uint32(counter)))

    def __call__(self) -> jax.Array:
        key, count = self.key.value, self.count.value
        if isinstance(key, jax.core.Tracer) or isinstance(count, jax.core.Tracer):
            self.count.value = count + 1
            return jax.random.fold_in(key, count)
        with _no_context_mesh():
            key, count = _uncommitted(key), _uncommitted(count)
            self.key.value, self.count.value = key, count + 1
            return jax.random.fold_in(key, count)


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
        if name.startswith("_") or name == "default":
            raise AttributeError(name)
        default = self.__dict__.get("default")
        if default is None:
            raise AttributeError(
                f"Rngs has no stream {name!r} and no default stream; pass Rngs(seed) or Rngs({name}=seed)."
            )
        return default

    def __call__(self) -> jax.Array:
        return self.default()

    def key(self, name: str | None = None) -> jax.Array:
        """The next key of stream `name` (the default stream when `name` is None or not a stream)."""
        return self.default() if name is None else getattr(self, name)()

    def streams(self) -> dict[str, RngStream]:
        """`{name: stream}` of every stream, the default one included."""
        return {k: v for k, v in self.__dict__.items() if isinstance(v, RngStream)}

    def fork(self, n: int | None = None) -> Rngs | tuple[Rngs, ...]:
        """Independent copies: each stream draws one key and splits it.

        `fork()` returns one new `Rngs`; `fork(n)` a tuple of `n` (e.g. one per layer of a
        stack). This `Rngs` advances by one draw per stream.
        """
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"Rngs.fork: n must be a positive int or None; received {n!r}.")
        keys = {name: jax.random.split(stream(), n or 1) for name, stream in self.streams().items()}
        out = tuple(Rngs(**{name: k[i] for name, k in keys.items()}) for i in range(n or 1))
        return out[0] if n is None else out

    def __enter__(self) -> Rngs:
        ambient.push("rngs", self)
        return self

    def __exit__(self, *exc: Any) -> None:
        ambient.pop("rngs", self)  # this block's entry


def seed(value: int | jax.Array) -> Rngs:
    """`Rngs(value)`; as a context manager (`with spx.seed(0):`) it is also `current_rngs()`
    inside the block, the streams layers built without `rngs=` may draw from."""
    return Rngs(value)


def current_rngs() -> Rngs | None:
    """The `Rngs` of the innermost `with spx.seed(...)` / `with rngs:` block, or None."""
    stack = ambient.current().rngs
    return stack[-1] if stack else None


def resolve_rngs(rngs: Rngs | int | None = None) -> Rngs:
    """An `Rngs` from what a layer was given: an `Rngs` as is, an int seed, or (None) the
    innermost `with spx.seed(...)` block's, else an error naming the fix."""
    if isinstance(rngs, Rngs):
        return rngs
    if isinstance(rngs, int) and not isinstance(rngs, bool):
        return Rngs(rngs)
    if rngs is None and current_rngs() is not None:
        return current_rngs()
    raise TypeError(
        f"resolve_rngs: expected an spx.Rngs or an int seed (or a `with spx.seed(n):` block); received {rngs!r}."
    )


def _no_context_mesh() -> contextlib.AbstractContextManager:
    """JAX's context mesh cleared for the block (nothing to clear inside a trace, where JAX keeps
    none and cannot set one)."""
    try:
        jax.sharding.get_mesh()
    except ValueError:  # "`get_mesh` can only be used outside of `jax.jit`"
        return contextlib.nullcontext()
    return jax.set_mesh(None)


def _uncommitted(value: jax.Array) -> jax.Array:
    """`value` as an uncommitted array on the default device (as is when it already is one)."""
    if not isinstance(value, jax.Array) or not value.committed:
        return value
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):
        data = jax.device_put(np.asarray(jax.random.key_data(value)))
        return jax.random.wrap_key_data(data, impl=jax.random.key_impl(value))
    return jax.device_put(np.asarray(value))


def split_stream_keys(stream: RngStream, axis_size: int) -> jax.Array:
    """`axis_size` independent keys from one draw of `stream` (stacked on a leading axis)."""
    return jax.random.split(stream(), axis_size)


@contextlib.contextmanager
def split_rngs(rngs: Rngs, *, axis_size: int, only: tuple[str, ...] | None = None) -> Iterator[list[Rngs]]:
    """`axis_size` `Rngs`, one per member of a vmapped or stacked group: the streams in `only`
    (default: all) draw independent keys per member, the others give every member the same key."""
    members: list[dict[str, jax.Array]] = [{} for _ in range(axis_size)]
    for name, stream in rngs.streams().items():
        keys = (
            split_stream_keys(stream, axis_size) if only is None or name in only else [stream()] * axis_size
        )
        for i in range(axis_size):
            members[i][name] = keys[i]
    yield [Rngs(**m) for m in members]
