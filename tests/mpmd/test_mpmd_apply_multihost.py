"""The train step with its update in the plan, in a 2-process job: equal to one process's run."""

from __future__ import annotations

import os

import apply_worker
import jax
import numpy as np
from launching import launch
from mpmd_cases import RTOL
from test_mpmd_multihost import TRANSPORTS

import spectrax_mpmd as mp

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "apply_worker.py")


def _merged(out_dir, case: str) -> dict:
    """Every process's arrays of `case`: each leaf from its owner; a scalar (the losses, a step
    count), which every process returns, equal on each."""
    merged: dict = {}
    for p in range(2):
        with np.load(os.path.join(out_dir, f"{case}_p{p}.npz")) as z:
            for k in z.files:
                if k in merged:
                    assert k == "losses" or z[k].shape == (), f"{case}: {k} returned by two processes"
                    np.testing.assert_array_equal(z[k], merged[k])
                merged[k] = z[k]
    return merged


def test_two_processes_train_as_one(tmp_path):
    """2 processes x 2 devices, 4 ranks, ZeroBubbleH1: 5 steps with `clip_by_global_norm` inside
    the transformation, and with clipping and non-finite skips validated after the fact, give
    the losses, parameters and optimizer state of the same steps in one process, through each
    transport; every process returns the losses and holds only its ranks' leaves."""
    job = launch(WORKER, tmp_path, nproc=2, devices=2, limit=300, timeout=20)
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    refs = {case: apply_worker.train(case, mesh) for case in apply_worker.CASES}
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in TRANSPORTS:
        for case, (losses, params, state) in refs.items():
            merged = _merged(tmp_path, f"{case}-{transport}")
            np.testing.assert_allclose(merged["losses"], losses, rtol=RTOL)
            leaves = jax.tree.leaves((params, state))
            assert sorted(merged) == sorted(["losses", *(f"x{k}" for k in range(len(leaves)))])
            for k, x in enumerate(leaves):
                np.testing.assert_allclose(merged[f"x{k}"], x, rtol=RTOL, atol=1e-6)
