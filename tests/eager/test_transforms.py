"""Every transform on a module against the same transform written over a plain params dict."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx

RTOL = 1e-6


class Net(spx.Module):
    """`y = tanh(x @ w + b)`; in training it also updates a running mean of `x` (a Buffer)."""

    def __init__(self, seed=0):
        k = jax.random.key(seed)
        self.w = spx.Parameter(jax.random.normal(k, (3, 2)))
        self.b = spx.Parameter(jnp.full((2,), 0.1))
        self.running = spx.Buffer(jnp.zeros(3))

    def forward(self, x):
        self.running.value = 0.9 * self.running.value + 0.1 * x.mean(0)
        return jnp.tanh(x @ self.w.value + self.b.value)


def f_ref(p, x):
    return jnp.tanh(x @ p["w"] + p["b"]), 0.9 * p["running"] + 0.1 * x.mean(0)


def params(m):
    return {"w": m.w.value, "b": m.b.value, "running": m.running.value}


X = jax.random.normal(jax.random.key(1), (4, 3))


def close(a, b):
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(u, v, rtol=RTOL, atol=1e-7)


def test_jit_matches_and_writes_back_buffer():
    m = Net()
    p = params(m)
    y = spx.jit(lambda m, x: m(x), mutable="buffers")(m, X)
    y_ref, run_ref = jax.jit(f_ref)(p, X)
    close(y, y_ref)
    close(m.running.value, run_ref)
    with pytest.raises(spx.IllegalMutationError, match="buffers/running"):
        spx.jit(lambda m, x: m(x))(m, X)


def test_jit_keywords_static_and_donate():
    m = Net()

    @spx.jit(static_argnums=(2,), mutable="buffers", donate_argnums=(0,))
    def f(m, x, scale):
        return m(x) * scale

    y = f(m, X, 3.0)
    close(y, 3.0 * f_ref(params(Net()), X)[0])
    close(m.running.value, f_ref(params(Net()), X)[1])
    close(f(m, X, 2.0), 2.0 * f_ref(params(Net()), X)[0])


def test_jit_spmd_mesh():
    mesh = jax.make_mesh((8,), ("dp",))
    m = Net()
    y = spx.jit(lambda m, x: m(x), mutable="buffers", mesh=mesh)(m, jnp.tile(X, (2, 1)))
    close(y, f_ref(params(Net()), jnp.tile(X, (2, 1)))[0])


def test_value_and_grad_with_aux_argnums_and_buffer():
    m = Net()
    p = params(m)

    def loss(m, x):
        y = m(x)
        return jnp.sum(y**2), y.mean()

    def loss_ref(pw, x, running):
        y, r = f_ref({**pw, "running": running}, x)
        return jnp.sum(y**2), (y.mean(), r)

    (val, aux), (g_m, g_x) = spx.value_and_grad(loss, argnums=(0, 1), has_aux=True, mutable="buffers")(m, X)
    (v_ref, (a_ref, r_ref)), (gp_ref, gx_ref) = jax.value_and_grad(loss_ref, argnums=(0, 1), has_aux=True)(
        {"w": p["w"], "b": p["b"]}, X, p["running"]
    )
    close((val, aux), (v_ref, a_ref))
    close(g_m["parameters"]["w"], gp_ref["w"])
    close(g_m["parameters"]["b"], gp_ref["b"])
    close(g_x, gx_ref)
    close(m.running.value, r_ref)
    g_only = spx.grad(lambda m, x: jnp.sum(m(x)), mutable="buffers")(Net(), X)
    assert set(g_only["parameters"]) == {"w", "b"}


def test_jvp_and_vjp():
    m = Net()
    p = params(m)
    t = jax.tree.map(jnp.ones_like, spx.tree_state(m).filter("parameters"))
    out, t_out = spx.jvp(lambda m, x: m(x), (m, X), (t, jnp.zeros_like(X)), mutable="buffers")
    ref = jax.jvp(
        lambda w, b: f_ref({"w": w, "b": b, "running": p["running"]}, X)[0],
        (p["w"], p["b"]),
        (jnp.ones_like(p["w"]), jnp.ones_like(p["b"])),
    )
    close((out, t_out), ref)
    out, pull = spx.vjp(lambda m, x: m(x), Net(), X, mutable="buffers")
    g_m, g_x = pull(jnp.ones_like(out))
    out_ref, pull_ref = jax.vjp(
        lambda pw, x: f_ref({**pw, "running": p["running"]}, x)[0], {"w": p["w"], "b": p["b"]}, X
    )
    gp_ref, gx_ref = pull_ref(jnp.ones_like(out_ref))
    close(out, out_ref)
    close((g_m["parameters"]["w"], g_m["parameters"]["b"], g_x), (gp_ref["w"], gp_ref["b"], gx_ref))


def test_vmap_broadcast_and_ensemble():
    m = Net()
    p = params(m)
    xs = jnp.stack([X, 2 * X])
    y = spx.vmap(lambda m, x: jnp.tanh(x @ m.w.value + m.b.value))(m, xs)
    close(y, jax.vmap(lambda x: f_ref(p, x)[0])(xs))
    ens = jax.tree.map(lambda a: jnp.stack([a, 2 * a]), m)  # modules are pytrees
    pe = params(ens)
    y = spx.vmap(lambda m, x: m(x), in_axes=(0, None), mutable="buffers")(ens, X)
    y_ref, r_ref = jax.vmap(f_ref, in_axes=(0, None))(pe, X)
    close(y, y_ref)
    close(ens.running.value, r_ref)


def test_scan_carried_module_and_stacked_xs():
    m = Net()
    p = params(m)

    def body(mod, x):
        return mod, mod(x)

    xs = jnp.stack([X, X + 1, X - 1])
    final, ys = spx.scan(body, m, xs, mutable="buffers")
    assert final is m

    def body_ref(run, x):
        y, r = f_ref({**p, "running": run}, x)
        return r, y

    r_ref, ys_ref = jax.lax.scan(body_ref, p["running"], xs)
    close((ys, m.running.value), (ys_ref, r_ref))
    with pytest.raises(spx.IllegalMutationError):
        spx.scan(body, Net(), xs)

    stacked = jax.tree.map(lambda a: jnp.stack([a, a + 1]), Net())  # two layers' weights

    def layer(h, mod):
        return jnp.tanh(h @ mod.w.value[:, :2].T[:, :3].T[:, :2] @ jnp.ones((2, 3))), None

    h, _ = spx.remat_scan(layer, X, stacked)

    def layer_ref(h, w):
        return jnp.tanh(h @ w[:, :2].T[:, :3].T[:, :2] @ jnp.ones((2, 3))), None

    h_ref, _ = jax.lax.scan(jax.checkpoint(layer_ref), X, stacked.w.value)
    close(h, h_ref)


def test_remat_eval_shape_and_grad_through_remat():
    m = Net()
    p = params(m)
    g = spx.grad(lambda m: jnp.sum(spx.remat(lambda m, x: m(x), mutable="buffers")(m, X)), mutable="buffers")(
        m
    )
    g_ref = jax.grad(
        lambda pw: jnp.sum(jax.checkpoint(lambda q: f_ref({**q, "running": p["running"]}, X)[0])(pw))
    )({"w": p["w"], "b": p["b"]})
    close((g["parameters"]["w"], g["parameters"]["b"]), (g_ref["w"], g_ref["b"]))
    shape = spx.eval_shape(lambda m, x: m(x), Net(), X)
    assert shape.shape == (4, 2) and shape.dtype == jnp.float32


def test_cond_switch_with_writes():
    m = Net()
    p = params(m)
    y = spx.cond(True, lambda m, x: m(x), lambda m, x: jnp.zeros((4, 2)), m, X, mutable="buffers")
    y_ref, r_ref = f_ref(p, X)
    close((y, m.running.value), (y_ref, r_ref))
    m2 = Net()
    y = spx.switch(1, [lambda m, x: m(x), lambda m, x: -x[:, :2]], m2, X, mutable="buffers")
    close((y, m2.running.value), (-X[:, :2], p["running"]))
    with pytest.raises(spx.IllegalMutationError):
        spx.cond(False, lambda m, x: m(x), lambda m, x: m(x), Net(), X)


def test_while_and_fori_loops():
    m = Net()
    p = params(m)
    out = spx.fori_loop(0, 3, lambda i, c: (c[0], c[0](X) + c[1]), (m, jnp.zeros((4, 2))), mutable="buffers")
    run, acc = p["running"], jnp.zeros((4, 2))
    for _ in range(3):
        y, run = f_ref({**p, "running": run}, X)
        acc = acc + y
    close((out[1], m.running.value), (acc, run))
    assert out[0] is m
    m2 = Net()
    n, mod = spx.while_loop(
        lambda c: c[0] < 2, lambda c: (c[0] + 1, (c[1](X), c[1])[1]), (0, m2), mutable="buffers"
    )
    _, r2 = f_ref(p, X)
    _, r2 = f_ref({**p, "running": r2}, X)
    close(m2.running.value, r2)
    with pytest.raises(spx.IllegalMutationError):
        spx.while_loop(lambda c: c[0] < 2, lambda c: (c[0] + 1, (c[1](X), c[1])[1]), (0, Net()))


def test_modules_inside_containers_and_kwargs():
    m = Net()
    p = params(m)
    y = spx.jit(lambda d, x=None: d["net"](x), mutable="buffers")({"net": m}, x=X)
    close((y, m.running.value), f_ref(p, X))


def test_rngs_advance_under_jit_and_dropout():
    rngs = spx.Rngs(0)
    drop = spx.nn.Dropout(0.5, rngs=rngs)
    f = spx.jit(lambda d, x: d(x))
    a, b = f(drop, jnp.ones((64,))), f(drop, jnp.ones((64,)))
    assert not np.array_equal(a, b)  # the "rngs" collection advanced between calls
    assert int(rngs.default.count.value) == 2
    assert set(np.unique(np.asarray(a)).tolist()) <= {0.0, 2.0}
    drop.eval()
    np.testing.assert_array_equal(f(drop, jnp.ones((4,))), jnp.ones((4,)))


class TwoStage(spx.Module):
    def __init__(self, rngs):
        self.a = spx.nn.Linear(4, 4, rngs=rngs)
        self.b = spx.nn.Linear(4, 2, rngs=rngs)

    def forward(self, x):
        return self.b(spx.sxstage_iter(jnp.tanh(self.a(x))))


@pytest.mark.parametrize("schedule", [None, "gpipe"])
def test_jit_mpmd_mesh_forwards_to_sxjit(schedule):
    m = TwoStage(spx.Rngs(0))
    x = jnp.linspace(-1, 1, 32).reshape(8, 4)
    mesh = spx.create_mesh(axis_dims=(2, 1, -1, 1, 1, 1), mpmd_axis="pp")
    sched = spx.GPipe(microbatches=2) if schedule else None
    y = spx.jit(lambda m, x: m(x), mesh=mesh, schedule=sched)(m, x)
    close(y, m(x))
    spmd = spx.create_mesh(axis_dims=(1, 1, -1, 1, 1, 1))
    close(spx.jit(lambda m, x: m(x), mesh=spmd)(m, x), m(x))
    with pytest.raises(ValueError, match="MPMD mesh"):
        spx.jit(lambda m, x: m(x), schedule=spx.GPipe(microbatches=2))


def test_grad_of_eager_block_equals_grad_of_core_block():
    import spectrax_core as sc

    blk = spx.nn.Block(8, 2, 16, rngs=spx.Rngs(0))
    x = jax.random.normal(jax.random.key(2), (2, 3, 8))
    proj = jax.random.normal(jax.random.key(3), (2, 3, 8))
    g = spx.jit(spx.grad(lambda m, x: jnp.sum(m(x) * proj)))(blk, x)
    g_core = jax.jit(jax.grad(lambda p, x: jnp.sum(sc.apply(p, x) * proj)))(blk.core_params(), x)
    close(g["parameters"]["attn.q.weight"], g_core.attn.q.weight)
    close(g["parameters"]["mlp.down.weight"], g_core.mlp.down.weight)
    close(g["parameters"]["norm2.scale"], g_core.norm2.scale)
    assert len(g.flat()) == len(jax.tree.leaves(g_core))


def test_jit_static_argnames_and_shardings():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((8,), ("dp",))
    rep, rows = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    traces = []

    @spx.jit(static_argnames=("power",), in_shardings=(rep, rows), out_shardings=rows, keep_unused=True)
    def f(m, x, power=1):
        traces.append(power)
        return jnp.tanh(x @ m.w.value + m.b.value) ** power

    m, x = Net(), jnp.tile(X, (2, 1))
    y = f(m, x, power=2)
    close(y, f_ref(params(m), x)[0] ** 2)
    assert y.sharding.is_equivalent_to(rows, 2)
    f(m, x, power=2)
    f(m, x, power=3)
    assert traces == [2, 3]
    with pytest.raises(ValueError, match="one Sharding"):
        spx.jit(lambda m, x: m(x), in_shardings=(rep,))(m, x)


def test_jit_of_bound_method_sees_new_values():
    m = Net()
    fwd = spx.jit(m.forward, mutable="buffers")
    y1 = fwd(X)
    m.w.value = 2 * m.w.value
    y2 = fwd(X)
    p = params(Net())
    close(y1, f_ref(p, X)[0])
    close(y2, f_ref({**p, "w": 2 * p["w"]}, X)[0])
