"""One instrumented run of a plan, step by step: what every measurement of a plan is built on.

`Plan.run` calls the steps as straight-line code, with no place for a hook. A
measurement (a timeline, peak activations or bytes, the host profile, the stage
profile) needs to see or time each step, so it replays the same steps here with
hooks instead of keeping its own copy of the loop.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax


def _call(k: int, fn, args: list):
    return fn(*args)


def replay(
    plan,
    placed_inputs: Sequence,
    *,
    call: Callable = _call,
    stored: Callable | None = None,
    freed: Callable | None = None,
    ready: bool = False,
    steps: Sequence | None = None,
) -> list:
    """Run `plan` once, one step at a time, in this process; returns the buffers.

    `steps`: the steps to run, `plan.steps` (cell by cell) by default, or `plan.hot_steps` (the
    calls the step issues, fused runs of cells as one).
    `call(k, fn, args)` runs step `k` and returns its results (time it there);
    `stored(k, buf)` sees the buffers once step `k`'s results are stored, before
    its frees; `freed(k, buf)` after them, and once with `k = -1` before the
    first step. `ready=True` waits for the inputs before the first step. The steps of a
    multi-process plan pair up only inside `Plan.run`: callers check `check_single_process`.
    """
    buf = plan.buffers(placed_inputs)
    if ready:
        jax.block_until_ready(buf)
    if freed is not None:
        freed(-1, buf)
    for k, (fn, ins, outs, frees) in enumerate(plan.steps if steps is None else steps):
        results = call(k, fn, [buf[i] for i in ins])
        for o, r in zip(outs, results):
            buf[o] = r
        if stored is not None:
            stored(k, buf)
        for f in frees:
            buf[f] = None
        if freed is not None:
            freed(k, buf)
    return buf
