"""Core LoRA: `y = x W + b + (alpha/r)·(x A) B`, training only A and B, merging, bad input."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc

D_IN, D_OUT, RANK, ALPHA = 8, 6, 2, 4.0


@pytest.fixture(scope="module")
def base():
    return sc.nn.Linear.init(jax.random.key(0), D_IN, D_OUT)


@pytest.fixture(scope="module")
def x():
    return jax.random.normal(jax.random.key(1), (5, D_IN))


def test_wrapped_equals_base_at_init(base, x):
    lora = sc.nn.LoRA.init(jax.random.key(2), base, rank=RANK, alpha=ALPHA)
    assert lora.a.shape == (D_IN, RANK) and lora.b.shape == (RANK, D_OUT)
    assert not np.any(np.asarray(lora.b)) and np.any(np.asarray(lora.a))
    np.testing.assert_array_equal(sc.apply(lora, x), sc.apply(base, x))


def test_apply_is_the_lora_formula(base, x):
    lora = sc.nn.LoRA.init(jax.random.key(2), base, rank=RANK, alpha=ALPHA)
    lora = eqx.tree_at(lambda l: l.b, lora, jax.random.normal(jax.random.key(3), (RANK, D_OUT)))
    expected = x @ base.weight + base.bias + (ALPHA / RANK) * (x @ lora.a @ lora.b)
    np.testing.assert_allclose(sc.apply(lora, x), expected, rtol=1e-5, atol=1e-6)
    merged = sc.nn.merge_lora(lora)
    assert type(merged) is sc.nn.Linear
    np.testing.assert_allclose(sc.apply(merged, x), expected, rtol=1e-5, atol=1e-6)


def _model(key):
    k1, k2 = jax.random.split(key)
    return {
        "attn": sc.nn.Attention.init(k1, 8, 2),
        "head": sc.nn.Linear.init(k2, 8, 3),
    }


def _loss(params, x, y):
    params = sc.nn.merge_lora(params)
    h = sc.apply(params["attn"], x)
    return jnp.mean((sc.apply(params["head"], h) - y) ** 2)


def test_partition_trains_only_lora_and_merge_reproduces():
    base = _model(jax.random.key(4))
    where = lambda path, lin: path.startswith("attn.") and path.split(".")[-1] in ("q", "v")  # noqa: E731
    params = sc.nn.inject_lora(base, jax.random.key(5), rank=2, alpha=8.0, where=where)
    assert isinstance(params["attn"].q, sc.nn.LoRA) and isinstance(params["attn"].v, sc.nn.LoRA)
    assert type(params["attn"].k) is sc.nn.Linear and type(params["head"]) is sc.nn.Linear
    x = jax.random.normal(jax.random.key(6), (4, 3, 8))
    y = jax.random.normal(jax.random.key(7), (4, 3, 3))
    ref_at_init = jnp.mean((sc.apply(base["head"], sc.apply(base["attn"], x)) - y) ** 2)
    np.testing.assert_allclose(_loss(params, x, y), ref_at_init, rtol=1e-6)

    train, frozen = eqx.partition(params, sc.nn.lora_mask(params))
    assert len(jax.tree.leaves(train)) == 4  # a and b of q and v

    @jax.jit
    def step(train):
        g = jax.grad(lambda t: _loss(eqx.combine(t, frozen), x, y))(train)
        return jax.tree.map(lambda p, g: p - 0.1 * g, train, g)

    for _ in range(3):
        train = step(train)
    trained = eqx.combine(train, frozen)
    for old, new in zip(
        jax.tree.leaves(frozen), jax.tree.leaves(eqx.partition(trained, sc.nn.lora_mask(trained))[1])
    ):
        np.testing.assert_array_equal(old, new)
    assert np.any(np.asarray(trained["attn"].q.b))
    assert _loss(trained, x, y) < ref_at_init

    merged = sc.nn.merge_lora(trained)
    assert not any(
        isinstance(l, sc.nn.LoRA)
        for l in jax.tree.leaves(merged, is_leaf=lambda l: isinstance(l, sc.nn.LoRA))
    )
    wrapped_out = sc.apply(trained["attn"].q, x)
    np.testing.assert_allclose(sc.apply(merged["attn"].q, x), wrapped_out, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="merge_lora: .*no LoRA layers"):
        sc.nn.merge_lora(merged)


def test_bad_input(base):
    key = jax.random.key(0)
    with pytest.raises(TypeError, match="base must be a spectrax_core.nn.Linear, received LayerNorm"):
        sc.nn.LoRA.init(key, sc.nn.LayerNorm.init(None, 4), rank=1)
    for rank in (0, 7, 2.0):
        with pytest.raises(ValueError, match=r"rank must be an int with 1 <= rank <= min\(d_in, d_out\) = 6"):
            sc.nn.LoRA.init(key, base, rank=rank)
    with pytest.raises(ValueError, match="alpha must be a positive number"):
        sc.nn.LoRA.init(key, base, rank=2, alpha=0.0)
    with pytest.raises(ValueError, match="inject_lora: no Linear in params of type LayerNorm"):
        sc.nn.inject_lora(sc.nn.LayerNorm.init(None, 4), key, rank=1)
    with pytest.raises(ValueError, match="inject_lora: no Linear .* matched"):
        sc.nn.inject_lora({"p": base}, key, rank=1, where=lambda path, lin: path == "nothing")
    with pytest.raises(ValueError, match="LoRA: expected input with features = 8"):
        sc.apply(sc.nn.LoRA.init(key, base, rank=1), jnp.ones((2, 5)))
