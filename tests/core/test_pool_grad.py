"""Window reductions are differentiable under `jax.jit`: the gradient of a max pool reaches the
maximum of each window, that of an average pool spreads evenly (both computed by hand here)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc


@pytest.mark.parametrize("padding", ["VALID", 0, "SAME"])
def test_pooling_gradients_under_jit(padding):
    x = jnp.asarray(np.random.default_rng(0).permutation(32).reshape(1, 4, 4, 2), jnp.float32)
    grad_max = jax.jit(jax.grad(lambda a: sc.functional.max_pool(a, (2, 2), padding=padding).sum()))(x)
    windows = np.asarray(x).reshape(1, 2, 2, 2, 2, 2).transpose(0, 1, 3, 5, 2, 4).reshape(1, 2, 2, 2, 4)
    want = (windows == windows.max(-1, keepdims=True)).astype(np.float32)
    want = want.reshape(1, 2, 2, 2, 2, 2).transpose(0, 1, 4, 2, 5, 3).reshape(1, 4, 4, 2)
    np.testing.assert_array_equal(grad_max, want)
    grad_avg = jax.jit(jax.grad(lambda a: sc.functional.avg_pool(a, (2, 2), padding=padding).sum()))(x)
    np.testing.assert_allclose(grad_avg, np.full((1, 4, 4, 2), 0.25))
