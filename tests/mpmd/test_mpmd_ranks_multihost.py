"""Pipeline ranks of different sizes in a job of two processes (4 CPU devices each), each process
owning whole ranks: training equals the unsplit function on one device (`ranks_worker.py`)."""

from __future__ import annotations

import glob
import os

import jax
import numpy as np
import pytest
from launching import launch
from ranks_worker import RANKS, STEPS, batch_of, loss, params_of, reference_step, tx

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ranks_worker.py")
RTOL = 1e-5


def _merged(out_dir, case: str) -> dict:
    """Both processes' shares of `case`: the loss and the optimizer's step count (scalars every
    process returns) are on both and equal, every other leaf on one."""
    files = sorted(glob.glob(os.path.join(out_dir, f"{case}_p*.npz")))
    assert len(files) == 2, files
    merged: dict = {}
    for f in files:
        with np.load(f) as z:
            for k in z.files:
                if k in merged and (k in ("loss", "losses") or z[k].ndim == 0):
                    np.testing.assert_array_equal(z[k], merged[k])
                    continue
                assert k not in merged, f"{case}: {k} returned by both processes"
                merged[k] = z[k]
    return merged


def _check(merged: dict, prefix: str, trees) -> None:
    leaves = jax.tree.leaves(trees)
    assert sorted(k for k in merged if k.startswith(prefix)) == sorted(
        f"{prefix}{k}" for k in range(len(leaves))
    )
    for k, want in enumerate(leaves):
        np.testing.assert_allclose(merged[f"{prefix}{k}"], want, rtol=RTOL, atol=1e-6)


@pytest.mark.slow  # two launched processes compiling their ranks: about a minute on 2 shared cores
def test_ranks_of_different_sizes_across_processes(tmp_path):
    """Std1F1B on ranks of 1, 1, 2 | 4 devices and of (fsdp=2 x tp=2) | (fsdp=4), with the
    default FSDP x TP rules inside each rank, and two one-plan steps (clipping, AdamW) on the
    first, through each transport: loss, gradients, parameters and optimizer state equal the
    unsplit computation on one device."""
    job = launch(WORKER, "ranks", tmp_path, nproc=2, devices=4, limit=400, timeout=60)
    grads = {
        name: jax.jit(jax.value_and_grad(loss))(params_of(len(r)), *batch_of(0)) for name, r in RANKS.items()
    }
    params = params_of(4)
    state, losses = tx().init(params), []
    for k in range(STEPS):
        value, params, state = jax.jit(reference_step)(params, state, *batch_of(k))
        losses.append(float(value))
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in ("transfer", "ppermute"):
        for name, (value, g) in grads.items():
            merged = _merged(tmp_path, f"grad-{name}-{transport}")
            np.testing.assert_allclose(merged["loss"], value, rtol=RTOL)
            _check(merged, "g", g)
        merged = _merged(tmp_path, f"apply-1124-{transport}")
        np.testing.assert_allclose(merged["losses"], losses, rtol=RTOL)
        _check(merged, "x", (params, state))
