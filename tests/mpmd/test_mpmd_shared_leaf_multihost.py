"""A parameter leaf read by ranks in two processes, in a 2-process job: its updated value, held by
its owner's process after a step, reaches the other process's reader on the next step."""

from __future__ import annotations

import os

import jax
import numpy as np
import shared_leaf_worker
from launching import launch
from mpmd_cases import ATOL, RTOL
from test_mpmd_multihost import TRANSPORTS

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shared_leaf_worker.py")


def test_leaf_shared_across_processes_trains_as_one(tmp_path):
    """2 processes x 4 devices, 4 ranks of `fsdp=2`, the bias read by the first stage (process 0)
    and the last (process 1): 3 steps of the one-plan step (clipping and AdamW), and of
    `sxvalue_and_grad` with the caller's own update, give the losses and parameters of the unsplit
    steps on one device; each parameter leaf comes back from exactly one process. A leaf held by one
    process, passed to a forward that reads it on the other process's rank too, is refused there."""
    job = launch(WORKER, tmp_path, nproc=2, devices=4, limit=150, timeout=60)
    refs = {form: shared_leaf_worker.reference(form) for form in shared_leaf_worker.FORMS}
    code, out, _ = job.wait()
    assert code == 0, out[-4000:]
    for transport in TRANSPORTS:
        for form, (losses, params) in refs.items():
            leaves, got = jax.tree.leaves(params), {}
            for p in range(2):
                with np.load(os.path.join(tmp_path, f"{form}-{transport}_p{p}.npz")) as z:
                    np.testing.assert_allclose(z["losses"], losses, rtol=RTOL)
                    for k in z.files:
                        assert k == "losses" or k not in got, f"{form}: {k} held by two processes"
                        got[k] = z[k]
            assert sorted(got) == sorted(["losses", *(f"x{k}" for k in range(len(leaves)))])
            for k, x in enumerate(leaves):
                np.testing.assert_allclose(got[f"x{k}"], x, rtol=RTOL, atol=ATOL)
    for p, leaf in ((0, 4), (1, 0)):  # the last weight on process 0, the bias on process 1
        with open(os.path.join(tmp_path, f"refused_p{p}.txt")) as f:
            refused = f.read()
        assert f"argument leaf {leaf} is read by a pipeline rank of this process" in refused, refused
        assert "held only by another process's devices" in refused and "Pass this process its own" in refused
