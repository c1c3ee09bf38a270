"""Program identity beyond the lowered text.

The StableHLO text of a cell does not show everything its executable depends
on: a typed PRNG key lowers as its raw key data, a weak scalar as a strong one,
and a host callback as an index into the executable's own list of Python
functions. Two cells that differ only there must still get executables of their
own, in every call order, and give what `jax.jit` (or the unsplit function)
gives: values, dtypes, weak types, and the host functions each stage calls.
"""

from __future__ import annotations

import gc

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from mpmd_cases import assert_close, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd._compile.compiler import CellSpec, Compiler

ONE_DEVICE = jax.sharding.SingleDeviceSharding(jax.devices()[0])


def _spec(shape, dtype, weak_type=False):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=ONE_DEVICE, weak_type=weak_type)


def _assert_same_avals(got, want):
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for a, b in zip(map(jax.typeof, jax.tree.leaves(got)), map(jax.typeof, jax.tree.leaves(want))):
        assert (a.shape, a.dtype, a.weak_type) == (b.shape, b.dtype, b.weak_type)


# --- argument and result avals --------------------------------------------------------------


def test_cells_differing_only_in_avals_are_other_programs():
    """Each pair lowers to the same text; each must get its own executable."""
    key_type = jax.random.key(0).dtype
    pairs = {
        "weak scalar": (_spec((), jnp.float32, True), _spec((), jnp.float32)),
        "typed key": (_spec((), key_type), _spec((2,), jnp.uint32)),
    }
    for name, (first, second) in pairs.items():
        compiler = Compiler()
        cells = [CellSpec(lambda a: (a,), (spec,), (ONE_DEVICE,)) for spec in (first, second)]
        keys = [compiler.program_key(cell) for cell in cells]
        assert keys[0] != keys[1], name
        executables = [compiler.compile_spec(cell) for cell in cells]
        assert executables[0] is not executables[1], name
        assert len(compiler.cache) == 2, name


def key_dropout_loss(w, x, key):
    h = jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0) @ w
    return jnp.mean(mp.sxstage_iter(h) ** 2)


@pytest.mark.parametrize("typed_first", [True, False])
@pytest.mark.parametrize("api", ["sxjit", "sxvalue_and_grad"])
def test_typed_and_raw_keys_on_one_function(api, typed_first):
    mesh = pipeline_mesh(2)
    w, x = jnp.linspace(-1, 1, 16).reshape(4, 4), jnp.linspace(0.5, 2, 32).reshape(8, 4)
    typed = jax.random.key(3)
    keys = [typed, jax.random.key_data(typed)]
    if not typed_first:
        keys.reverse()
    if api == "sxjit":
        step, reference = mp.sxjit(key_dropout_loss, mesh=mesh), jax.jit(key_dropout_loss)
    else:
        step = mp.sxvalue_and_grad(
            key_dropout_loss, mesh=mesh, schedule=S.Std1F1B(microbatches=1), batch_argnums=(1,)
        )
        # one microbatch reads the key folded with its index 0
        reference = jax.value_and_grad(lambda w, x, key: key_dropout_loss(w, x, jax.random.fold_in(key, 0)))
    for key in keys:
        assert_close(step(w, x, key), reference(w, x, key))


@pytest.mark.parametrize("strong_first", [True, False])
def test_weak_and_strong_scalars_keep_the_weak_type_jax_jit_gives(strong_first):
    def f(a, b):
        return mp.sxstage_iter(a * 2) + b, a

    g = mp.sxjit(f, mesh=pipeline_mesh(2))
    strong = jnp.float32
    calls = [(strong(1.5), 2.0), (1.5, strong(2.0)), (1.5, 2.0), (strong(1.5), strong(2.0))]
    if not strong_first:
        calls.reverse()
    for args in calls:
        got, want = g(*args), jax.jit(f)(*args)
        _assert_same_avals(got, want)
        assert_close(got, want)
        bf16 = jnp.ones(2, jnp.bfloat16)
        assert (bf16 * got[0]).dtype == (bf16 * want[0]).dtype


