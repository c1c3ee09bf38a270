"""The script the multi-process shared-leaf test launches: a parameter leaf (the bias) read by the
first and the last stage, whose ranks live in different processes, trained for `STEPS` steps.

    python -m spectrax_mpmd.launch --nproc 2 --devices-per-proc 4 shared_leaf_worker.py OUT

Two forms, through each transport: the one-plan step (`sxvalue_and_grad_and_apply`), and
`sxvalue_and_grad` with the caller's own SGD update, leaf by leaf. Each process writes the losses and the
parameter leaves it holds to `OUT/<form>-<transport>_p<process>.npz`; the test computes the
references in its own process with `reference`.
"""

from __future__ import annotations

import os
import sys

import jax
import numpy as np
import optax

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core import sharding as core_sharding

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from ranks_worker import _layers, batch_of, loss, params_of  # noqa: E402

STEPS, RANKS = 3, 4
FORMS = ("apply", "grad")


def tx():
    return optax.chain(optax.clip_by_global_norm(0.5), optax.adamw(1e-2))


def sgd(params, grads):
    """The caller's own update of the `grad` form, leaf by leaf (the leaves live on different
    ranks, so one jitted update over the whole tree cannot take them)."""
    return jax.tree.map(jax.jit(lambda p, g: p - 0.1 * g), params, grads)


def reference(form: str) -> tuple:
    """`(losses, params)` after `STEPS` unsplit steps of `form` on one device."""
    params, state = params_of(RANKS), tx().init(params_of(RANKS))
    losses = []
    for k in range(STEPS):
        value, grads = jax.value_and_grad(loss)(params, *batch_of(k))
        if form == "apply":
            updates, state = tx().update(grads, state, params)
            params = optax.apply_updates(params, updates)
        else:
            params = sgd(params, grads)
        losses.append(float(value))
    return np.asarray(losses), params


def _train(form: str, mesh) -> tuple:
    kw = {"mesh": mesh, "schedule": S.Std1F1B(microbatches=4), "rules": core_sharding.Rules.default()}
    params = params_of(RANKS)
    state, losses = jax.jit(tx().init)(params), []
    if form == "apply":
        step = mp.sxvalue_and_grad_and_apply(loss, tx(), **kw)
    else:
        grad = mp.sxvalue_and_grad(loss, **kw)

        def step(params, state, x, y):
            value, grads = grad(params, x, y)
            return value, sgd(params, grads), state

    for k in range(STEPS):
        value, params, state = step(params, state, *batch_of(k))
        losses.append(float(value))
    return np.asarray(losses), params


def refused(params, mesh) -> str:
    """The error of a forward `sxjit` reading, as plain arguments, the bias (which the one-plan step
    left on process 0's first rank) on the last rank too and the last weight (left on process 1's
    last rank) on the first rank too: each process refuses the leaf the other holds."""
    forward = mp.sxjit(
        lambda p, x: _layers(p, x + p["w"][-1][0], RANKS - 1),
        mesh=mesh,
        schedule=S.GPipe(microbatches=2),
        batch_argnums=1,
    )
    try:
        forward(params, batch_of(0)[0])
    except mp.MpmdError as err:
        return str(err)
    return "no error"


def main() -> None:
    from spectrax_mpmd._env import TRANSPORT_ENV, TRANSPORTS

    out = sys.argv[1]
    mp.initialize()
    mesh = mp.create_rank_mesh([{"fsdp": 2}] * RANKS)
    process, trained = os.environ["JAX_PROCESS_ID"], {}
    for transport in TRANSPORTS:
        os.environ[TRANSPORT_ENV] = transport
        for form in FORMS:
            losses, params = _train(form, mesh)
            trained[form] = params
            arrays = {"losses": losses}
            for k, leaf in enumerate(jax.tree.leaves(params)):
                if leaf.is_fully_addressable:
                    arrays[f"x{k}"] = np.asarray(leaf)
            np.savez(os.path.join(out, f"{form}-{transport}_p{process}.npz"), **arrays)
    with open(os.path.join(out, f"refused_p{process}.txt"), "w") as f:
        f.write(refused(trained["apply"], mesh))
    print("shared leaf: done", flush=True)


if __name__ == "__main__":
    main()
