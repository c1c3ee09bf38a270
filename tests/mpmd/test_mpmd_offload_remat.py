"""Per-stage recompute and offload: exact against the unsplit function, offloaded values really in host
memory between their cell and their reader, and clear errors for bad values.

The reference is `jax.value_and_grad` of the unsplit heterogeneous pipeline on one device (rtol 1e-5).
"""

import pytest
from mpmd_cases import (
    ALL,
    assert_close,
    config_of,
    hetero_loss,
    hetero_reference,
    make_schedule,
    microbatches_for,
    pipeline_mesh,
)

import spectrax_mpmd as mp
from spectrax_mpmd._runtime.replay import replay
from spectrax_mpmd._runtime.slots import Offloaded, Residual, Stash
from spectrax_mpmd._trace.policy import offloaded

# (schedule, ranks, virtual stages, remat, offload): every form of both arguments, on a flat, a
# split-backward, an interleaved and a V schedule (whose fused F&B cells reload before they run)
CASES = [
    ("Std1F1B", 4, 1, "dots_saveable", False),
    ("Std1F1B", 4, 1, ["nothing_saveable", True, False, "everything_saveable"], True),
    ("Std1F1B", 4, 1, {1: True, 2: "dots_with_no_batch_dims_saveable"}, 0.5),
    ("ZeroBubbleH1", 4, 1, "nothing_saveable", False),
    ("ZeroBubbleH1", 4, 1, [False, "dots_saveable", True, False], True),
    ("ZeroBubbleH1", 4, 1, False, {0: "stash", 1: mp.Offload(residuals=0.3, stash=1.0), 2: "residuals"}),
    ("InterleavedH1", 2, 2, (True, False, "dots_saveable", False), True),
    ("DualPipeV", 2, 2, False, True),
]


def _ids(case) -> str:
    name, _, _, remat, off = case
    return f"{name}-remat={remat}-offload={off}".replace(" ", "")


@pytest.fixture(scope="module", params=CASES, ids=[_ids(c) for c in CASES])
def stepped(request):
    name, n, v, remat, off = request.param
    schedule = make_schedule(name, 2 * n if name == "DualPipeV" else 4, v)
    params, batch, ref_loss, ref_grads = hetero_reference(n * schedule.virtual_stages)
    step = mp.sxvalue_and_grad(
        hetero_loss, mesh=pipeline_mesh(n), schedule=schedule, remat=remat, offload=off
    )
    return step, (params, batch), step(params, batch), (ref_loss, ref_grads), off


def test_loss_and_gradients_equal_the_unsplit_function(stepped):
    _, _, (loss, grads), (ref_loss, ref_grads), _ = stepped
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_offloaded_values_live_in_host_memory_between_their_cell_and_their_reader(stepped):
    """At every action boundary: each offloaded value alive is a `pinned_host` array, and the device
    copy of an offloaded value is gone (it lives only inside the actions of its cell and readers)."""
    step, args, _, _, off = stepped
    plan = step.plan_for(*args)
    names = plan.slot_names
    moved = {k for k in names.values() if isinstance(k, Offloaded)}
    assert bool(moved) == bool(off)
    device_twins = {
        slot
        for slot, k in names.items()
        if isinstance(k, (Residual, Stash))
        and Offloaded("residuals" if isinstance(k, Residual) else "stash", k.stage, k.microbatch, k.k)
        in moved
    }
    ends = {b - 1 for _, _, a, b in plan.action_steps if b > a}
    seen = set()

    def freed(k, buf):
        if k not in ends:
            return
        for slot, key in names.items():
            if buf[slot] is None:
                continue
            if isinstance(key, Offloaded):
                assert buf[slot].sharding.memory_kind == "pinned_host", key
                seen.add(key)
            assert slot not in device_twins, key

    replay(plan, _placed(step, args), freed=freed)
    assert seen == moved  # each offloaded value was seen in host memory at some boundary


def _placed(step, args):
    entry, leaves = step._entry(args)
    return entry.place(step.placer, leaves)


def test_offload_moves_device_bytes_to_host_and_reloads_them(stepped):
    step, args, _, _, off = stepped
    peaks = step.measure_peak_bytes_by_kind(*args)
    assert any(peaks["host"]) == bool(off)


@pytest.mark.parametrize(
    "sizes,share,chosen",
    [
        ((4, 16, 8, 16), 1.0, (0, 1, 2, 3)),
        ((4, 16, 8, 16), 0.0, ()),
        ((4, 16, 8, 16), 0.5, (1, 3)),  # 16 of 44 is not half: the next largest, the later 16, too
        ((4, 16, 8, 16), 0.3, (1,)),  # 16 of 44 is 36%
        ((4, 16, 8, 16), 0.75, (1, 2, 3)),
        ((0, 0), 1.0, ()),
    ],
)
def test_offload_selection_takes_the_largest_values_first(sizes, share, chosen):
    assert offloaded(sizes, share) == chosen


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"remat": [True, False]}, r"remat: a sequence gives one value per model stage, so it needs 4"),
        ({"remat": "dots_saveabel"}, r"remat: 'dots_saveabel' is not a JAX checkpoint policy.*dots_saveable"),
        ({"remat": "save_only_these_names"}, r"not a JAX checkpoint policy that takes no arguments"),
        ({"remat": {7: True}}, r"remat: a mapping's keys must be model stages 0..3"),
        ({"remat": 1}, r"remat: each value must be True, False or the name"),
        ({"offload": 1.5}, r"offload: each value must be True, False, a share of bytes in \[0, 1\]"),
        ({"offload": [True] * 3}, r"offload: a sequence gives one value per model stage, so it needs 4"),
        ({"offload": "activations"}, r"offload: each value must be"),
    ],
)
def test_bad_remat_and_offload_values_fail_when_the_step_is_made(kwargs, match):
    with pytest.raises(mp.MpmdError, match=match):
        mp.sxvalue_and_grad(
            hetero_loss, mesh=pipeline_mesh(4), schedule=make_schedule("Std1F1B", 4), **kwargs
        )


def test_offload_shares_must_be_between_0_and_1():
    with pytest.raises(mp.MpmdError, match=r"Offload: stash must be a share of bytes between 0 and 1"):
        mp.Offload(stash=2)


def test_offloaded_activations_still_count_as_live_activations(stepped):
    """Offload moves where a `(stage, microbatch)` activation lives, not how long: the measured live
    activations per rank are those of the same step without offload."""
    step, args, _, _, off = stepped
    if not off:
        pytest.skip("nothing offloaded")
    kept = mp.sxvalue_and_grad(hetero_loss, mesh=step.mesh, schedule=step.schedule, remat=step.settings.remat)
    assert step.measure_peak_activations(*args) == kept.measure_peak_activations(*args)


@pytest.mark.slow
@pytest.mark.parametrize("name", ALL)
def test_every_schedule_with_offload_and_a_per_stage_policy_matches_the_unsplit_function(name):
    """Every schedule, stage 0 under a checkpoint policy, stage 1 recomputing, everything offloaded."""
    n, v = config_of(name)
    schedule = make_schedule(name, microbatches_for(name, n), v)
    params, batch, ref_loss, ref_grads = hetero_reference(n * schedule.virtual_stages)
    remat = {0: "dots_with_no_batch_dims_saveable", 1: True}
    step = mp.sxvalue_and_grad(
        hetero_loss, mesh=pipeline_mesh(n), schedule=schedule, remat=remat, offload=True
    )
    loss, grads = step(params, batch)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
