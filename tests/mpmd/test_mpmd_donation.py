"""Donation: what a donating step returns is alive, and a consumed array is refused by name.

A donated input that the step also returns as it came (a frozen leaf, an optimizer
state leaf no update touches, an input returned twice) comes back alive with its
values, as under `jax.jit(donate_argnums=...)`, step after step. A deleted array
passed to any entry point is refused with an `MpmdError` naming the argument
before anything is built or placed.
"""

import jax
import jax.numpy as jnp
import optax
import pytest
from mpmd_cases import assert_close

import spectrax_mpmd as mp
from spectrax_core.schedules import GPipe, Std1F1B

D, STEPS = 8, 3
MESH = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
SCHEDULE = Std1F1B(microbatches=4)
FROZEN = {"w0": True, "w1": True, "frozen": False, "w2": True}


def init():
    k = jax.random.split(jax.random.key(0), 6)
    params = {
        "w0": jax.random.normal(k[0], (6, D)) * 0.4,
        "w1": jax.random.normal(k[1], (D, D)) * 0.4,
        "frozen": jax.random.normal(k[2], (D, D)) * 0.3,  # the shape of w1, and read next to it
        "w2": jax.random.normal(k[3], (D, 3)) * 0.4,
    }
    return params, jax.random.normal(k[4], (8, 6)), jax.random.normal(k[5], (8, 3))


def loss_fn(p, x, y):
    h = jnp.tanh(x @ p["w0"])
    h = jnp.tanh(h @ p["w1"] + h @ p["frozen"])
    h = mp.sxstage_iter(h)
    return jnp.mean((h @ p["w2"] - y) ** 2)


def masked_update(loss, grads, s, p):
    """SGD with momentum on every leaf, then the frozen leaf kept as it came (a Python mask): its
    own update reads it, next to same-shaped outputs its buffer could be donated to."""
    m = {k: 0.9 * s["m"][k] + grads[k] for k in p}
    updated = {k: p[k] - s["lr"] * m[k] for k in p}
    new = {k: updated[k] if FROZEN[k] else p[k] for k in p}
    new["w1"] = new["w1"] - 0.01 * (p["w1"] - s["anchor"])  # reads the anchor, keeps it
    return loss, new, {"m": m, "anchor": s["anchor"], "lr": s["lr"]}


def state_of(params):
    """Momentum per leaf, an anchor shaped like w1 and a learning rate, both never updated."""
    return {"m": jax.tree.map(jnp.zeros_like, params), "anchor": params["w1"] * 0.5, "lr": jnp.float32(0.1)}


def run(step, params, state, x, y, steps=STEPS):
    """`steps` steps in a row, each fed the parameters and state the last returned; every result
    is checked alive. Returns each step's other results (its loss, ...) and the last parameters
    and state (the earlier ones were donated to the next step)."""
    others = []
    for _ in range(steps):
        out = step(params, state, x, y)
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves(out)), "a returned array is deleted"
        params, state = out[1], out[2]
        others.append((out[0], *out[3:]))
    return others, params, state


def fresh(tree):
    return jax.tree.map(jnp.copy, tree)


def test_a_frozen_leaf_and_untouched_state_come_back_alive_from_a_hand_written_step():
    params, x, y = init()
    grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)

    def step(p, s, x, y):
        return masked_update(*grads_of(p, x, y), s, p)

    def reference(p, s, x, y):
        return masked_update(*jax.value_and_grad(loss_fn)(p, x, y), s, p)

    got = run(mp.sxjit(step, mesh=MESH, donate_argnums=(0, 1)), fresh(params), fresh(state_of(params)), x, y)
    want = run(jax.jit(reference, donate_argnums=(0, 1)), fresh(params), fresh(state_of(params)), x, y)
    assert_close(got, want)
    assert_close(got[1]["frozen"], params["frozen"])


def test_an_input_returned_twice_comes_back_alive_twice():
    params, x, y = init()
    grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)

    def step(p, s, x, y):
        loss, new, s = masked_update(*grads_of(p, x, y), s, p)
        return loss, new, s, p["frozen"], s["anchor"]

    steps, new, state = run(
        mp.sxjit(step, mesh=MESH, donate_argnums=(0, 1)), fresh(params), fresh(state_of(params)), x, y
    )
    for _, frozen, anchor in steps:  # every step's, alive after the later steps
        assert_close((frozen, anchor), (params["frozen"], params["w1"] * 0.5))
    assert_close((new["frozen"], state["anchor"]), (params["frozen"], params["w1"] * 0.5))


def sgd_keeping_frozen(loss, grads, s, p):
    """SGD on the other leaves; the frozen leaf is returned without the update reading it."""
    return loss, {k: p[k] if k == "frozen" else p[k] - 0.1 * grads[k] for k in p}, s


@pytest.mark.parametrize("update", [masked_update, sgd_keeping_frozen], ids=lambda f: f.__name__)
def test_a_returned_leaf_passed_as_the_same_array_as_a_consumed_one_comes_back_alive(update):
    """`frozen` is passed as the very array of `w1`, which the step updates (consumes); jax.jit
    refuses such a call, the step copies the returned one first and runs as on two arrays."""
    params, x, y = init()
    grads_of = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)
    step = mp.sxjit(lambda p, s, x, y: update(*grads_of(p, x, y), s, p), mesh=MESH, donate_argnums=(0, 1))
    apart = {**params, "frozen": params["w1"]}
    want = run(step, fresh(apart), fresh(state_of(params)), x, y)
    shared = fresh(params)
    shared["frozen"] = shared["w1"]
    got = run(step, shared, fresh(state_of(params)), x, y)
    assert_close(got, want)
    assert_close(got[1]["frozen"], params["w1"])


