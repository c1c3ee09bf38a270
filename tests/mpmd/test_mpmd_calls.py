"""A plan calls its compiled programs through JAX's C++ dispatch (`spectrax_mpmd._compile.calls`):
found on this JAX, the same results as calling the `Compiled` object (donation included), and the
`Compiled` object itself where JAX makes no C++ call. A whole step through either path:
`tests/test_private_jax.py`."""

import jax
import jax.numpy as jnp
import numpy as np

from spectrax_mpmd._compile import calls


def _compiled():
    def fn(a, tree):
        return {"sum": a + tree["x"], "pair": (a * 2, jnp.tanh(tree["y"]))}

    args = (jnp.arange(6.0), {"x": jnp.ones(6), "y": jnp.linspace(-1, 1, 4)})
    return jax.jit(fn, donate_argnums=0).lower(*args).compile(), args


def _fresh(args):
    return jax.tree.map(lambda x: jnp.array(np.asarray(x)), args)


def test_direct_call_is_the_cpp_call_with_the_same_results():
    compiled, args = _compiled()
    direct = calls.direct_call(compiled)
    assert direct is not compiled  # this JAX has the C++ call: the plan uses it
    first, second = _fresh(args), _fresh(args)
    via_object, via_direct = compiled(*first), direct(*second)
    assert jax.tree.structure(via_object) == jax.tree.structure(via_direct)
    for a, b in zip(jax.tree.leaves(via_object), jax.tree.leaves(via_direct)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert first[0].is_deleted() and second[0].is_deleted()  # both donate the first argument


def test_no_cpp_call_falls_back_to_the_compiled_object(monkeypatch):
    compiled, args = _compiled()
    monkeypatch.setattr(type(compiled._executable), "create_cpp_call", lambda self, params: None)
    assert calls.direct_call(compiled) is compiled

    def plain(x):
        return x

    assert calls.direct_call(plain) is plain  # a transfer or any other step is called as it is
