"""Core FP8 linear with delayed scaling: error bounds, history rolling, gradients, training, bad input.

Error bounds: rounding to a float format with `m` mantissa bits moves a
normal value by at most `u = 2**-(m+1)` relative (e4m3: 2**-4, e5m2: 2**-3)
and a subnormal one by at most half the smallest step (e4m3fn: 2**-10, e5m2:
2**-17) divided by the tensor's scale. For a product `a @ b` of quantised
operands, `|aq bq - a b| <= ea @ |b| + |a| @ eb + ea @ eb` elementwise, where
`ea = u_a |a| + h_a` is the per-element bound of `a`.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_core as sc
from spectrax_core.nn import GRAD, INPUT, WEIGHT
from spectrax_core.nn._fp8 import E4M3, E5M2

D_IN, D_OUT = 16, 8
U = {E4M3: 2.0**-4, E5M2: 2.0**-3}
HALF_SUBNORMAL = {E4M3: 2.0**-10, E5M2: 2.0**-17}


def _err(t, scale, dtype):
    return U[dtype] * jnp.abs(t) + HALF_SUBNORMAL[dtype] / scale


def _product_bound(a, ea, b, eb):
    return ea @ jnp.abs(b) + jnp.abs(a) @ eb + ea @ eb


def _qdq(t, scale, dtype):
    fmax = float(jnp.finfo(dtype).max)
    return jnp.clip(t * scale, -fmax, fmax).astype(dtype).astype(jnp.float32) / scale


@pytest.fixture(scope="module")
def setup():
    """An FP8 layer whose history holds one step of this input's and gradient's maxima."""
    layer = sc.nn.Fp8Linear.init(jax.random.key(0), D_IN, D_OUT, history_len=4)
    x = 3.0 * jax.random.normal(jax.random.key(1), (32, D_IN))
    ct = jax.random.normal(jax.random.key(2), (32, D_OUT)) * 1e-2
    grads = jax.jit(jax.grad(lambda p: jnp.sum(sc.apply(p, x) * ct)))(layer)
    return sc.nn.fp8_update(layer, grads), x, ct


def test_output_within_fp8_bound_and_equal_to_formula(setup):
    layer, x, _ = setup
    s = layer.scale
    y = sc.apply(layer, x)
    ref = x @ layer.weight + layer.bias
    bound = _product_bound(x, _err(x, s[INPUT], E4M3), layer.weight, _err(layer.weight, s[WEIGHT], E4M3))
    err = jnp.abs(y - ref)
    assert bool(jnp.all(err <= bound + 1e-6 * jnp.abs(ref)))
    assert float(jnp.max(err)) > 0  # it really quantised
    formula = _qdq(x, s[INPUT], E4M3) @ _qdq(layer.weight, s[WEIGHT], E4M3) + layer.bias
    np.testing.assert_allclose(y, formula, rtol=1e-5, atol=1e-5)


def test_history_rolls_and_scales_follow():
    layer = sc.nn.Fp8Linear.init(jax.random.key(3), 4, 3, use_bias=False, history_len=2, margin=1)
    np.testing.assert_array_equal(layer.amax_history, np.zeros((3, 2)))
    np.testing.assert_array_equal(layer.scale, np.ones(3))
    seen = []
    grad = jax.jit(jax.grad(lambda p, x, ct: jnp.sum(sc.apply(p, x) * ct)))
    for step in range(3):
        x = (step + 1.0) * jax.random.normal(jax.random.key(10 + step), (5, 4))
        ct = (step + 1.0) * 1e-3 * jax.random.normal(jax.random.key(20 + step), (5, 3))
        layer = sc.nn.fp8_update(layer, grad(layer, x, ct))
        seen.append([jnp.max(jnp.abs(x)), jnp.max(jnp.abs(layer.weight)), jnp.max(jnp.abs(ct))])
        newest = np.asarray(seen[-1], np.float32)
        older = np.asarray(seen[-2], np.float32) if step else np.zeros(3, np.float32)
        np.testing.assert_allclose(layer.amax_history[:, 0], newest, rtol=1e-6)
        np.testing.assert_allclose(layer.amax_history[:, 1], older, rtol=1e-6)  # oldest dropped at step 2
        fmax = np.array([448.0, 448.0, 57344.0], np.float32)
        expected = fmax / (np.maximum(newest, older) * 2.0)
        np.testing.assert_allclose(layer.scale, expected, rtol=1e-6)


def test_grads_close_to_fp32_within_bound(setup):
    layer, x, ct = setup
    s, w = layer.scale, layer.weight

    def loss(p, x):
        return jnp.sum(sc.apply(p, x) * ct)

    g_layer, dx = jax.jit(jax.grad(loss, argnums=(0, 1)))(layer, x)
    dx_ref = ct @ w.T
    dw_ref = x.T @ ct
    e_ct, e_w, e_x = _err(ct, s[GRAD], E5M2), _err(w, s[WEIGHT], E4M3), _err(x, s[INPUT], E4M3)
    assert bool(
        jnp.all(jnp.abs(dx - dx_ref) <= _product_bound(ct, e_ct, w.T, e_w.T) + 1e-6 * jnp.abs(dx_ref))
    )
    assert bool(
        jnp.all(
            jnp.abs(g_layer.weight - dw_ref) <= _product_bound(x.T, e_x.T, ct, e_ct) + 1e-6 * jnp.abs(dw_ref)
        )
    )
    # and overall within 15 % (relative Frobenius norm) of the fp32 gradients
    assert float(jnp.linalg.norm(dx - dx_ref) / jnp.linalg.norm(dx_ref)) < 0.15
    assert float(jnp.linalg.norm(g_layer.weight - dw_ref) / jnp.linalg.norm(dw_ref)) < 0.15
    np.testing.assert_allclose(g_layer.bias, ct.sum(0), rtol=1e-5)
    gq = _qdq(ct, s[GRAD], E5M2)
    np.testing.assert_allclose(dx, gq @ _qdq(w, s[WEIGHT], E4M3).T, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(g_layer.weight, _qdq(x, s[INPUT], E4M3).T @ gq, rtol=1e-5, atol=1e-6)
    assert not np.any(np.asarray(g_layer.scale))  # the scale's cotangent is zero, never a gradient


def _train(params, x, y, steps=200):
    """200 Adam steps in one compiled scan; the FP8 scaling state is overwritten, never optimised."""
    mask = sc.nn.fp8_meta_mask(params)
    tx = optax.adam(3e-2)

    def loss_fn(p):
        return jnp.mean((sc.apply(p, x) - y) ** 2)

    def step(carry, _):
        params, opt_state = carry
        loss, g = jax.value_and_grad(loss_fn)(params)
        if any(jax.tree.leaves(mask)):
            params = sc.nn.fp8_update(params, g)
        meta, train = eqx.partition(params, mask)
        updates, opt_state = tx.update(eqx.partition(g, mask)[1], opt_state, train)
        return (eqx.combine(meta, optax.apply_updates(train, updates)), opt_state), loss

    opt_state = tx.init(eqx.partition(params, mask)[1])
    (params, _), losses = jax.jit(lambda c: jax.lax.scan(step, c, None, length=steps))((params, opt_state))
    return loss_fn(params), losses


def test_fp8_training_tracks_fp32():
    """A 32 → 4 regression with noisy targets (noise variance 0.25): both runs must reach the
    noise floor from a loss of about 2, the FP8 one within 5 % of the fp32 one."""
    k = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(k[0], (2048, 32))
    y = x @ (jax.random.normal(k[1], (32, 4)) / jnp.sqrt(32.0)) + 0.5 * jax.random.normal(k[2], (2048, 4))
    fp32 = sc.nn.Linear.init(k[3], 32, 4)
    loss32, curve32 = _train(fp32, x, y)
    loss8, curve8 = _train(sc.nn.Fp8Linear.from_linear(fp32), x, y)
    assert float(loss32) < 0.3 < float(curve32[0])  # it learned, down to about the noise floor
    assert float(curve8[-1]) < 0.3 < float(curve8[0])
    assert abs(float(loss8) - float(loss32)) <= 0.05 * float(loss32)


def test_bad_input():
    layer = sc.nn.Fp8Linear.init(jax.random.key(0), 4, 3)
    with pytest.raises(
        TypeError, match="input x must be floating to be scaled to e4m3, received dtype int32"
    ):
        sc.apply(layer, jnp.ones((2, 4), jnp.int32))
    for n in (0, -1, 2.5):
        with pytest.raises(ValueError, match="history_len must be an int >= 1"):
            sc.nn.Fp8Linear.init(jax.random.key(0), 4, 3, history_len=n)
    with pytest.raises(ValueError, match="count must be an int >= 1"):
        sc.nn.fp8_update(layer, layer, count=0)
    with pytest.raises(ValueError, match="hold no Fp8Linear layers"):
        sc.nn.fp8_update({"l": layer.to_linear()}, {"l": layer.to_linear()})
    with pytest.raises(TypeError, match="expected a spectrax_core.nn.Linear, received LayerNorm"):
        sc.nn.Fp8Linear.from_linear(sc.nn.LayerNorm.init(None, 4))
    with pytest.raises(ValueError, match="Fp8Linear: expected input with features = 4"):
        sc.apply(layer, jnp.ones((2, 5)))
