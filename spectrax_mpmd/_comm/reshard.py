"""Moving an array between ranks whose submeshes lay it out differently, shard to shard.

Ranks may own submeshes of different sizes and axes, so a value crossing from one
to the other can change how it is cut (e.g. split over 2 devices on the sender, over
3 on the receiver). `jax.device_put` makes such a move by reading the whole array
into host memory first whenever the receiver's shards are not among the sender's.
Here each receiving device instead gets, from every sending shard that overlaps its
own piece, just the overlap (sliced where it lies, then copied), and assembles its
piece on itself: nothing is gathered on one device or on the host.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Sharding

Box = tuple[tuple[int, int], ...]  # per axis (start, stop) of a piece of an array


def _box(index: tuple, shape: tuple) -> Box:
    return tuple((sl.indices(n)[0], sl.indices(n)[1]) for sl, n in zip(index, shape))


def _overlap(a: Box, b: Box) -> Box | None:
    box = tuple((max(a0, b0), min(a1, b1)) for (a0, a1), (b0, b1) in zip(a, b))
    return box if all(lo < hi for lo, hi in box) else None


def _within(inner: Box, outer: Box) -> tuple[slice, ...]:
    """`inner`'s place inside `outer`, as slices of `outer`'s piece."""
    return tuple(slice(i0 - o0, i1 - o0) for (i0, i1), (o0, _) in zip(inner, outer))


def _part(buf, have: Box, box: Box, device) -> jax.Array:
    """The part `box` of the held shard `buf` (covering `have`), copied to `device`; sliced where
    it lies, and only when it is not the whole shard."""
    return jax.device_put(buf if box == have else buf[_within(box, have)], device)


def _piece(held: dict, box: Box, device, dtype) -> jax.Array:
    """The part `box` of the array on `device`, built from the held shards `{box: buffer}`."""
    for have, buf in held.items():
        if _overlap(have, box) == box:  # one sending shard covers it
            return _part(buf, have, box, device)
    parts = [(common, have, buf) for have, buf in held.items() if (common := _overlap(have, box))]
    cut = [k for k in range(len(box)) if any(common[k] != box[k] for common, _, _ in parts)]
    if len(cut) == 1:  # the parts tile the piece along one axis: join them in order
        parts.sort(key=lambda p: p[0][cut[0]])
        return jnp.concatenate([_part(buf, have, common, device) for common, have, buf in parts], cut[0])
    out = jnp.zeros(tuple(hi - lo for lo, hi in box), dtype, device=device)
    for common, have, buf in parts:
        out = out.at[_within(common, box)].set(_part(buf, have, common, device))
    return out


def reshard(x: jax.Array, target: Sharding) -> jax.Array:
    """`x` laid out as `target` (on any devices of this process), moved shard to shard."""
    held = {}
    for shard in x.addressable_shards:
        held.setdefault(_box(shard.index, x.shape), shard.data)  # one copy of each replicated piece
    places = target.addressable_devices_indices_map(x.shape)
    pieces = [_piece(held, _box(index, x.shape), device, x.dtype) for device, index in places.items()]
    return jax.make_array_from_single_device_arrays(x.shape, target, pieces)
