"""`mp.init_on_owners` and `mp.owner_layout` trace `init`: an init that reads a value it computes in
Python is refused with an `MpmdError` naming the entry point, the rule and the fix, chained from
JAX's error; the same choice written with `jnp.where` gives the values of `init(key)`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_mpmd_owner_programs import ULPS, ulps

import spectrax_mpmd as mp
from spectrax_core.schedules import Std1F1B

MESH = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
TX = optax.adam(1e-3)
X, Y = jnp.ones((4, 8)), jnp.ones((4, 4))


def loss_fn(p, x, y):
    h = mp.sxstage_iter(jnp.tanh(x @ p["w0"]))
    return jnp.mean((h @ p["w1"] - y) ** 2)


def init_with(rescale):
    def init(key):
        k0, k1 = jax.random.split(key)
        w0 = rescale(jax.random.normal(k0, (8, 8)))
        return {"w0": w0, "w1": jax.random.normal(k1, (8, 4)) * 0.3}

    return init


PYTHON_CHOICES = {
    "if float(...)": lambda w: w / jnp.linalg.norm(w) if float(jnp.linalg.norm(w)) > 1.0 else w,
    "if on an array": lambda w: w / 2 if jnp.max(w) > 0 else w,
    "int(...)": lambda w: w * int(jnp.argmax(w[0])),
    "np.asarray(...)": lambda w: jnp.asarray(np.asarray(w) * 2),
}


def step():
    return mp.sxvalue_and_grad_and_apply(loss_fn, TX, mesh=MESH, schedule=Std1F1B(microbatches=2))


@pytest.mark.parametrize("choice", PYTHON_CHOICES)
@pytest.mark.parametrize("entry", [mp.init_on_owners, mp.owner_layout])
def test_python_reading_a_traced_value_is_named(entry, choice):
    init = init_with(PYTHON_CHOICES[choice])
    init(jax.random.key(0))  # runs outside a trace
    with pytest.raises(mp.MpmdError, match="must be traceable") as raised:
        entry(step(), init, jax.random.key(0), X, Y, tx=TX)
    message = str(raised.value)
    assert message.startswith(f"{entry.__name__}: init must be traceable")
    assert "jnp.where" in message and "jax.lax.cond" in message
    assert isinstance(raised.value.__cause__, jax.errors.JAXTypeError)


def test_the_choice_written_with_jnp_where_gives_the_values_of_init():
    norm = lambda w: jnp.linalg.norm(w)  # noqa: E731
    init = init_with(lambda w: jnp.where(norm(w) > 1.0, w / norm(w), w))
    params, state = mp.init_on_owners(step(), init, jax.random.key(0), X, Y, tx=TX)
    want = jax.jit(init)(jax.random.key(0))
    made, wanted = jax.tree.leaves((params, state)), jax.tree.leaves((want, TX.init(want)))
    assert max(ulps(a, b) for a, b in zip(made, wanted)) <= ULPS
