"""The script the multi-process train-step test launches: 5 steps with the update in the plan.

    python -m spectrax_mpmd.launch --nproc 2 --devices-per-proc 2 apply_worker.py OUT

Each process writes, per case and transport, the losses (every process returns them) and the
parameter and optimizer-state leaves it holds to `OUT/<case>-<transport>_p<process>.npz`.
The test computes the references in its own process with `train`.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax

import spectrax_mpmd as mp
from spectrax_core import schedules as S

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

STEPS = 5
CASES = {  # name -> keyword arguments of sxvalue_and_grad_and_apply (beyond mesh and schedule)
    "clip-in-tx": {},
    "post": {"max_grad_norm": 0.2, "skip_nonfinite": True, "validation": "post"},
}


def tx_of(case: str):
    adam = optax.adamw(1e-2)
    return optax.chain(optax.clip_by_global_norm(0.2), adam) if case == "clip-in-tx" else adam


def train(case: str, mesh) -> tuple:
    """`(losses, params, opt_state)` after `STEPS` steps of the heterogeneous model on `mesh`."""
    from mpmd_cases import hetero_batch, hetero_loss, hetero_params

    tx = tx_of(case)
    step = mp.sxvalue_and_grad_and_apply(
        hetero_loss, tx, mesh=mesh, schedule=S.ZeroBubbleH1(microbatches=4), **CASES[case]
    )
    params = jax.jit(hetero_params, static_argnums=1)(jax.random.key(4), 4)
    state = jax.jit(tx.init)(params)
    losses = []
    for k in range(STEPS):
        loss, params, state = step(params, state, jax.jit(hetero_batch)(jax.random.key(100 + k)))
        losses.append(float(loss))
    return np.asarray(losses), params, state


def owned(losses, params, state) -> dict:
    out = {"losses": losses}
    for k, x in enumerate(jax.tree.leaves((params, state))):
        if x.is_fully_addressable:
            out[f"x{k}"] = np.asarray(x)
    return out


def main() -> None:
    from spectrax_mpmd._env import TRANSPORT_ENV, TRANSPORTS

    out = sys.argv[1]
    mp.initialize()
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    process = os.environ["JAX_PROCESS_ID"]
    for transport in TRANSPORTS:
        os.environ[TRANSPORT_ENV] = transport
        for case in CASES:
            arrays = owned(*train(case, mesh))
            np.savez(os.path.join(out, f"{case}-{transport}_p{process}.npz"), **arrays)
    print("apply: done", flush=True)


if __name__ == "__main__":
    main()
