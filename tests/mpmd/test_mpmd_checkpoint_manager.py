"""`CheckpointManager` steps: a save in flight is waited for by the manager that made it, the save
interval follows orbax's rule, and a step may be any non-negative integer type."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp

pytest.importorskip("orbax.checkpoint")

BIG = 1 << 22  # 16 MB of float32: written in the background for a while


def _tree(k: int) -> dict:
    return {"w": jnp.arange(BIG, dtype=jnp.float32) + k}


LIKE = {"w": np.zeros(BIG, np.float32)}


def _value(restored) -> float:
    return float(restored.params["w"][0])


def test_restore_right_after_an_async_save_reads_that_step(tmp_path):
    with mp.CheckpointManager(tmp_path) as manager:
        manager.save(1, params=_tree(1))
        manager.wait_until_finished()
        for k in (2, 3, 4):
            assert manager.save(k, params=_tree(k))  # asynchronous: still being written
            if k == 2:
                got = manager.restore(like=LIKE)  # the latest: the step just saved
            elif k == 3:
                got = manager.restore(3, like=LIKE)  # that step by number
            else:
                manager.delete(4)  # a step in flight can be deleted once written
                got = manager.restore(like=LIKE)
            want = 3 if k == 4 else k
            assert (got.step, _value(got)) == (want, want)
        assert manager.all_steps() == [1, 2, 3]
