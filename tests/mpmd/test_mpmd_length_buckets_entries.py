"""`length_buckets=` on every training entry point: the one-plan step (`sxvalue_and_grad_and_apply`,
its update in the same plan), `mp.Runner`, `mp.runner` (with `.update`), `mp.run` and `mp.sxgrad`,
each against `jax.value_and_grad` of the same loss on the padded batch (then one optax step); and
the entry points that cannot cut a batch by length refuse it."""

import functools

import jax
import numpy as np
import optax
import pytest
from test_mpmd_length_buckets import LENGTHS, M, PADDED, inputs, loss, mesh

import spectrax_mpmd as mp
from spectrax_core.schedules import InterleavedH1, Std1F1B, ZeroBubbleH1
from spectrax_mpmd._buckets import split_rows

TX = optax.adam(1e-2)
BUCKETS = mp.LengthBuckets(lengths="lengths")
RUN_BUCKETS = mp.LengthBuckets(("targets", "lengths"))  # an entry of a run's targets
# a batch in another composition of buckets: 4 4 | 3 3 | 2 2 | 1 1 -> 4, 4, 2, 1
OTHER = np.asarray([4, 1, 2, 3, 4, 3, 2, 1], np.int32)


def close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-6)


def forward(p, _extra, tokens):
    """A run's forward handing the parameters and tokens to `run_loss`, which runs all of `loss`
    (its stage markers too): the run's step is `loss` itself."""
    return p, tokens


def run_loss(outputs, targets):
    """`loss` as a run's `loss_fn(outputs, targets)`: targets are `{"labels", "lengths"}`."""
    (p, tokens), labels = outputs, targets
    return loss(p, tokens, labels["labels"], labels["lengths"])


def reference_update(args, fn=loss):
    """One adam step on the padded batch's `jax.value_and_grad`, unsplit."""
    p = args[0]
    value, grads = jax.value_and_grad(fn)(*args)
    updates, state = TX.update(grads, TX.init(p), p)
    return value, optax.apply_updates(p, updates), state


SCHEDULES = {
    "Std1F1B": Std1F1B(microbatches=M),
    "ZeroBubbleH1": ZeroBubbleH1(microbatches=M),
    "InterleavedH1": InterleavedH1(microbatches=M, virtual_stages=2),
}


@functools.cache
def one_plan(schedule_name):
    schedule = SCHEDULES[schedule_name]
    fn = functools.partial(loss, stages=schedule.num_model_stages(2))
    return fn, mp.sxvalue_and_grad_and_apply(fn, TX, mesh=mesh(), schedule=schedule, length_buckets=BUCKETS)


@pytest.mark.parametrize("schedule_name", sorted(SCHEDULES))
def test_one_plan_step_updates_as_the_padded_batch(schedule_name):
    fn, step = one_plan(schedule_name)
    for lengths, seed in ((LENGTHS, 0), (OTHER, 1)):
        args = inputs(lengths, seed)
        value, params, state = step(jax.tree.map(np.copy, args[0]), TX.init(args[0]), *args[1:])
        close((value, params, state), reference_update(args, fn))
        assert sorted(step.last_entry.lengths) == sorted(split_rows(BUCKETS, lengths, PADDED, M, "").lengths)
    assert len(step.cache) == 2  # one plan per composition of buckets, its update inside


def test_runner_and_run_take_a_path_to_the_lengths():
    """`("targets", "lengths")`: the lengths are an entry of the targets; `Runner`, `runner`,
    `runner(...).update` and `run` all give the padded batch's loss and gradients."""
    p, tokens, labels, lengths = inputs()
    targets = {"labels": labels, "lengths": lengths}
    settings = {"mesh": mesh(), "loss_fn": run_loss, "microbatches": M, "length_buckets": RUN_BUCKETS}
    want = jax.value_and_grad(loss)(p, tokens, labels, lengths)
    close(mp.Runner(forward, **settings)(p, None, tokens, targets), want)
    step = mp.runner(apply_fn=lambda model, x: forward(model, None, x), tx=TX, **settings)
    close(step(p, tokens, targets), want)
    close(
        step.update(jax.tree.map(np.copy, p), TX.init(p), tokens, targets),
        reference_update((p, tokens, labels, lengths)),
    )
    assert sorted(step.runner.update_step.last_entry.lengths) == [2, 4, 8, 16]
    got = mp.run(
        p, inputs=tokens, targets=targets, apply_fn=lambda model, x: forward(model, None, x), **settings
    )
    close(got, want)
    assert sorted(step.runner.step.bucket_summary(p, None, tokens, targets).lengths) == [2, 4, 8, 16]


@pytest.mark.parametrize(
    "call, match",
    [
        (
            lambda s: mp.Runner(
                forward, mesh=mp.create_mesh((1, 2, 1, 1, 1, 1), devices=jax.devices()[:2]), **s
            ),
            "pipeline axis",
        ),
        (lambda s: mp.runner(stage_sizes="auto", mesh=mesh(), **s), "stage_sizes='auto'"),
        (lambda s: mp.run(None, inputs=None, mesh=mesh(), mode="forward", **s), "training step"),
        (lambda s: mp.Runner(forward, mesh=mesh(), **s | {"microbatches": 1}), "needs microbatches"),
    ],
)
def test_entry_points_refuse_what_they_cannot_bucket(call, match):
    settings = {"loss_fn": run_loss, "microbatches": M, "length_buckets": RUN_BUCKETS}
    with pytest.raises(mp.MpmdError, match=match):
        call(settings)


def test_lengths_named_by_a_missing_parameter_is_refused():
    step = mp.sxvalue_and_grad(
        loss, mesh=mesh(), schedule=Std1F1B(microbatches=M), length_buckets=mp.LengthBuckets("lens")
    )
    with pytest.raises(mp.MpmdError, match="names the argument 'lens'"):
        step(*inputs())


def test_sxgrad_takes_it_by_sxvalue_and_grad_s_signature():
    args = inputs()
    step = mp.sxgrad(loss, mesh=mesh(), schedule=Std1F1B(microbatches=M), length_buckets=BUCKETS)
    close(step(*args), jax.grad(loss)(*args))
    assert sorted(step.last_entry.lengths) == [2, 4, 8, 16]


def test_an_sxjit_function_calling_a_bucketed_step_is_refused():
    """`sxjit` cannot cut its batch by length: silently running the padded batch would ignore it."""
    grads = mp.sxvalue_and_grad(loss, mesh=mesh(), schedule=Std1F1B(microbatches=M), length_buckets=BUCKETS)
    step = mp.sxjit(lambda p, *batch: grads(p, *batch)[0], mesh=mesh())
    with pytest.raises(mp.MpmdError, match="sxvalue_and_grad_and_apply"):
        step(*inputs())
