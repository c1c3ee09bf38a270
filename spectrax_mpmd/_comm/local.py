"""Moving buffers between ranks at the cost of the copy.

A plan knows, when it is built, the sharding every buffer has and the one its
receiver needs. When the two lay the array out the same way over same-shaped
device sets (one device to one device, or the same spec over same-shaped
submeshes), the move is a plain per-shard copy: JAX's C++ batched copy
(`batched_copy_array_to_devices_with_sharding`, the call `jax.device_put` itself
ends in) does it without the Python layer around it (flattening, abstract
values, sharding checks), for a fraction of the host time.

That entry point is private, so it is feature-detected at import: where it is
absent, a move changes the layout, or an array has an extended dtype (a typed
PRNG key, which the C++ copy rejects), the public `jax.device_put` runs instead —
except for a layout change of an array split over several devices, which `reshard`
makes shard to shard rather than through host memory.
Both give the same values on the same shardings (a test runs both on one plan).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
from jax.sharding import NamedSharding, Sharding

from .._trace.jax_private import private
from .reshard import reshard


def _detect_copier() -> tuple[Callable, object] | None:
    """JAX's C++ batched copy and its 'reuse the input' semantics, or None if unavailable."""
    copy = private("jax._src.lib.xla_client.batched_copy_array_to_devices_with_sharding")
    semantics = getattr(private("jax._src.lib.xla_client.ArrayCopySemantics"), "REUSE_INPUT", None)
    device_list = private("jax.sharding.NamedSharding._internal_device_list")
    if copy is None or semantics is None or device_list is None:
        return None
    return copy, semantics


_COPIER = _detect_copier()


def fast_path_available() -> bool:
    """Whether this JAX offers the C++ batched copy the fast transfers use."""
    return _COPIER is not None


def same_layout(src: Sharding, dst: Sharding) -> bool:
    """Whether moving from `src` to `dst` is a per-shard copy: every device of `dst` gets
    exactly the shard the device at the same position of `src` holds."""
    if src.memory_kind != dst.memory_kind or not (src.is_fully_addressable and dst.is_fully_addressable):
        return False
    if len(src.device_set) == 1 and len(dst.device_set) == 1:
        return True
    if not (isinstance(src, NamedSharding) and isinstance(dst, NamedSharding)):
        return False
    same_mesh = tuple(src.mesh.shape.items()) == tuple(dst.mesh.shape.items())
    return same_mesh and trimmed_spec(src) == trimmed_spec(dst)


def trimmed_spec(sharding: NamedSharding) -> tuple:
    """`sharding`'s spec without its trailing `None`s (`P('x')` and `P('x', None)` cut alike)."""
    spec = tuple(sharding.spec)
    while spec and spec[-1] is None:
        spec = spec[:-1]
    return spec


def _extended(array) -> bool:
    """Whether `array` has an extended dtype (a typed PRNG key), which the C++ copy rejects."""
    dtype = getattr(array, "dtype", None)
    return dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.extended)


class _Copy:
    """Per-shard copies of several buffers, one C++ call.

    The C++ copy takes plain arrays only: it rejects arrays of an extended
    dtype (typed PRNG keys) with a `TypeError` before copying anything, and
    such moves go through `jax.device_put`, which copies their key data and
    keeps them typed.
    """

    __slots__ = ("targets", "device_lists", "semantics", "sources", "put")

    def __init__(self, targets: Sequence[Sharding]):
        self.targets, self.sources = list(targets), None
        self.device_lists = [s._internal_device_list for s in targets]
        self.semantics = [_COPIER[1]] * len(targets)
        self.put = _Put(targets)

    def __call__(self, *arrays):
        try:
            return _COPIER[0](list(arrays), self.device_lists, self.targets, self.semantics)
        except TypeError:
            if not any(_extended(a) for a in arrays):
                raise
        return self.put(*arrays)

    def public(self) -> "_Put":
        return _Put(self.targets, self.sources)


