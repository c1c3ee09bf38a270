"""`spx.run` gives the whole batch's loss for a padded token mean on either kind of mesh, and
weighs microbatches by `microbatch_weight_fn(inputs, targets)`; the weight is part of the
run's cache key by value."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp

MASK = jnp.asarray([1.0] * 4 + [1.0, 0, 0, 0] + [0.0] * 4 + [1.0, 1.0, 0, 0])  # 4, 1, 0, 2 real rows
MESHES = {
    "pipeline": lambda: mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2]),
    "spmd": lambda: mp.create_mesh((1, 2, 1, 1, 1, 1), devices=jax.devices()[:2]),
}


class Net(spx.Module):
    def __init__(self, rngs):
        self.blocks = spx.nn.ModuleList([spx.nn.Linear(8, 8, rngs=rngs) for _ in range(2)])
        self.head = spx.nn.Linear(8, 4, rngs=rngs)

    def forward(self, x):
        for block in self.blocks:
            x = jnp.tanh(block(x))
        return self.head(x)


def padded(out, targets):
    y, mask = targets
    return jnp.sum(((out - y) ** 2).mean(-1) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def regularised(out, targets):
    """The padded mean plus a second token mean."""
    _, mask = targets
    return padded(out, targets) + 0.01 * jnp.sum(jnp.mean(out**2, -1) * mask) / jnp.maximum(
        jnp.sum(mask), 1.0
    )


def _data():
    k = jax.random.split(jax.random.key(0), 2)
    return jax.random.normal(k[0], (16, 8)), jax.random.normal(k[1], (16, 4))


def _close(got, want):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mesh", MESHES)
def test_padded_mean_is_the_whole_batch_loss(mesh):
    model, (x, y) = Net(spx.Rngs(0)), _data()
    want, want_grads = spx.value_and_grad(lambda m: padded(m(x), (y, MASK)))(model)
    value, grads = spx.run(
        model, inputs=x, targets=(y, MASK), mesh=MESHES[mesh](), loss_fn=padded, microbatches=4
    )
    _close(value, want)
    for got, expected in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        _close(got, expected)


@pytest.mark.parametrize("mesh", MESHES)
def test_microbatch_weight_fn(mesh):
    """A sum of two token means: the whole batch's loss as it is (proven), and with the real rows
    as weights."""
    model, (x, y) = Net(spx.Rngs(0)), _data()
    value, _ = spx.run(model, inputs=x, targets=(y, MASK), mesh=MESHES[mesh](), loss_fn=regularised, microbatches=4)
    _close(value, regularised(model(x), (y, MASK)))
    value, _ = spx.run(
        model,
        inputs=x,
        targets=(y, MASK),
        mesh=MESHES[mesh](),
        loss_fn=regularised,
        microbatches=4,
        microbatch_weight_fn=lambda inputs, targets: jnp.sum(targets[1]),
    )
    _close(value, regularised(model(x), (y, MASK)))
