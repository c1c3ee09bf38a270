"""Content checksums of checkpoint arrays.

orbax's on-disk format (zarr chunks, zstd-compressed, in OCDBT files) stores
no checksum, so a flipped byte in a data file reads back as a different value
without any error. A save therefore records the CRC-32 of every array's bytes
(row-major, as `numpy.asarray` lays them out) in the checkpoint's `meta`, and
a restore recomputes it on the arrays read. The bytes of a whole array do not
depend on its sharding, so a restore into another layout checks the values a
save on any layout recorded. The arrays are copied to the host one at a time
(`zlib.crc32` runs there at a few GB/s, with no program to compile); an array
that this process cannot read whole (in a multi-process run, one with shards
on another process's devices) gets no checksum and is not checked.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import jax
import numpy as np

from .layout import CheckpointError


def checksum(x) -> str | None:
    """The CRC-32 of `x`'s bytes as 8 hex digits, or None when this process does not hold all of `x`."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        return None
    data = np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)
    return f"{zlib.crc32(data):08x}"


def checksums(arrays: Sequence) -> list[str | None]:
    """`checksum` of each array."""
    return [checksum(x) for x in arrays]


def checksums_by_name(arrays: dict) -> dict:
    """`{name: checksum}` of a `{name: array}` dict."""
    return dict(zip(arrays, checksums(list(arrays.values()))))


def verify(step: int, item: str, got: dict, recorded: dict) -> None:
    """Raise naming the first array read whose contents differ from the checksum its save recorded."""
    names = list(got)
    found = zip(names, checksums([got[n] for n in names]))
    bad = [n for n, c in found if None not in (c, recorded.get(n)) and c != recorded[n]]
    if bad:
        raise CheckpointError(
            f"restore: step {step}'s {item} array {bad[0]!r} does not match the checksum recorded when it "
            f"was saved ({len(bad)} of the {len(names)} {item} arrays differ): its data on disk is damaged. "
            "Restore another step (all_steps()), or pass checksums=False to read the values unchecked."
        )