def test_a_typed_key_result_stays_typed():
    """A cell returning a key: typed and raw inputs give typed and raw results, in both orders."""

    def f(key):
        return jax.random.split(mp.sxstage_iter(key))

    g = mp.sxjit(f, mesh=pipeline_mesh(2))
    typed = jax.random.key(5)
    for key in (jax.random.key_data(typed), typed, jax.random.key_data(typed)):
        got, want = g(key), jax.jit(f)(key)
        _assert_same_avals(got, want)
        unwrap = jax.random.key_data if jnp.issubdtype(want.dtype, jax.dtypes.prng_key) else np.asarray
        np.testing.assert_array_equal(np.asarray(unwrap(got)), np.asarray(unwrap(want)))


# --- host callbacks ---------------------------------------------------------------------------
# Stages 1 and 2 have the same shapes and call different host functions; the text of a callback
# is only an index into the executable's own list, so the two lower to the same text. DualPipeV
# (2 ranks) puts both on rank 1; Std1F1B (4 ranks) puts them on two ranks.

D, BATCH, MICROBATCHES = 4, 8, 4
SCALES = (2.0, 3.0)


def _scaled_on_host(c: float):
    return lambda a: (np.asarray(a) * c).astype(np.float32)


def pure_callback_block(c: float, record: list):
    return lambda x: jax.pure_callback(_scaled_on_host(c), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def io_callback_block(c: float, record: list):
    from jax.experimental import io_callback

    return lambda x: io_callback(_scaled_on_host(c), jax.ShapeDtypeStruct(x.shape, x.dtype), x)


def host_vjp_block(inner):
    """`inner`'s host op with a custom VJP (scale by c: the gradient is c * g), so it trains."""

    def make(c: float, record: list):
        @jax.custom_vjp
        def op(x):
            return inner(c, record)(x)

        op.defvjp(lambda x: (op(x), None), lambda _, g: (g * c,))
        return op

    return make


def debug_callback_block(c: float, record: list):
    """Records (c, sum of its input) on the host; returns tanh(x), so only the record tells."""

    def block(x):
        jax.debug.callback(lambda a: record.append((c, float(np.sum(a)))), x)
        return jnp.tanh(x)

    return block


FORWARD_FAMILIES = {
    "pure_callback": pure_callback_block,
    "io_callback": io_callback_block,
    "custom_vjp_host_op": host_vjp_block(pure_callback_block),
    "debug_callback": debug_callback_block,
}
TRAINING_FAMILIES = {
    "custom_vjp_pure_callback": host_vjp_block(pure_callback_block),
    "custom_vjp_io_callback": host_vjp_block(io_callback_block),
    "debug_callback": debug_callback_block,
}
SCHEDULES = {"DualPipeV": (2, S.DualPipeV), "Std1F1B": (4, S.Std1F1B)}


def host_chain(family, record: list):
    first, second = (family(c, record) for c in SCALES)

    def loss(p, x):
        h = mp.sxstage_iter(jnp.tanh(x @ p[0]))
        h = mp.sxstage_iter(first(h))
        h = mp.sxstage_iter(second(h))
        return jnp.mean((h @ p[1]) ** 2)

    return loss


def host_case():
    p = [jnp.linspace(-0.5, 0.7, D * D).reshape(D, D), jnp.linspace(0.2, 1.0, D).reshape(D, 1)]
    return p, jnp.linspace(0.1, 1.0, BATCH * D).reshape(BATCH, D)


def _per_scale_mean(record: list, calls_per_record: int = 1) -> dict:
    """Each callback's mean recorded sum, times the calls one whole-batch record stands for."""
    jax.effects_barrier()
    return {c: calls_per_record * np.mean([v for k, v in record if k == c]) for c in {k for k, _ in record}}


def _assert_records_match(got: list, want: list, microbatches: int):
    got, want = _per_scale_mean(got, microbatches), _per_scale_mean(want)
    assert set(got) == set(want) == set(SCALES)
    for c in SCALES:
        np.testing.assert_allclose(got[c], want[c], rtol=1e-5)


@pytest.mark.parametrize("family", sorted(FORWARD_FAMILIES))
def test_sxjit_stages_on_one_rank_call_their_own_host_functions(family):
    p, x = host_case()
    want_record, got_record = [], []
    want = host_chain(FORWARD_FAMILIES[family], want_record)(p, x)
    step = mp.sxjit(
        host_chain(FORWARD_FAMILIES[family], got_record),
        mesh=pipeline_mesh(2),
        schedule=S.DualPipeV(microbatches=MICROBATCHES),
    )
    assert_close(step(p, x), want)
    if family == "debug_callback":
        _assert_records_match(got_record, want_record, 1)


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("family", sorted(TRAINING_FAMILIES))
def test_training_stages_call_their_own_host_functions(family, schedule):
    n, make = SCHEDULES[schedule]
    p, x = host_case()
    want_record, got_record = [], []
    want = jax.value_and_grad(host_chain(TRAINING_FAMILIES[family], want_record))(p, x)
    # a host function on per-row values is opaque to the loss proof (it could mix the rows): the
    # step declares the mean of the microbatch losses, which for this mean over equal microbatches
    # is the unsplit loss
    opaque = family != "debug_callback"
    step = mp.sxvalue_and_grad(
        host_chain(TRAINING_FAMILIES[family], got_record),
        mesh=pipeline_mesh(n),
        schedule=make(microbatches=MICROBATCHES),
        reduce="mean" if opaque else None,
    )
    assert_close(step(p, x), want)
    if family == "debug_callback":
        _assert_records_match(got_record, want_record, MICROBATCHES)


def test_a_host_function_on_per_row_values_is_refused_by_the_loss_proof():
    p, x = host_case()
    loss = host_chain(TRAINING_FAMILIES["custom_vjp_pure_callback"], [])
    step = mp.sxvalue_and_grad(loss, mesh=pipeline_mesh(4), schedule=S.Std1F1B(microbatches=MICROBATCHES))
    with pytest.raises(mp.MpmdError, match="pure_callback.*reduce='mean'"):
        step(p, x)


def test_debug_print_of_each_stage_prints_its_own_text(capsys):
    def loss(x):
        h = mp.sxstage_iter(jnp.tanh(x))
        jax.debug.print("first stage {}", jnp.sum(h))
        h = mp.sxstage_iter(h * 2)
        jax.debug.print("second stage {}", jnp.sum(h))
        return mp.sxstage_iter(h * 2) + 1

    x = jnp.linspace(0.1, 1.0, BATCH * D).reshape(BATCH, D)
    step = mp.sxjit(loss, mesh=pipeline_mesh(2), schedule=S.DualPipeV(microbatches=MICROBATCHES))
    assert_close(step(x), loss(x))
    jax.effects_barrier()
    printed = capsys.readouterr().out
    assert printed.count("first stage") == 2 and printed.count("second stage") == 2


def test_a_collected_host_function_never_lends_its_executable():
    """Cells built, compiled and dropped one after the other: a new host function may get a
    collected one's address, never its executable."""
    compiler, x = Compiler(), jnp.arange(1.0, 4.0)
    for c in (2.0, 3.0, 5.0, 7.0):
        block = pure_callback_block(c, [])
        cell = CellSpec(lambda a, block=block: (block(a),), (_spec((3,), jnp.float32),), (ONE_DEVICE,))
        np.testing.assert_array_equal(np.asarray(compiler.compile_spec(cell)(x)[0]), np.asarray(x) * c)
        del block, cell
        compiler.forget_lowerings()
        gc.collect()
    assert len(compiler.cache) == 4


def test_host_state_read_from_jax_and_its_fallback_give_equal_results(monkeypatch):
    """Without JAX's compile arguments every program gets a token of its own: nothing is shared,
    and the results are those of the path that reads the callbacks."""
    from spectrax_mpmd._compile import compiler as _compile

    readable = _compile._compile_args(jax.jit(lambda a: a).lower(1.0)) is not None
    p, x = host_case()
    want = host_chain(FORWARD_FAMILIES["pure_callback"], [])(p, x)
    for path in ("jax", "fallback"):
        if path == "fallback":
            monkeypatch.setattr(_compile, "_compile_args", lambda lowered: None)
        step = mp.sxjit(
            host_chain(FORWARD_FAMILIES["pure_callback"], []),
            mesh=pipeline_mesh(2),
            schedule=S.DualPipeV(microbatches=MICROBATCHES),
        )
        assert_close(step(p, x), want)
        compiler = Compiler()
        twins = [CellSpec(lambda a: (a * 2,), (_spec((3,), jnp.float32),), (ONE_DEVICE,)) for _ in range(2)]
        shared = compiler.program_key(twins[0]) == compiler.program_key(twins[1])
        assert shared == (path == "jax" and readable), path


# --- typed PRNG keys crossing a stage boundary ----------------------------------------------


def key_edge_loss(w, x, key):
    """Stage 0 drops out with one half of `key` and hands the other half to stage 1."""
    k0, k1 = jax.random.split(key)
    h = jnp.where(jax.random.bernoulli(k0, 0.8, x.shape), x, 0.0) @ w
    h, k1 = mp.sxstage_iter((h, k1))
    h = jnp.where(jax.random.bernoulli(k1, 0.8, h.shape), h, 0.0)
    return jnp.mean(jnp.tanh(h) ** 2)


def key_edge_case():
    w = jnp.linspace(-1, 1, D * D).reshape(D, D)
    return w, jnp.linspace(-2, 2, BATCH * D).reshape(BATCH, D), jax.random.key(11)


def test_sxjit_typed_key_edge():
    w, x, key = key_edge_case()
    assert_close(mp.sxjit(key_edge_loss, mesh=pipeline_mesh(2))(w, x, key), key_edge_loss(w, x, key))


@pytest.mark.parametrize("schedule", ["Std1F1B", "ZeroBubbleH1"])
def test_training_typed_key_edge(schedule):
    """Each microbatch `i` reads the key folded with `i`; the reference folds it the same way."""
    w, x, key = key_edge_case()

    def reference(w):
        parts = x.reshape(MICROBATCHES, -1, D)
        losses = [key_edge_loss(w, parts[i], jax.random.fold_in(key, i)) for i in range(MICROBATCHES)]
        return jnp.mean(jnp.stack(losses))

    step = mp.sxvalue_and_grad(
        key_edge_loss,
        mesh=pipeline_mesh(2),
        schedule=getattr(S, schedule)(microbatches=MICROBATCHES),
        batch_argnums=(1,),
    )
    assert_close(step(w, x, key), jax.value_and_grad(reference)(w))


def test_copy_moves_typed_keys_as_the_public_path_does():
    """Keys (one device, and sharded over a 2 x 2 mesh) and plain arrays in one move: the same
    values, dtypes and shardings as `jax.device_put`; other rejected inputs still raise."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from spectrax_mpmd._comm.local import _Copy, fast_path_available

    if not fast_path_available():
        pytest.skip("this JAX has no C++ batched copy")
    devices = jax.devices()
    mesh = lambda ds: jax.sharding.Mesh(np.array(ds).reshape(2, 2), ("fsdp", "tp"))  # noqa: E731
    src, dst = NamedSharding(mesh(devices[:4]), P("fsdp")), NamedSharding(mesh(devices[4:]), P("fsdp"))
    one_src = jax.sharding.SingleDeviceSharding(devices[0])
    one_dst = jax.sharding.SingleDeviceSharding(devices[1])
    keys = jax.device_put(jax.random.split(jax.random.key(2), 4), src)
    arrays = [jax.device_put(jax.random.key(1), one_src), keys, jax.device_put(jnp.arange(4.0), src)]
    move = _Copy([one_dst, dst, dst])
    got, want = move(*arrays), move.public()(*arrays)
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.sharding == b.sharding
        unwrap = jax.random.key_data if jnp.issubdtype(a.dtype, jax.dtypes.prng_key) else np.asarray
        np.testing.assert_array_equal(np.asarray(unwrap(a)), np.asarray(unwrap(b)))
    with pytest.raises(TypeError):
        _Copy([one_dst])(np.arange(3.0))
