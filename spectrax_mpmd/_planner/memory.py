"""Bytes and seconds of a choice of recompute and offload per stage, from profiles of steps made
without that choice.

What a stage keeps for its backward depends on its own setting only: its
residuals (or, recomputing, its kept inputs) and its stash are those of a step
profiled with the same `remat` value, whatever the other stages do. Offload
moves the values `spectrax_mpmd._trace.policy.offloaded` picks (the rule the
plan builder follows) from device to host bytes, and costs their copies at the
measured host bandwidth: each offloaded value once to the host after the cell
that makes it, and once back before each cell that reads it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import replace

import jax
import jax.numpy as jnp

from spectrax_core.schedules import StageCost, StageMemory

from .._runtime import StageProfile
from .._trace.policy import HOST, Offload, offloaded

_STAGE_FIELDS = ("inputs", "kept_inputs", "residuals", "grads", "stash")


def _moved(values: Sequence[tuple[int, int]], share: float) -> int:
    """Device bytes of the values (`(selection bytes, device bytes)` each) a share moves."""
    return sum(values[k][1] for k in offloaded([g for g, _ in values], share))


def host_bytes(profile: StageProfile, s: int, offload: Offload) -> tuple[int, int]:
    """`(residual bytes, stash bytes)` of one microbatch that `offload` moves to host on stage `s`."""
    res, stash = profile.saved_values[s]
    return _moved(res, offload.residuals), _moved(stash, offload.stash)


def chosen_memory(
    profiles: Mapping, remat: Sequence, offload: Sequence[Offload], optimizer: tuple | None = None
) -> StageMemory:
    """The `StageMemory` of a step whose stage `s` recomputes as `remat[s]` and offloads as
    `offload[s]`, from `profiles[value]`, the `StageProfile` of a step with `remat=value` (for
    each value used; none offloading). Per-rank bytes come from any of them (they agree);
    `optimizer` replaces the optimizer state's bytes."""
    first = next(iter(profiles.values())).memory
    per_stage: dict = {name: [] for name in (*_STAGE_FIELDS, "host_residuals", "host_stash")}
    for s, (value, o) in enumerate(zip(remat, offload)):
        profile = profiles[value]
        res_host, stash_host = host_bytes(profile, s, o)
        for name in _STAGE_FIELDS:
            per_stage[name].append(getattr(profile.memory, name)[s])
        per_stage["residuals"][s] -= res_host
        per_stage["stash"][s] -= stash_host
        per_stage["host_residuals"].append(res_host)
        per_stage["host_stash"].append(stash_host)
    memory = replace(first, **{name: tuple(v) for name, v in per_stage.items()})
    return memory if optimizer is None else replace(memory, optimizer=optimizer)


def chosen_cost(
    profiles: Mapping, remat: Sequence, offload: Sequence[Offload], bandwidth: float, comm: float = 0.0
) -> StageCost:
    """The `StageCost` of the same choice: each stage's cell times from the profile of its `remat`
    value, plus its offloaded bytes' copies at `bandwidth` bytes/s (F: residuals out; B: back;
    I: residuals back, stash out; W: residuals and stash back)."""
    rows: dict = {"F": [], "B": [], "I": [], "W": []}
    for s, (value, o) in enumerate(zip(remat, offload)):
        profile = profiles[value]
        cost = profile.stage_cost(comm=comm)
        res, stash = host_bytes(profile, s, o)
        extra = {"F": res, "B": res, "I": res + stash, "W": res + stash}
        for kind in rows:
            rows[kind].append(getattr(cost, kind)[s] + extra[kind] / bandwidth)
    return StageCost(*(tuple(rows[k]) for k in "FBIW"), comm=comm)


def host_bandwidth(device=None, nbytes: int = 1 << 22, rounds: int = 3) -> float:
    """Measured bytes per second of one device -> host (`pinned_host`) copy of `nbytes` (the best of
    `rounds`), on `device` (default the first)."""
    device = device if device is not None else jax.devices()[0]
    sharding = jax.sharding.SingleDeviceSharding(device)
    x = jax.device_put(jnp.zeros((nbytes // 4,), jnp.float32), sharding).block_until_ready()
    host = sharding.with_memory_kind(HOST)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        jax.device_put(x, host).block_until_ready()
        best = min(best, time.perf_counter() - start)
    return nbytes / best
