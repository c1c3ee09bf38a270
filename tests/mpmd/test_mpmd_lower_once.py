"""Each distinct cell program is lowered once, identified from its trace.

A cell whose traced program (jaxpr with its constants' values, avals, shardings,
donations) was lowered before, on any devices, is not lowered again. Cells that
differ only in a constant, a closure's value, a static argument, a weak type or
a sharding are other programs: each gets its own executable, in both orders,
and computes what `jax.jit` of its own function computes.
"""

from __future__ import annotations

import functools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spectrax_mpmd._compile.compiler import CellSpec, Compiler

DEVICES = jax.devices()
ONE = jax.sharding.SingleDeviceSharding(DEVICES[0])
MESH = jax.sharding.Mesh(np.array(DEVICES[:2]), ("x",))


def _spec(shape, sharding=ONE, weak_type=False, dtype=jnp.float32):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding, weak_type=weak_type)


def _closure(values):
    c = jnp.asarray(values, jnp.float32)
    return lambda a: (a * c,)


def _keyed(seed):
    key = jax.random.key(seed)  # a typed key closed over: a constant of an extended dtype
    return lambda a: (a + jax.random.uniform(key, a.shape),)


def _rolled(shift):
    return lambda a: (functools.partial(jnp.roll, shift=shift)(a),)


def _add(c):
    return lambda a: (a + c,)


# name -> (fn, spec, out sharding) for the first and the second cell
PAIRS = {
    "constant": ((_add(2.0), _spec((4,)), ONE), (_add(3.0), _spec((4,)), ONE)),
    "signed zero": ((_add(0.0), _spec((4,)), ONE), (_add(-0.0), _spec((4,)), ONE)),
    "closure": (
        (_closure([1.0, 2.0, 3.0, 4.0]), _spec((4,)), ONE),
        (_closure([1.0, 2.0, 3.0, 5.0]), _spec((4,)), ONE),
    ),
    "closed-over key": ((_keyed(1), _spec((4,)), ONE), (_keyed(2), _spec((4,)), ONE)),
    "static argument": ((_rolled(1), _spec((4,)), ONE), (_rolled(2), _spec((4,)), ONE)),
    "weak type": ((_add(1.0), _spec((), weak_type=True), ONE), (_add(1.0), _spec(()), ONE)),
    "sharding": (
        (_add(1.0), _spec((4,), NamedSharding(MESH, P("x"))), NamedSharding(MESH, P("x"))),
        (_add(1.0), _spec((4,), NamedSharding(MESH, P())), NamedSharding(MESH, P())),
    ),
}


def _inputs(spec):
    """-0, -1, -2, ... of `spec`'s shape, weak type and sharding."""
    if spec.shape == ():
        x = jax.jit(lambda: -0.0)() if spec.weak_type else -jnp.zeros((), spec.dtype)
    else:
        x = -jnp.arange(spec.shape[0], dtype=spec.dtype)
    x = jax.device_put(x, spec.sharding)
    assert x.weak_type == spec.weak_type
    return x


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("name", sorted(PAIRS))
def test_cells_differing_in_one_thing_are_other_programs(name, reverse):
    pairs = PAIRS[name][::-1] if reverse else PAIRS[name]
    compiler = Compiler()
    cells = [CellSpec(fn, (spec,), (out,)) for fn, spec, out in pairs]
    keys = [compiler.program_key(cell) for cell in cells]
    assert keys[0][0] != keys[1][0]
    compiler.prefetch(cells)
    executables = [compiler.compile_spec(cell) for cell in cells]
    assert executables[0] is not executables[1]
    assert compiler.stats.lowered == 2 and len(compiler.known) == 2
    for (fn, spec, _), executable in zip(pairs, executables):
        x = _inputs(spec)
        got, want = executable(x)[0], jax.jit(fn)(x)[0]
        assert got.dtype == want.dtype and got.weak_type == want.weak_type
        np.testing.assert_array_equal(np.signbit(np.asarray(got)), np.signbit(np.asarray(want)))
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_the_same_program_on_other_devices_is_lowered_once():
    """One device each, four ranks: one lowering, one program; every rank computes its own."""
    compiler = Compiler()
    cells = [
        CellSpec(_closure([1.0, 2.0, 3.0, 4.0]), (_spec((4,), d),), (d,))
        for d in map(jax.sharding.SingleDeviceSharding, DEVICES[:4])
    ]
    compiler.prefetch(cells)
    assert compiler.stats.lowered == 1
    assert len({compiler.program_key(cell)[0] for cell in cells}) == 1
    for cell, device in zip(cells, DEVICES):
        out = compiler.compile_spec(cell)(jax.device_put(jnp.ones(4), device))[0]
        assert out.devices() == {device}
        np.testing.assert_array_equal(np.asarray(out), [1.0, 2.0, 3.0, 4.0])


def test_a_rebuilt_cell_of_the_same_program_is_not_lowered_again():
    """A new spec object (a later build) of a program already compiled: no lowering, one executable."""
    compiler = Compiler()
    first = compiler.compile_spec(CellSpec(_add(2.0), (_spec((4,)),), (ONE,)))
    compiler.forget_lowerings()
    again = compiler.compile_spec(CellSpec(_add(2.0), (_spec((4,)),), (ONE,)))
    assert again is first and compiler.stats.lowered == 1


