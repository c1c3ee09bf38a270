"""`assign_stage`: stamp the Variables created in a block of code with their pipeline stage."""

from __future__ import annotations

import contextlib

_assigned: list[tuple[int, int]] = []  # (current, total) of the active assign_stage contexts


@contextlib.contextmanager
def assign_stage(*, total: int, current: int):
    """Stamp every Variable created inside with pipeline stage `current` of `total`.

    `spx.run` on an MPMD mesh then cuts the model where its forward moves from
    one stage's modules to the next; `total` must equal ranks x virtual stages.
    """
    if not (isinstance(total, int) and isinstance(current, int) and 0 <= current < total):
        raise ValueError(
            f"assign_stage: need integers 0 <= current < total, received current={current!r}, total={total!r}."
        )
    _assigned.append((current, total))
    try:
        yield
    finally:
        _assigned.pop()


def stamp(metadata: dict) -> dict:
    """`metadata` with the active `assign_stage` stamp added (an explicit `stage=` wins)."""
    if not _assigned or "stage" in metadata:
        return metadata
    current, total = _assigned[-1]
    return {**metadata, "stage": current, "stages": total}
