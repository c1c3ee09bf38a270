"""The script the multi-process test of ranks of different sizes launches:

    python -m spectrax_mpmd.launch --nproc 2 --devices-per-proc 4 ranks_worker.py ranks OUT

Its meshes, each process owning whole ranks:

* `1124`: ranks of 1, 1 and 2 devices in process 0, a rank of 4 (`fsdp=4`) in process 1. The
  activation crossing processes is split over 2 devices on one side and 4 on the other (its
  cotangent the other way round); the loss goes from a 4-device rank to a 1-device one.
* `22-4`: a rank of `fsdp=2 x tp=2` in process 0, a rank of `fsdp=4` in process 1: as many
  devices on each side, the activation cut 2-way on one and 4-way on the other.

Each process writes what it owns (the loss, the gradient or parameter leaves on its devices) to
`OUT/<case>-<transport>_p<process>.npz`, through each transport; the test computes the
references in its own process with this module's functions.
"""

from __future__ import annotations

import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core import sharding as core_sharding

DIM, BATCH = 8, 32
RANKS = {
    "1124": [{"fsdp": 1}, {"fsdp": 1}, {"fsdp": 2}, {"fsdp": 4}],
    "22-4": [{"fsdp": 2, "tp": 2}, {"fsdp": 4}],
}
STEPS = 2  # of the one-plan step


def params_of(n_stages: int) -> dict:
    rng = np.random.default_rng(n_stages)
    return {
        "w": [(rng.standard_normal((DIM, DIM)) * 0.4).astype(np.float32) for _ in range(n_stages)],
        "b": (rng.standard_normal(DIM) * 0.1).astype(np.float32),
    }


def batch_of(seed: int) -> tuple:
    rng = np.random.default_rng(100 + seed)
    x = rng.standard_normal((BATCH, DIM)).astype(np.float32)
    return x, rng.standard_normal((BATCH, DIM)).astype(np.float32)


def _layers(params, x, again: int):
    """One tanh layer per stage; every boundary splits the activation over the `fsdp` axis; the
    bias is added before the first stage and again after stage `again`'s layer."""
    h = x + params["b"]
    for k, w in enumerate(params["w"]):
        if k:
            h = mp.sxstage_iter(h, sharding=P("fsdp"))
        h = jnp.tanh(h @ w)
        if k == again:
            h = h + params["b"]
    return h


def loss(params, x, y):
    """The bias is read by the first and the last stage: its gradient is summed across processes."""
    return jnp.mean((_layers(params, x, len(params["w"]) - 1) - y) ** 2)


def near_loss(params, x, y):
    """The bias is read by stages 0 and 2, both in process 0 on `1124` (the one-plan step takes
    its updated parameters back as inputs, each on the ranks that read it)."""
    return jnp.mean((_layers(params, x, 2) - y) ** 2)


def tx():
    return optax.chain(optax.clip_by_global_norm(0.05), optax.adamw(1e-2))


def reference_step(params, state, x, y):
    """The one-plan step's unsplit reference: the update of `tx` after the plain gradient."""
    value, grads = jax.value_and_grad(near_loss)(params, x, y)
    updates, state = tx().update(grads, state, params)
    return value, optax.apply_updates(params, updates), state


def _owned(prefix: str, *trees) -> dict:
    out = {}
    for k, leaf in enumerate(jax.tree.leaves(trees)):
        if leaf.is_fully_addressable:
            out[f"{prefix}{k}"] = np.asarray(leaf)
    return out


def _run(name: str) -> dict:
    """`{case: arrays}` of this process's share of mesh `name`'s steps."""
    ranks = RANKS[name]
    mesh = mp.create_rank_mesh(ranks)
    rules = core_sharding.Rules.default()
    schedule = S.Std1F1B(microbatches=4)
    params, (x, y) = params_of(len(ranks)), batch_of(0)
    value, grads = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=schedule, rules=rules)(params, x, y)
    results = {f"grad-{name}": {"loss": np.asarray(value), **_owned("g", grads)}}
    if name == "1124":
        step = mp.sxvalue_and_grad_and_apply(near_loss, tx(), mesh=mesh, schedule=schedule, rules=rules)
        state, losses = jax.jit(tx().init)(params), []
        for k in range(STEPS):
            value, params, state = step(params, state, *batch_of(k))
            losses.append(float(value))
        results[f"apply-{name}"] = {"losses": np.asarray(losses), **_owned("x", params, state)}
    return results


def main() -> None:
    from spectrax_mpmd._env import TRANSPORT_ENV, TRANSPORTS

    out = sys.argv[2]
    mp.initialize()
    process = os.environ["JAX_PROCESS_ID"]
    for transport in TRANSPORTS:
        os.environ[TRANSPORT_ENV] = transport
        for name in RANKS:
            for case, arrays in _run(name).items():
                np.savez(os.path.join(out, f"{case}-{transport}_p{process}.npz"), **arrays)
    print("ranks: done", flush=True)


if __name__ == "__main__":
    main()