class _Put:
    """The public `jax.device_put` of several buffers (a one-device target in device memory given
    as its device, which costs the host about half as much and places the same; a target in
    another memory kind, such as host memory, as its sharding)."""

    __slots__ = ("targets", "where", "single", "sources")

    def __init__(self, targets: Sequence[Sharding], sources: Sequence[Sharding] | None = None):
        self.targets, self.sources = list(targets), None
        kinds = [t.memory_kind for t in (*targets, *(sources or ()))]
        in_device = all(kind in (None, "device") for kind in kinds)
        self.where = [
            next(iter(t.device_set)) if len(t.device_set) == 1 and in_device else t for t in targets
        ]
        self.single = self.where[0] if len(self.where) == 1 else None

    def __call__(self, *arrays):
        if self.single is not None:
            return (jax.device_put(arrays[0], self.single),)
        return jax.device_put(list(arrays), self.where)

    def public(self) -> "_Put":
        return self


class _Reshard:
    """Moves that change the layout of an array split over several devices, shard to shard
    (`reshard.reshard`; a typed PRNG key through `jax.device_put`)."""

    __slots__ = ("targets", "sources", "put")

    def __init__(self, targets: Sequence[Sharding], sources: Sequence[Sharding] | None = None):
        self.targets, self.sources, self.put = list(targets), None, _Put(targets, sources)

    def __call__(self, *arrays):
        return [jax.device_put(x, t) if _extended(x) else reshard(x, t) for x, t in zip(arrays, self.targets)]

    def public(self) -> _Put:
        return self.put


class _Mixed:
    """Moves of several kinds (per-shard copies, reshards, `jax.device_put`s), each kind's group
    made by its own mover."""

    __slots__ = ("targets", "groups", "sources")

    def __init__(self, targets: Sequence[Sharding], sources: Sequence[Sharding], kinds: Sequence[type]):
        self.targets, self.sources = list(targets), None
        self.groups = []
        for kind in dict.fromkeys(kinds):
            at = [k for k, c in enumerate(kinds) if c is kind]
            self.groups.append((at, _make(kind, [targets[k] for k in at], [sources[k] for k in at])))

    def __call__(self, *arrays):
        out = [None] * len(arrays)
        for at, move in self.groups:
            for k, y in zip(at, move(*[arrays[k] for k in at])):
                out[k] = y
        return out

    def public(self) -> _Put:
        return _Put(self.targets, self.sources)


def _make(kind: type, targets: list, sources: list):
    return kind(targets) if kind is _Copy else kind(targets, sources)


def _kind(src: Sharding, dst: Sharding) -> type:
    """The mover of one move: a per-shard copy, a shard-to-shard reshard (the layout changes, the
    sender's array lies on several devices, all of this process), else `jax.device_put`."""
    if _COPIER is not None and same_layout(src, dst):
        return _Copy
    in_device = all(s.memory_kind in (None, "device") for s in (src, dst))
    local = src.is_fully_addressable and dst.is_fully_addressable
    if in_device and local and len(src.device_set) > 1:
        return _Reshard
    return _Put


def transfer(sources: Sequence[Sharding], targets: Sequence[Sharding]) -> Callable:
    """The cheapest callable moving buffers laid out as `sources` to `targets`.

    The callable takes the buffers as positional arguments and returns the moved
    ones in order; `.public()` gives the same moves through `jax.device_put` alone.
    `.sources` keeps `sources` (a multi-process plan splits moves by where they run).
    """
    kinds = [_kind(s, t) for s, t in zip(sources, targets)]
    if len(set(kinds)) == 1:
        move = _make(kinds[0], list(targets), list(sources))
    else:
        move = _Mixed(targets, sources, kinds)
    move.sources = list(sources)
    return move


def is_transfer(step_fn) -> bool:
    """Whether a plan step's callable is a transfer."""
    return isinstance(step_fn, (_Copy, _Put, _Reshard, _Mixed))
