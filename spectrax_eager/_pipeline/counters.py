"""`spx.run` advances the model's `Rngs` streams, as an eager call and `spx.jit` do.

Each draw from a stream folds the stream's counter into its key and increments
the counter (`_graph/rngs.py`). A run's forward returns the counters' new values next
to its outputs: in train mode as the loss's auxiliary output (stacked over
microbatches), in forward mode as one entry per microbatch concatenated like
the outputs. Every microbatch draws the same number of times, so the first
microbatch's counters are the new ones, written back after the call. A stream's
key is read, not written: microbatch `i` sees it folded with `i`.

In a job of several processes the counters come back from the last stage,
held by one process; the others receive them through the job's key-value
store (`spectrax_mpmd`'s exchange), so every process's model advances alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from .._graph.rngs import RngCount


def counter_positions(plan: Any) -> tuple[int, ...]:
    """The plan positions of the model's stream counters (`RngCount` variables)."""
    return tuple(j for j, info in enumerate(plan.infos) if issubclass(info.type, RngCount))


def counting_loss(loss_fn: Callable, has_aux: bool) -> Callable:
    """`loss_fn` for a forward that returns `(outputs, counters)`: the counters become (part of) aux."""

    def loss(outputs: Any, *targets: Any) -> Any:
        out, counters = outputs
        value = loss_fn(out, *targets)
        return (value[0], (value[1], counters)) if has_aux else (value, counters)

    return loss


def per_microbatch(counters: tuple, mode: str) -> tuple:
    """Counters as the forward returns them: scalars (train: aux) or one row per microbatch (forward)."""
    return counters if mode == "train" else tuple(c[None] for c in counters)


def split_counters(result: Any, mode: str, has_aux: bool) -> tuple[Any, tuple]:
    """`(the run's result as the caller expects it, the counters stacked over microbatches)`."""
    if mode == "forward":
        return result
    (loss, aux), grads = result
    user_aux, counters = aux if has_aux else (None, aux)
    return ((loss, user_aux) if has_aux else loss, grads), counters


def first_microbatch(counters: tuple, mesh: Any) -> tuple:
    """The first microbatch's counters, in every process of the job."""
    devices = np.asarray(getattr(mesh, "devices", ())).flat
    if all(d.process_index == jax.process_index() for d in devices):
        return tuple(np.asarray(c)[0] for c in counters)
    mine = [_local_value(c) for c in counters]
    held = [json.loads(v) for v in _exchange().allgather(json.dumps(mine))]
    return tuple(
        np.asarray(next(h[k] for h in held if h[k] is not None), c.dtype) for k, c in enumerate(counters)
    )


@functools.cache  # one exchange per process (a cache of the object, not ambient state)
def _exchange() -> Any:
    """The exchange of counters among the processes of a job, made on first use."""
    import spectrax_mpmd as mp

    return mp.Exchange("spx.run rng counters")


def _local_value(stacked: jax.Array) -> Any:
    """The first row of `stacked` as a Python value, when this process holds it (else None)."""
    if stacked.is_fully_addressable:
        return np.asarray(stacked)[0].tolist()
    if stacked.sharding.is_fully_replicated and stacked.addressable_shards:
        return np.asarray(stacked.addressable_data(0))[0].tolist()
    return None


def write_counters(plan: Any, positions: tuple[int, ...], counters: tuple) -> None:
    """Store the new counters (host values) in the model's variables, uncommitted as a stream keeps
    them (`_graph/rngs.py`)."""
    for j, new in zip(positions, counters):
        var = plan.vars[j]
        var.value = jax.device_put(np.asarray(new, var.value.dtype))
