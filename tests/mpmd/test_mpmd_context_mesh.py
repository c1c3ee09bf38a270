"""Every entry point inside a caller's context mesh: `with mesh:` (the whole MPMD mesh),
`jax.set_mesh(mesh.jax_mesh)` and the legacy `with mesh.jax_mesh:`. Each is built and first
called inside `with mesh:`, called again inside the other two, and compared with the unsplit
result computed outside any context."""

import contextlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_mpmd as mp
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import TransformerLM, generate
from spectrax_core.schedules import GPipe, Std1F1B, ZeroBubbleH1

MESH = mp.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp")  # 2 ranks of 4 devices
CONTEXTS = {
    "with mesh": lambda: MESH,
    "jax.set_mesh": lambda: jax.set_mesh(MESH.jax_mesh),
    "legacy with jax_mesh": lambda: MESH.jax_mesh,
}


def _close(got, want):
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6), got, want
    )


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["a"])
    h = mp.sxstage_iter(h)
    return jnp.mean((h @ p["b"] - y) ** 2)


def _params():
    k = jax.random.split(jax.random.key(0), 4)
    p = {"a": jax.random.normal(k[0], (8, 8)) * 0.3, "b": jax.random.normal(k[1], (8, 4)) * 0.3}
    return p, jax.random.normal(k[2], (16, 8)), jax.random.normal(k[3], (16, 4))


def _in_every_context(call):
    """`call()` inside each context (the first builds it); the results."""
    return {name: _run_in(ctx, call) for name, ctx in CONTEXTS.items()}


def _run_in(ctx, call):
    with ctx():
        return call()


def test_gradient_steps():
    p, x, y = _params()
    want = jax.value_and_grad(loss_fn)(p, x, y)
    with MESH:
        vg = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=ZeroBubbleH1(microbatches=4))
        g = mp.sxgrad(loss_fn, mesh=MESH, schedule=Std1F1B(microbatches=4))
    for got in _in_every_context(lambda: (vg(p, x, y), g(p, x, y))).values():
        _close(got, (want, want[1]))


def test_one_plan_step_and_hand_written_step():
    p, x, y = _params()
    tx = optax.chain(optax.clip_by_global_norm(0.5), optax.adam(1e-2))
    loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
    updates, _ = tx.update(grads, tx.init(p), p)
    want = (loss, optax.apply_updates(p, updates))
    with MESH:
        one_plan = mp.sxvalue_and_grad_and_apply(
            loss_fn, tx, mesh=MESH, schedule=Std1F1B(microbatches=4), donate=False
        )
        grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=Std1F1B(microbatches=4))

        @mp.sxjit(mesh=MESH)
        def by_hand(p, s, x, y):
            loss, g = grads_of(p, x, y)
            u, s = tx.update(g, s, p)
            return loss, optax.apply_updates(p, u), s

    for got in _in_every_context(
        lambda: (one_plan(p, tx.init(p), x, y), by_hand(p, tx.init(p), x, y))
    ).values():
        for value, params, _ in got:
            _close((value, params), want)


def test_forward_and_treduce():
    p, x, y = _params()
    xs = (x.reshape(4, 4, 8), y.reshape(4, 4, 4))
    with MESH:
        forward = mp.sxjit(loss_fn, mesh=MESH)

        @mp.sxjit(mesh=MESH)
        def reduced(p, xs):
            return jax.value_and_grad(
                lambda p: mp.treduce(
                    lambda mb: loss_fn(p, *mb), xs, Std1F1B(microbatches=4), operation=mp.Mean
                )
            )(p)

    for value, (loss, grads) in _in_every_context(lambda: (forward(p, x, y), reduced(p, xs))).values():
        _close(value, loss_fn(p, x, y))
        _close((loss, grads), jax.value_and_grad(loss_fn)(p, x, y))


@pytest.fixture(scope="module")
def lm():
    return TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=2, n_heads=2, d_ff=32)


