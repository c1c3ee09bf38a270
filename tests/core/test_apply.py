"""`apply` dispatch: built-in layers, a third-party params type, and the unregistered-type error."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jaxtyping import Array, Float

import spectrax_core as sc
from spectrax_core import nn


class Scale(eqx.Module):
    """A third-party params type: multiplies by a learned vector, then by a static factor."""

    w: Float[Array, " d"]
    factor: float = eqx.field(static=True)


@sc.register_apply(Scale)
def _apply_scale(params: Scale, x, *, shift=0.0):
    return x * params.w * params.factor + shift


class Unregistered(eqx.Module):
    w: Float[Array, " d"]


def test_third_party_type_is_dispatched():
    p = Scale(w=jnp.array([1.0, 2.0, 3.0]), factor=2.0)
    x = jnp.array([[1.0, 1.0, 1.0], [0.5, 0.0, -1.0]])
    np.testing.assert_allclose(sc.apply(p, x), x * jnp.array([2.0, 4.0, 6.0]))
    np.testing.assert_allclose(sc.apply(p, x, shift=1.0), x * jnp.array([2.0, 4.0, 6.0]) + 1.0)
    grad = jax.grad(lambda q: jnp.sum(jax.jit(sc.apply)(q, x)))(p)
    np.testing.assert_allclose(grad.w, 2.0 * x.sum(0))


def test_third_party_type_composes_with_core_layers():
    lin = nn.Linear.init(jax.random.key(0), 3, 3)
    p = Scale(w=jnp.ones(3), factor=0.5)
    x = jnp.ones((2, 3))
    np.testing.assert_allclose(sc.apply(p, sc.apply(lin, x)), 0.5 * (x @ lin.weight + lin.bias), rtol=1e-6)


def test_unregistered_type_raises_clear_type_error():
    with pytest.raises(
        TypeError, match=r"no function registered for params of type Unregistered.*register_apply"
    ):
        sc.apply(Unregistered(w=jnp.ones(2)), jnp.ones(2))


def test_every_core_layer_is_registered():
    """Dispatch reaches each layer's function (traced on shapes only; numerics are tested elsewhere)."""
    key = jax.random.key(0)
    x = jax.ShapeDtypeStruct((1, 4, 8), jnp.float32)
    for init, inp, out in [
        (lambda: nn.Linear.init(key, 8, 3), x, (1, 4, 3)),
        (lambda: nn.Embed.init(key, 5, 8), jax.ShapeDtypeStruct((1, 4), jnp.int32), (1, 4, 8)),
        (lambda: nn.LayerNorm.init(None, 8), x, (1, 4, 8)),
        (lambda: nn.RMSNorm.init(None, 8), x, (1, 4, 8)),
        (lambda: nn.MLP.init(key, 8, 16), x, (1, 4, 8)),
        (lambda: nn.GatedMLP.init(key, 8, 16), x, (1, 4, 8)),
        (lambda: nn.Attention.init(key, 8, 2), x, (1, 4, 8)),
        (lambda: nn.Block.init(key, 8, 2, 16), x, (1, 4, 8)),
        (lambda: nn.BlockStack.init(key, 2, d_model=8, n_heads=2, d_ff=16), x, (1, 4, 8)),
        (lambda: nn.Conv1d.init(key, 8, 3, 2, padding="VALID"), x, (1, 3, 3)),
        (
            lambda: nn.Conv2d.init(key, 4, 3, 2, stride=2),
            jax.ShapeDtypeStruct((1, 4, 6, 4), x.dtype),
            (1, 2, 3, 3),
        ),
    ]:
        params = jax.eval_shape(init)
        assert jax.eval_shape(sc.apply, params, inp).shape == out, type(params).__name__
    y = jnp.ones(3)
    assert sc.apply(nn.Dropout(rate=0.5), y, deterministic=True) is y
