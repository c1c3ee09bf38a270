"""`LengthBuckets`: a long-tailed batch run as microbatches padded only to their length bucket, in
one pipelined step, against one `jax.value_and_grad` of the same function on the padded batch
(a token mean over the real tokens), on Std1F1B, ZeroBubbleH1 and an interleaved schedule."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.schedules import InterleavedH1, Std1F1B, ZeroBubbleH1
from spectrax_mpmd._buckets import simulated_step, split_rows
from spectrax_mpmd._planner.buckets import bucket_memory

V, D, PADDED, M = 11, 8, 16, 4
# 8 rows, sorted: 16 9 | 5 4 | 3 2 | 2 1 -> microbatches of 2 rows at 16, 16, 8, 4, 2 (powers of two)
LENGTHS = np.asarray([16, 3, 2, 5, 1, 9, 2, 4], np.int32)
SCHEDULES = {
    "Std1F1B": Std1F1B(microbatches=M),
    "ZeroBubbleH1": ZeroBubbleH1(microbatches=M),
    "InterleavedH1": InterleavedH1(microbatches=M, virtual_stages=2),
}


def loss(p, tokens, targets, lengths, stages=2):
    """A causal model (a running mean over positions) with a token mean masked by the lengths."""
    L = tokens.shape[1]
    h = jnp.tanh((p["emb"][tokens] + p["pos"][:L]) @ p["w"][0])
    h = jnp.cumsum(h, axis=1) / jnp.arange(1, L + 1)[:, None]
    for k in range(1, stages):
        h = jnp.tanh(mp.sxstage_iter(h) @ p["w"][k])
    logits = h @ p["out"]
    ce = jax.nn.logsumexp(logits, -1) - jnp.take_along_axis(logits, targets[..., None], -1)[..., 0]
    mask = (jnp.arange(L)[None] < lengths[:, None]).astype(jnp.float32)
    return jnp.sum(ce * mask) / jnp.maximum(jnp.sum(mask), 1.0)


@functools.cache
def mesh():
    return mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])


def inputs(lengths=LENGTHS, seed=0):
    k = jax.random.split(jax.random.key(seed), 4)
    p = {
        "emb": jax.random.normal(k[0], (V, D)),
        "pos": jax.random.normal(k[1], (PADDED, D)) * 0.1,
        "w": jax.random.normal(k[2], (4, D, D)) * 0.4,
        "out": jax.random.normal(k[3], (D, V)) * 0.4,
    }
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, V, (len(lengths), PADDED)).astype(np.int32)
    targets = rng.integers(0, V, (len(lengths), PADDED)).astype(np.int32)
    return p, tokens, targets, np.asarray(lengths, np.int32)


@functools.cache
def bucketed_step(name, **buckets):
    """One step per schedule and settings, shared by the tests (each builds its plans once)."""
    return bucketed(SCHEDULES[name], **buckets)


def bucketed(schedule, **buckets):
    stages = schedule.num_model_stages(2)
    return mp.sxvalue_and_grad(
        functools.partial(loss, stages=stages),
        mesh=mesh(),
        schedule=schedule,
        length_buckets=mp.LengthBuckets(lengths=3, **buckets),
    )


def check_exact(step, args, stages):
    value, grads = step(*args)
    ref_value, ref_grads = jax.value_and_grad(functools.partial(loss, stages=stages))(*args)
    np.testing.assert_allclose(value, ref_value, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", sorted(SCHEDULES))
def test_exact_on_each_schedule(name):
    schedule = SCHEDULES[name]
    step = bucketed_step(name)
    args = inputs()
    check_exact(step, args, schedule.num_model_stages(2))
    summary = step.bucket_summary(*args)
    assert sorted(summary.lengths) == [2, 4, 8, 16]
    # a new batch whose microbatches fall in the same buckets reuses the plan
    other = inputs(np.asarray([1, 2, 10, 3, 4, 16, 2, 5]), seed=1)
    check_exact(step, other, schedule.num_model_stages(2))
    assert len(step.cache) == 1


def test_prepare_builds_the_buckets_of_the_given_lengths_from_shapes():
    """`prepare` with the batch as shapes and the real lengths builds the plan the call then runs."""
    step = bucketed(SCHEDULES["Std1F1B"])
    args = inputs()
    shapes = [jax.ShapeDtypeStruct(jnp.shape(a), jnp.result_type(a)) for a in args[1:3]]
    step.prepare(args[0], *shapes, args[3])
    assert len(step.cache) == 1
    check_exact(step, args, 2)
    assert len(step.cache) == 1, "the call ran the prepared plan"
    with pytest.raises(mp.MpmdError, match="must be an array of values"):
        step.prepare(*args[:3], jax.ShapeDtypeStruct(args[3].shape, args[3].dtype))


def test_user_buckets_and_a_new_composition():
    """Buckets of 4 and 16 (the padded length is always one); a batch of other lengths builds
    a plan of its own, reusing the programs of the buckets it shares."""
    step = bucketed(SCHEDULES["Std1F1B"], sizes=(4,))
    check_exact(step, inputs(), 2)
    assert sorted(step.bucket_summary(*inputs()).lengths) == [4, 4, 16, 16]
    short = inputs(np.asarray([1, 2, 3, 4, 4, 3, 2, 1]), seed=2)
    check_exact(step, short, 2)
    summary = step.bucket_summary(*short)
    assert summary.lengths == (4, 4, 4, 4) and summary.compiled == 0


def test_program_count_is_bounded_by_buckets_times_stage_programs():
    schedule = SCHEDULES["ZeroBubbleH1"]
    args = inputs()
    padded = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=schedule)
    padded(*args)
    programs = len({id(st.fn) for st in padded.last_entry.plan.steps if hasattr(st.fn, "cost_analysis")})
    summary = bucketed_step("ZeroBubbleH1").bucket_summary(*args)
    assert programs < summary.programs <= len(summary.buckets) * programs
    assert str(summary).startswith("4 microbatches in 4 buckets")


@pytest.mark.parametrize("order", ["longest_first", "shortest_first"])
def test_order_runs_the_chosen_microbatch_first(order):
    step = bucketed_step("Std1F1B", order=order)
    args = inputs()
    check_exact(step, args, 2)
    lengths = step.bucket_summary(*args).lengths
    assert lengths == ((16, 8, 4, 2) if order == "longest_first" else (2, 4, 8, 16))


def test_auto_order_follows_the_simulation():
    """The simulated step of the two orders differs on a long-tailed batch; `auto` picks the
    shorter (the loss is the same either way: `test_exact_on_each_schedule` runs `auto`)."""
    schedule, lengths = SCHEDULES["ZeroBubbleH1"], (1024, 128, 64, 32)
    first, last = simulated_step(schedule, 2, lengths), simulated_step(schedule, 2, lengths[::-1])
    assert first != last
    rows = split_rows(mp.LengthBuckets(lengths=3), np.asarray(LENGTHS), PADDED, M, "test")
    assert rows.lengths == (16, 8, 4, 2)
    chosen = bucketed_step("ZeroBubbleH1").bucket_summary(*inputs()).lengths
    want = (16, 8, 4, 2)
    if simulated_step(schedule, 2, want) > simulated_step(schedule, 2, want[::-1]):
        want = want[::-1]
    assert chosen == want


@pytest.mark.parametrize(
    "settings, args, match",
    [
        ({"reduce": "mean"}, None, "no common"),
        ({"has_aux": True}, None, "has_aux=False"),
        ({}, (np.asarray([1.0] * 8, np.float32),), "integers"),
        ({}, (np.asarray([17] + [1] * 7, np.int32),), "between 0 and the padded length 16"),
    ],
)
def test_refused_with_the_rule(settings, args, match):
    p, tokens, targets, lengths = inputs()
    with pytest.raises(mp.MpmdError, match=match):
        step = mp.sxvalue_and_grad(
            loss, mesh=mesh(), schedule=SCHEDULES["Std1F1B"], length_buckets=mp.LengthBuckets(3), **settings
        )
        step(p, tokens, targets, *(args or (lengths,)))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"lengths": -1}, "position"),
        ({"lengths": 3, "sizes": (8, 4)}, "ascending"),
        ({"lengths": 3, "axis": 0}, "axis"),
    ],
)
def test_bad_length_buckets(kwargs, match):
    with pytest.raises(mp.MpmdError, match=match):
        mp.LengthBuckets(**kwargs)


@pytest.mark.parametrize("name", ["Std1F1B", "InterleavedH1"])
def test_predicted_peak_bytes_account_for_buckets(name):
    """Each rank's predicted peak (its buffers sized per microbatch by its bucket) is the measured
    one within 5%; sizing every microbatch as the longest would overshoot."""
    step, args = bucketed_step(name), inputs()
    memory = bucket_memory(step, args)
    predicted = S.simulate(step.settings.schedule, 2, memory=memory).peak_bytes
    measured = step.measure_peak_bytes(*args)
    for p, m in zip(predicted, measured):
        assert abs(p - m) <= 0.05 * m, (predicted, measured)
    longest = max(range(M), key=lambda i: sum(memory.per_microbatch[i].residuals))
    padded = dataclasses.replace(memory, per_microbatch=(memory.per_microbatch[longest],) * M)
    overshoot = S.simulate(step.settings.schedule, 2, memory=padded).peak_bytes
    assert max(o / m for o, m in zip(overshoot, measured)) > 1.2, (overshoot, measured)