def test_runner_optimizer_gather_generate_and_checkpoint(lm, tmp_path):
    data = jax.random.randint(jax.random.key(2), (4, 6), 0, 16)
    tx = optax.sgd(0.5)
    ref = mp.runner(
        mesh=mp.create_mesh((1, 1, 1, 1, 1, 1), devices=jax.devices()[:1]),
        loss_fn=softmax_cross_entropy,
        microbatches=2,
        tx=tx,
    )
    want_loss, want_params, _ = ref.update(jax.tree.map(jnp.copy, lm), tx.init(lm), data[:, :-1], data[:, 1:])
    want_tokens = generate(want_params, data[:, :3], 3)
    with MESH:
        step = mp.runner(mesh=MESH, loss_fn=softmax_cross_entropy, schedule=GPipe(microbatches=2), tx=tx)
    for name, ctx in CONTEXTS.items():
        with ctx():
            params = mp.stage_blocks(jax.tree.map(jnp.copy, lm), 2)
            loss, params, state = step.update(params, tx.init(params), data[:, :-1], data[:, 1:])
            _close(loss, want_loss)
            tokens = step.generate(params, data[:, :3], 3)
            np.testing.assert_array_equal(np.asarray(tokens), np.asarray(want_tokens))
            unsplit = mp.unstage_blocks(mp.gather(params))
            _close(unsplit, want_params)
            directory = tmp_path / name.replace(" ", "_")
            mp.save_checkpoint(directory, 1, params=params)
            restored = mp.restore_checkpoint(directory, like=want_params)
            _close(restored.params, want_params)


def test_staged_optimizer():
    p, x, y = _params()
    with MESH:
        grads = mp.sxgrad(loss_fn, mesh=MESH, schedule=Std1F1B(microbatches=4))(p, x, y)
        opt = mp.StagedOptimizer(optax.adam(1e-2), max_grad_norm=0.1)
        state = opt.init(p, grads)
    want_grads = jax.grad(loss_fn)(p, x, y)
    tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adam(1e-2))
    want = optax.apply_updates(p, tx.update(want_grads, tx.init(p), p)[0])
    for got in _in_every_context(lambda: opt.update(grads, state, p)[0]).values():
        _close(got, want)


def test_init_on_owners_and_owner_layout():
    _, x, y = _params()
    tx = optax.adam(1e-2)

    def init(key):
        k0, k1 = jax.random.split(key)
        return {"a": jax.random.normal(k0, (8, 8)), "b": jax.random.normal(k1, (8, 4))}

    def make():
        step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=MESH, schedule=Std1F1B(microbatches=4))
        layout = mp.owner_layout(step, init, jax.random.key(1), x, y, tx=tx)
        return layout, mp.init_on_owners(step, init, jax.random.key(1), x, y, tx=tx)

    want_layout, want = make()
    for layout, made in _in_every_context(make).values():
        assert jax.tree.leaves(layout) == jax.tree.leaves(want_layout)
        assert [a.sharding for a in jax.tree.leaves(made)] == [a.sharding for a in jax.tree.leaves(want)]
        jax.tree.map(np.testing.assert_array_equal, made, want)


def test_decode_split(lm):
    split_lm = lambda: mp.decode_split(lm, mesh=MESH, group_size=2, max_len=8, repeats=1)  # noqa: E731
    for split in _in_every_context(split_lm).values():
        assert len(split.sizes) == 2 and sum(split.sizes) == 2


def test_the_context_is_restored():
    """The runtime's own mesh setting never leaks out of a call."""
    p, x, y = _params()
    with contextlib.ExitStack() as stack:
        stack.enter_context(MESH)
        mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=Std1F1B(microbatches=4))(p, x, y)
        assert jax.sharding.get_abstract_mesh().shape_tuple == MESH.jax_mesh.abstract_mesh.shape_tuple
    assert jax.sharding.get_abstract_mesh().empty
