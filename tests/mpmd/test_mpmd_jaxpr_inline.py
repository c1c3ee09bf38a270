"""`inline_calls` flattens every kind of call equation: `jit` and `checkpoint` hold their body as
`jaxpr`, `closed_call` (what a vjp under a checkpoint policy makes of a loop) as `call_jaxpr`.
The flat equations, evaluated, give the jaxpr's own outputs bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from spectrax_mpmd._trace.jaxpr import CALL_PRIMITIVES, eval_eqns, inline_calls, read, resolve, sub_jaxprs


def looped(w, x):
    h, _ = jax.lax.scan(lambda c, _: (jnp.tanh(c @ w), None), x, None, length=2)
    return h * jnp.cos(jnp.arange(h.shape[-1], dtype=h.dtype))


def pullback_leaves(policy):
    fn = looped if policy is None else jax.checkpoint(looped, policy=getattr(jax.checkpoint_policies, policy))
    return lambda w, x: jax.tree.leaves(jax.vjp(jax.jit(fn), w, x)[1])


@pytest.mark.parametrize("policy", [None, "dots_saveable", "nothing_saveable"])
def test_inlined_calls_evaluate_to_the_jaxprs_outputs(policy):
    w = jax.random.normal(jax.random.key(0), (4, 4)) / 2
    x = jax.random.normal(jax.random.key(1), (2, 4))
    probe = pullback_leaves(policy)
    closed = jax.make_jaxpr(probe)(w, x)
    names = {eqn.primitive.name for eqn in closed.jaxpr.eqns}
    assert names & CALL_PRIMITIVES, names  # something to inline
    eqns, mapping, inner_consts, _ = inline_calls(
        closed.jaxpr, lambda eqn: eqn.primitive.name in CALL_PRIMITIVES
    )
    assert not {eqn.primitive.name for eqn in eqns} & CALL_PRIMITIVES
    env = dict(zip(closed.jaxpr.constvars, closed.consts)) | inner_consts
    env.update(zip(closed.jaxpr.invars, (w, x)))
    eval_eqns(eqns, env)
    got = [read(env, resolve(v, mapping)) for v in closed.jaxpr.outvars]
    want = jax.jit(probe)(w, x)
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def call_bodies(jaxpr):
    """The parameter name each call equation in `jaxpr` (nested ones too) holds its body under."""
    for eqn in jaxpr.eqns:
        if eqn.primitive.name in CALL_PRIMITIVES:
            yield "jaxpr" if "jaxpr" in eqn.params else "call_jaxpr"
        for sub in sub_jaxprs(eqn):
            yield from call_bodies(sub)


def test_a_checkpoint_policy_over_a_loop_makes_a_closed_call():
    """The case the `call_jaxpr` body is read for: a vjp under `dots_saveable` of a scan."""
    closed = jax.make_jaxpr(pullback_leaves("dots_saveable"))(jnp.ones((4, 4)), jnp.ones((2, 4)))
    assert "call_jaxpr" in set(call_bodies(closed.jaxpr))
