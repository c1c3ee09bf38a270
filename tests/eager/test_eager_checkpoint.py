"""Eager checkpoints: a model and its optimizer saved through orbax and restored exactly."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_eager as spx

pytest.importorskip("orbax.checkpoint")


class Net(spx.Module):
    def __init__(self, rngs, width=16):
        self.l1 = spx.nn.Linear(2, width, rngs=rngs)
        self.drop = spx.nn.Dropout(0.25, rngs=rngs)
        self.l2 = spx.nn.Linear(width, 1, rngs=rngs)

    def forward(self, x):
        return self.l2(self.drop(jnp.tanh(self.l1(x))))


X = jax.random.uniform(jax.random.key(1), (32, 2), minval=-1, maxval=1)
Y = X[:, :1] * X[:, 1:]


def _mse(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


@spx.jit(mutable=("parameters", "opt_state", "rngs"))
def _step(m, opt, x, y):
    loss, g = spx.value_and_grad(_mse)(m, x, y)
    opt.update(m, g)
    return loss


def _values(module) -> list:
    """Every variable's value, typed PRNG keys as their raw data."""
    leaves = jax.tree.leaves(spx.export(module)[1])
    return [
        np.asarray(jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x)
        for x in leaves
    ]


def _trained():
    model = Net(spx.Rngs(0))
    opt = spx.Optimizer(model, optax.adam(0.05))
    for _ in range(3):
        _step(model, opt, X, Y)
    return model, opt


def test_model_and_optimizer_round_trip_exactly(tmp_path):
    model, opt = _trained()
    spx.save_checkpoint(tmp_path, 3, model, opt, extra={"epoch": 1})
    fresh = Net(spx.Rngs(7))
    fresh_opt = spx.Optimizer(fresh, optax.adam(0.05))
    assert not all(np.array_equal(a, b) for a, b in zip(_values(fresh), _values(model)))
    restored = spx.restore_checkpoint(tmp_path, model=fresh, optimizer=fresh_opt)
    assert restored.step == 3 and restored.extra == {"epoch": 1}
    for a, b in zip(_values(fresh) + _values(fresh_opt), _values(model) + _values(opt), strict=True):
        assert a.dtype == b.dtype and np.array_equal(a, b)
    assert int(fresh_opt.step.value) == 3
    # the same next step (dropout keys included) on both
    np.testing.assert_array_equal(_step(fresh, fresh_opt, X, Y), _step(model, opt, X, Y))
    for a, b in zip(_values(fresh), _values(model), strict=True):
        np.testing.assert_array_equal(a, b)


def test_manager_and_structure_errors(tmp_path):
    model, opt = _trained()
    import spectrax_mpmd as mp

    with mp.CheckpointManager(tmp_path, max_to_keep=1) as manager:
        spx.save_checkpoint(manager, 1, model)
        spx.save_checkpoint(manager, 2, model)
        manager.wait_until_finished()
        assert manager.all_steps() == [2]
    wide = Net(spx.Rngs(0), width=8)
    with pytest.raises(mp.CheckpointError, match=r"parameters/l1\.weight.*float32\[2, 8\].*float32\[2, 16\]"):
        spx.restore_checkpoint(tmp_path, model=wide)
    with pytest.raises(mp.CheckpointError, match="no optimizer state"):
        spx.restore_checkpoint(
            tmp_path, model=Net(spx.Rngs(1)), optimizer=spx.Optimizer(model, optax.sgd(0.1))
        )
    with pytest.raises(TypeError, match="spx.Module"):
        spx.save_checkpoint(tmp_path, 3, {"w": jnp.ones(2)})