def toward_anchor(strength: float) -> optax.GradientTransformation:
    """Pulls each parameter toward its initial value, which the state holds and never updates."""

    def update(updates, anchor, params):
        return jax.tree.map(lambda u, p, a: u + strength * (p - a), updates, params, anchor), anchor

    return optax.GradientTransformation(lambda params: jax.tree.map(jnp.copy, params), update)


def test_the_one_plan_step_and_a_runner_return_untouched_state_alive():
    """The anchors (shaped like the parameters, read by their updates) and `inject_hyperparams`'
    learning rate come back unchanged in the state."""
    params, x, y = init()
    tx = optax.chain(toward_anchor(0.1), optax.inject_hyperparams(optax.adam)(learning_rate=1e-2))

    def reference(p, s, x, y):
        loss, grads = jax.value_and_grad(loss_fn)(p, x, y)
        updates, s = tx.update(grads, s, p)
        return loss, optax.apply_updates(p, updates), s

    want = run(jax.jit(reference, donate_argnums=(0, 1)), fresh(params), tx.init(params), x, y)
    step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=MESH, schedule=SCHEDULE)
    assert_close(run(step, fresh(params), tx.init(params), x, y), want)
    runner = mp.Runner(
        lambda p, _extra, x: p,  # the loss reads the parameters itself
        mesh=MESH,
        loss_fn=lambda p, batch: loss_fn(p, *batch),
        schedule=GPipe(microbatches=4),
        tx=tx,
    )
    got = run(lambda p, s, x, y: runner.update(p, s, None, x, (x, y)), fresh(params), tx.init(params), x, y)
    assert_close(got, want)


def test_a_forward_returns_its_donated_inputs_alive():
    params, x, _ = init()

    def forward(p, x):
        h = mp.sxstage_iter(jnp.tanh(x @ p["w0"]) @ p["w1"])
        return h @ p["w2"], p, p["w2"]  # w2 is read by the last stage only, and returned twice

    step = mp.sxjit(forward, mesh=MESH, donate_argnums=0)
    p = fresh(params)
    for _ in range(STEPS):
        out, p, w2 = step(p, x)
        assert not any(leaf.is_deleted() for leaf in jax.tree.leaves((out, p, w2)))
    assert_close((p, w2), (params, params["w2"]))
    assert_close(out, jax.jit(forward)(params, x)[0])


# --- a consumed array is refused, naming it ---------------------------------------------------


def consumed(params):
    """`params` with its `w1` deleted, as a donating step leaves the arrays it was given."""
    p = fresh(params)
    p["w1"].delete()
    return p


def entry_points(params, x, y):
    """Every entry point, called with a deleted `params['w1']` (argument 0)."""
    tx = optax.sgd(0.1)
    grads = mp.sxvalue_and_grad(loss_fn, mesh=MESH, schedule=SCHEDULE)
    runner = mp.Runner(
        lambda p, _extra, x: p, mesh=MESH, loss_fn=lambda p, b: loss_fn(p, *b), schedule=GPipe(microbatches=4)
    )
    forward = mp.sxjit(lambda p, x: mp.sxstage_iter(x @ p["w0"]) @ p["w1"], mesh=MESH)
    return {
        "sxjit": lambda p: forward(p, x),
        "sxvalue_and_grad": lambda p: grads(p, x, y),
        "sxgrad": lambda p: mp.sxgrad(loss_fn, mesh=MESH, schedule=SCHEDULE)(p, x, y),
        "sxvalue_and_grad_and_apply": lambda p: mp.sxvalue_and_grad_and_apply(
            loss_fn, tx, mesh=MESH, schedule=SCHEDULE
        )(p, tx.init(params), x, y),
        "runner": lambda p: runner(p, None, x, (x, y)),
        "profile": lambda p: grads.profile(p, x, y),
        "measure_peak_bytes": lambda p: grads.measure_peak_bytes(p, x, y),
    }


@pytest.mark.parametrize("name", list(entry_points(*init())))
def test_a_deleted_array_is_refused_by_name_before_any_work(name):
    params, x, y = init()
    call = entry_points(params, x, y)[name]
    with pytest.raises(mp.MpmdError) as err:
        call(consumed(params))
    message = str(err.value)
    assert "argument 0" in message and "['w1']" in message and "float32[8,8]" in message
    assert "is a deleted array" in message and "donate" in message
    assert "sxvalue_and_grad_and_apply" in message and "donate=False" in message


def test_a_deleted_key_and_a_deleted_batch_leaf_are_named_too():
    params, x, y = init()
    grads = mp.sxvalue_and_grad(lambda p, x, y, key: loss_fn(p, x, y), mesh=MESH, schedule=SCHEDULE)
    key = jax.random.key(1)
    key.delete()
    with pytest.raises(mp.MpmdError, match=r"argument 3 \('key'\) \(key<fry>\[\]\) is a deleted array"):
        grads(params, x, y, key)
    gone = jnp.copy(y)
    gone.delete()
    with pytest.raises(mp.MpmdError, match=r"argument 2 \('y'\) \(float32\[8,3\]\) is a deleted array"):
        grads(params, x, gone, jax.random.key(1))


def test_a_step_that_donated_its_inputs_refuses_them_next_time():
    params, x, y = init()
    tx = optax.adam(1e-2)
    step = mp.sxvalue_and_grad_and_apply(loss_fn, tx, mesh=MESH, schedule=SCHEDULE)
    p, s = fresh(params), tx.init(params)
    step(p, s, x, y)
    with pytest.raises(mp.MpmdError, match=r"argument 0\['frozen'\] \(float32\[8,8\]\) is a deleted array"):
        step(p, s, x, y)
