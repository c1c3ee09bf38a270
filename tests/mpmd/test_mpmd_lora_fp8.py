"""LoRA and FP8 through a 4-stage MPMD pipeline (`sxvalue_and_grad` over the core layers).

LoRA: only the LoRA factors are differentiated (a pytree partition), so the
step's gradient tree holds LoRA leaves only and equals `jax.value_and_grad` of
the unsplit function. FP8: the scaling state rides in the params; each rank's
gradient tree carries the next amax history of its own layers (summed over the
microbatches, each of which ran the layer once), and `fp8_update(...,
count=microbatches)` on that rank writes it.
"""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_core as sc
import spectrax_mpmd as mp
from spectrax_core import schedules as S

N, M, D, B = 4, 4, 8, 16
RTOL, ATOL = 1e-5, 1e-6


@pytest.fixture(scope="module")
def mesh():
    return mp.create_mesh((N, 1, -1, 1, 1, 1), mpmd_axis="pp")


def _forward(layers, x):
    h = x
    for k, layer in enumerate(layers):
        h = jnp.tanh(sc.apply(layer, h))
        if k < len(layers) - 1:
            h = mp.sxstage_iter(h)
    return h


def _batch():
    kx, ky = jax.random.split(jax.random.key(9))
    return jax.random.normal(kx, (B, D)), jax.random.normal(ky, (B, D))


def _close(actual, expected):
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=RTOL, atol=ATOL)


def _rank_of(leaf, mesh) -> int:
    devices = set(leaf.devices())
    ranks = [r for r in range(N) if devices <= set(mesh.submesh(r).devices.flat)]
    assert len(ranks) == 1, devices
    return ranks[0]


def test_lora_pipeline_grads_only_lora_and_equal_reference(mesh):
    keys = jax.random.split(jax.random.key(0), 3 * N)
    layers = [
        sc.nn.LoRA.init(keys[3 * k], sc.nn.Linear.init(keys[3 * k + 1], D, D), rank=2, alpha=4.0)
        for k in range(N)
    ]
    # a trained-looking B (B = 0 would make every gradient of A zero)
    layers = [
        eqx.tree_at(lambda l: l.b, l, 0.3 * jax.random.normal(keys[3 * k + 2], (2, D)))
        for k, l in enumerate(layers)
    ]
    train, frozen = eqx.partition(layers, sc.nn.lora_mask(layers))

    def loss(train, frozen, batch):
        x, y = batch
        return jnp.mean((_forward(eqx.combine(train, frozen), x) - y) ** 2)

    batch = _batch()
    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.Std1F1B(microbatches=M), batch_argnums=(2,))
    value, grads = step(train, frozen, batch)
    ref_value, ref_grads = jax.jit(jax.value_and_grad(loss))(train, frozen, batch)

    leaves = jax.tree.leaves(grads)
    assert len(leaves) == 2 * N  # a and b of each stage: no buffers for the frozen base weights
    assert [l.shape for l in leaves] == [s for k in range(N) for s in ((D, 2), (2, D))]
    _close(grads, ref_grads)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL)
    assert [_rank_of(g.a, mesh) for g in grads] == list(range(N))


def test_fp8_pipeline_threads_meta_and_equals_unsplit(mesh):
    keys = jax.random.split(jax.random.key(1), N)
    layers = [sc.nn.Fp8Linear.init(k, D, D, history_len=4) for k in keys]
    x, y = _batch()

    def loss(layers, batch):
        x, y = batch
        return jnp.mean((_forward(layers, x) - y) ** 2)

    def accumulated(layers, batch):
        """The unsplit step with the pipeline's microbatching: the mean of M microbatch losses."""
        parts = [jax.tree.map(lambda t: t[i * (B // M) : (i + 1) * (B // M)], batch) for i in range(M)]
        return sum(loss(layers, p) for p in parts) / M

    # one unsplit step first, so the scales in play are real ones, not the initial 1.0
    layers = sc.nn.fp8_update(layers, jax.grad(loss)(layers, (x, y)))

    step = mp.sxvalue_and_grad(loss, mesh=mesh, schedule=S.GPipe(microbatches=M))
    value, grads = step(layers, (x, y))
    ref_value, ref_grads = jax.jit(jax.value_and_grad(accumulated))(layers, (x, y))
    _close(grads, ref_grads)
    np.testing.assert_allclose(value, ref_value, rtol=RTOL)

    # weight and bias gradients are those of the whole-batch unsplit function
    whole_value, whole = jax.jit(jax.value_and_grad(loss))(layers, (x, y))
    np.testing.assert_allclose(value, whole_value, rtol=RTOL)
    mask = sc.nn.fp8_meta_mask(layers)
    _close(eqx.partition(grads, mask)[1], eqx.partition(whole, mask)[1])

    # each rank updates the history of its own layer
    new = []
    for k, (layer, g) in enumerate(zip(layers, grads)):
        assert _rank_of(g.amax_history, mesh) == k
        local = jax.device_put(layer, g.amax_history.sharding)
        new.append(sc.nn.fp8_update(local, g, count=M))
        assert _rank_of(new[-1].amax_history, mesh) == k
    expected = sc.nn.fp8_update(layers, ref_grads, count=M)
    for got, want in zip(new, expected):
        np.testing.assert_allclose(got.amax_history, want.amax_history, rtol=RTOL)
        np.testing.assert_allclose(got.scale, want.scale, rtol=RTOL)
    # the history rolled once: slot 1 is the previous step's slot 0
    for got, old in zip(new, layers):
        np.testing.assert_allclose(got.amax_history[:, 1], old.amax_history[:, 0], rtol=RTOL)
    # slot 0: the mean over microbatches of the per-microbatch input maxima of stage 0
    per_mb = [float(jnp.max(jnp.abs(x[i * (B // M) : (i + 1) * (B // M)]))) for i in range(M)]
    np.testing.assert_allclose(new[0].amax_history[0, 0], np.mean(per_mb), rtol=RTOL)