def test_cells_with_side_effects_are_identified_by_their_lowering():
    """A debug callback is an effect: no traced key; twins calling different host functions stay apart."""
    record = []
    compiler = Compiler()

    def cell(tag):
        def fn(a):
            jax.debug.callback(lambda v: record.append(tag), a)
            return (a + 1,)

        return CellSpec(fn, (_spec((4,)),), (ONE,))

    cells = [cell("first"), cell("second")]
    for c in cells:
        compiler.compile_spec(c)(jnp.ones(4))
    jax.effects_barrier()
    assert record == ["first", "second"] and not compiler.known


def _compile_spans(threads, monkeypatch) -> list:
    """(start, end) of each XLA compile of four distinct programs prefetched with `threads` threads."""
    monkeypatch.setenv("SPECTRAX_MPMD_COMPILE_THREADS", str(threads))
    spans = []
    ones = jax.block_until_ready(jnp.ones(4))  # made before listening: its own compile is not a cell's

    def listen(event, start, end, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            spans.append((start, end))

    jax.monitoring.register_event_time_span_listener(listen)
    try:
        compiler = Compiler()
        cells = [CellSpec(_closure([1.0, 2.0, 3.0, float(k)]), (_spec((4,)),), (ONE,)) for k in range(4)]
        compiler.prefetch(cells)
        for k, cell in enumerate(cells):
            np.testing.assert_array_equal(np.asarray(compiler.compile_spec(cell)(ones)[0]), [1, 2, 3, k])
    finally:
        jax.monitoring.unregister_event_time_span_listener(listen)
    assert compiler.stats.compiled == 4
    return spans


def test_compile_threads_bound_how_many_programs_compile_at_once(monkeypatch):
    """With one thread no two compiles overlap; a bad setting is refused naming the variable."""
    spans = sorted(_compile_spans(1, monkeypatch))
    assert len(spans) == 4
    assert all(end <= nxt for (_, end), (nxt, _) in zip(spans, spans[1:]))
    monkeypatch.setenv("SPECTRAX_MPMD_COMPILE_THREADS", "0")
    with pytest.raises(ValueError, match="SPECTRAX_MPMD_COMPILE_THREADS='0': expected a positive"):
        Compiler().prefetch([CellSpec(_add(9.0), (_spec((4,)),), (ONE,))])


def test_an_idle_worker_starts_at_once_and_queued_programs_start_largest_first(monkeypatch):
    """With one compile thread: the first spec starts compiling before the next is traced (no
    worker waits for the tracing); those traced while it compiles then start largest first,
    nested equations counted; each still computes what `jax.jit` of its own function computes."""
    from spectrax_mpmd._compile import compiler as compiler_module

    monkeypatch.setenv("SPECTRAX_MPMD_COMPILE_THREADS", "1")
    inner = jax.jit(lambda a: jnp.sin(jnp.cos(jnp.tanh(a))) * 2.0 + 1.0)

    def small(a):
        return (a + 1.0,)

    def nested(a):  # one equation at the top, five inside it
        return (inner(a),)

    def flat(a):
        return (jnp.exp(a) * 3.0 - 1.0,)

    specs = [CellSpec(fn, (_spec((4,)),), (ONE,)) for fn in (small, flat, nested)]
    compiler = Compiler(relocate=False)
    traced_all = threading.Event()  # the first compile ends only once every spec is traced
    lowered_by_then = []
    tracing, lowering = compiler_module._Traced, Compiler._lowering

    class Traced(tracing):
        def __init__(self, spec):
            lowered_by_then.append(list(compiler._lowered))
            super().__init__(spec)
            if spec is specs[-1]:
                traced_all.set()

    class Gated:
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self):
            assert traced_all.wait(60)
            return self.lowered.compile()

    monkeypatch.setattr(compiler_module, "_Traced", Traced)
    monkeypatch.setattr(Compiler, "_lowering", lambda self, lowered: Gated(lowering(self, lowered)))
    compiler.prefetch(specs)
    assert lowered_by_then == [[], [specs[0]], [specs[0]]]
    assert list(compiler._lowered) == [specs[0], specs[2], specs[1]]
    x = jnp.arange(4.0)
    for spec in specs:
        np.testing.assert_array_equal(compiler.compile_spec(spec)(x)[0], jax.jit(spec.fn)(x)[0])


def test_a_program_other_devices_run_is_loaded_onto_them_in_the_compile_threads(monkeypatch):
    """A program four devices run compiles once and is loaded onto the other three in the
    compiler's worker threads (not one after another on the caller's); each copy computes what
    `jax.jit` of the function computes on its own device."""
    from spectrax_mpmd._compile import compiler as compiler_module

    if not compiler_module.relocation_available():
        pytest.skip("this JAX cannot load a compiled program onto other devices")
    threads = []
    original = compiler_module.relocate

    def recording(source, devices):
        threads.append(threading.current_thread() is threading.main_thread())
        return original(source, devices)

    monkeypatch.setattr(compiler_module, "relocate", recording)

    def fn(a):
        return (jnp.tanh(a) * 2.0,)

    on = [jax.sharding.SingleDeviceSharding(d) for d in DEVICES[:4]]
    specs = [CellSpec(fn, (_spec((4,), sh),), (sh,)) for sh in on]
    compiler = Compiler()
    compiler.prefetch(specs)
    assert (compiler.stats.compiled, compiler.stats.relocated) == (1, 3)
    assert threads == [False, False, False], threads
    x = jnp.arange(4.0)
    for spec, sh in zip(specs, on):
        got = compiler.compile_spec(spec)(jax.device_put(x, sh))[0]
        assert got.sharding == sh
        np.testing.assert_array_equal(got, jax.jit(fn)(x)[0])
