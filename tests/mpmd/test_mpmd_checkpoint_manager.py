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


SMALL = {"w": np.arange(3, dtype=np.float32)}


def test_the_save_interval_writes_multiples_and_a_first_step(tmp_path):
    """Orbax's rule: a multiple of the interval, or any step while the directory holds none; never a
    step older than the latest; `force=True` writes any new step."""
    with mp.CheckpointManager(tmp_path, save_interval_steps=10, async_save=False) as manager:
        wrote = {k: manager.save(k, params=SMALL) for k in (5, 7, 10, 15, 20, 12)}
        assert wrote == {5: True, 7: False, 10: True, 15: False, 20: True, 12: False}
        assert manager.save(13, params=SMALL, force=True)
    with mp.CheckpointManager(tmp_path, save_interval_steps=10, async_save=False) as manager:
        assert [manager.save(k, params=SMALL) for k in (25, 30)] == [False, True]  # not a fresh directory
        assert manager.all_steps() == [5, 10, 13, 20, 30]
    with mp.CheckpointManager(tmp_path / "from0", save_interval_steps=3, async_save=False) as manager:
        wrote = [manager.save(k, params=SMALL) for k in range(7)]
        assert wrote == [True, False, False, True, False, False, True]


@pytest.mark.parametrize("step", [np.int64(7), np.uint8(7), np.int32(7), np.array(7), jnp.int32(7)])
def test_any_integer_type_is_a_step(tmp_path, step):
    with mp.CheckpointManager(tmp_path, async_save=False) as manager:
        assert manager.save(step, params=SMALL)
        assert manager.all_steps() == [7]
        got = manager.restore(step, like=SMALL)
    assert type(got.step) is int and got.step == 7
    np.testing.assert_array_equal(got.params["w"], SMALL["w"])


@pytest.mark.parametrize(
    "step", [True, np.bool_(False), jnp.bool_(True), 3.0, np.float64(3.0), -1, np.int64(-2), "3"]
)
def test_a_step_that_is_not_a_non_negative_integer_is_refused(tmp_path, step):
    with mp.CheckpointManager(tmp_path, async_save=False) as manager:
        with pytest.raises(mp.CheckpointError, match=r"save: step must be a non-negative int .*got"):
            manager.save(step, params=SMALL)
        assert manager.all_steps() == []
        manager.save(3, params=SMALL)
        with pytest.raises(mp.CheckpointError, match=r"restore: step must be a non-negative int"):
            manager.restore(step, like=SMALL)
        with pytest.raises(mp.CheckpointError, match=r"delete: step must be a non-negative int"):
            manager.delete(step)


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_a_save_that_fails_midway_leaves_nothing_a_restore_would_read(tmp_path, monkeypatch, async_save):
    """The write raises inside orbax (a full disk): the error reaches the caller, the step's
    temporary folder is gone (also once orbax's background work of that save has ended), the step
    is not listed, restore reads the previous one, and the step can be saved again; a folder left
    by a save killed midway is refused by restore, and removed by the next manager."""
    from orbax.checkpoint import type_handlers

    async def full_disk(*args, **kwargs):
        raise OSError("No space left on device (simulated)")

    with mp.CheckpointManager(tmp_path, async_save=async_save) as manager:
        manager.save(1, params=SMALL)
        manager.wait_until_finished()
        with monkeypatch.context() as patch:
            patch.setattr(type_handlers.ArrayHandler, "serialize", full_disk)
            with pytest.raises(OSError, match="No space left"):
                manager.save(2, params={"w": SMALL["w"] + 1})
                manager.wait_until_finished()
        assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]
        assert manager.all_steps() == [1] and manager.restore(like=SMALL).step == 1
        manager.save(2, params={"w": SMALL["w"] + 1})
        manager.wait_until_finished()
        np.testing.assert_array_equal(manager.restore(like=SMALL).params["w"], SMALL["w"] + 1)
        (tmp_path / "3.orbax-checkpoint-tmp").mkdir()  # what a killed process leaves
        with pytest.raises(mp.CheckpointError, match=r"step 3 .* was never committed"):
            manager.restore(3, like=SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2", "3.orbax-checkpoint-tmp"]
    with mp.CheckpointManager(tmp_path) as manager:
        assert manager.all_steps() == [1, 2]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1", "2"]
