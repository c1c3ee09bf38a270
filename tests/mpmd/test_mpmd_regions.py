"""Stage regions: towers with their own stages and schedules, merged into one pipelined step.

Every pipelined result is compared with `jax.value_and_grad` of the same function,
unsplit, on one device (the regions are no-ops there).
"""

from __future__ import annotations

import contextlib
import functools

import jax
import jax.numpy as jnp
import optax
import pytest
from mpmd_cases import assert_close

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.schedules._actions import cell_label

D, VOCAB, CLASSES, BATCH, M = 8, 11, 5, 8, 4
INPUT_WIDTH = {"vision": 6, "audio": 7}


def tower_params(key, towers, text_stages):
    """One weight per stage of every tower, the text tower's embedding and head, a
    projection of each tower's features into the text tower, and a `scale` the text
    tower and (with `shared=True`) every other tower read."""
    keys = iter(jax.random.split(key, 64))
    normal = lambda *shape: jax.random.normal(next(keys), shape) * 0.3  # noqa: E731
    params = {
        "emb": normal(VOCAB, D),
        "text": [normal(D, D) for _ in range(text_stages)],
        "head": normal(D, CLASSES),
        "scale": 1.0 + normal(D),
    }
    for name, _, stages in towers:
        params[name] = [normal(INPUT_WIDTH[name], D)] + [normal(D, D) for _ in range(stages - 1)]
        params["proj_" + name] = normal(D, D)
    return params


def region(name, schedule):
    return mp.sxstage_region(name, schedule=schedule) if name else contextlib.nullcontext()


def towers_logits(towers, text=("text", None, 2), shared=False, loss=False):
    """Towers `(name, schedule, stages)` each reduce their input to features; the text tower
    (`name=None`: the default region) embeds tokens and, in its last stage, adds every
    tower's projected features before the head: logits, or with `loss` the cross-entropy
    against `labels` inside the text tower's last stage."""
    text_name, text_schedule, text_stages = text

    def forward(params, inputs, tokens, labels=None):
        features = {}
        for name, schedule, stages in towers:
            with region(name, schedule):
                h = inputs[name] @ params[name][0]
                h = jnp.tanh(h * params["scale"] if shared else h)
                for k in range(1, stages):
                    h = mp.sxstage_iter(h)
                    h = jnp.tanh(h @ params[name][k])
                features[name] = h
        with region(text_name, text_schedule):
            h = params["emb"][tokens].mean(axis=1) * params["scale"]
            for k in range(text_stages):
                if k:
                    h = mp.sxstage_iter(h)
                if k == text_stages - 1:
                    h = h + sum(f @ params["proj_" + name] for name, f in features.items())
                h = jnp.tanh(h @ params["text"][k])
            logits = h @ params["head"]
            return cross_entropy(logits, labels) if loss else logits

    return forward


def cross_entropy(logits, labels):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), labels[:, None], axis=1))


def towers_loss(towers, text=("text", None, 2), shared=False):
    return towers_logits(towers, text, shared, loss=True)


def batch(towers, key=jax.random.PRNGKey(1)):
    k1, k2, k3 = jax.random.split(key, 3)
    inputs = {
        name: jax.random.normal(jax.random.fold_in(k1, i), (BATCH, INPUT_WIDTH[name]))
        for i, (name, _, _) in enumerate(towers)
    }
    tokens = jax.random.randint(k2, (BATCH, 3), 0, VOCAB)
    labels = jax.random.randint(k3, (BATCH,), 0, CLASSES)
    return inputs, tokens, labels


def mesh(n):
    return mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])


@functools.cache
def run(towers, text, schedule, shared=False, remat=False, region_ranks=None, offload=False):
    """The pipelined step and the reference, each run once per configuration."""
    loss = towers_loss(towers, text, shared)
    params = tower_params(jax.random.PRNGKey(0), towers, text[2])
    args = batch(towers)
    ranks = dict(region_ranks) if region_ranks else None
    n = 1 + max(r for rs in ranks.values() for r in rs) if ranks else None
    n = n or sum(stages // (s or schedule).virtual_stages for _, s, stages in (*towers, text))
    step = mp.sxvalue_and_grad(
        loss, mesh=mesh(n), schedule=schedule, remat=remat, region_ranks=ranks, offload=offload
    )
    got = step(params, *args)
    want = jax.value_and_grad(loss)(params, *args)
    return step, got, want, (params, *args)


VISION = ("vision", S.GPipe(M), 2)
CASES = {
    "gpipe-vision_1f1b-text": ((VISION,), ("text", S.Std1F1B(M), 2), S.Std1F1B(M)),
    "1f1b-vision_zb-text": (
        (("vision", S.Std1F1B(M), 2),),
        ("text", S.ZeroBubbleH1(M), 2),
        S.ZeroBubbleH1(M),
    ),
    "gpipe-vision_interleaved-text": (
        (VISION,),
        ("text", S.InterleavedH1(M, virtual_stages=2), 4),
        S.Std1F1B(M),
    ),
    "audio+vision+default-text": (
        (("audio", S.Std1F1B(M), 1), ("vision", S.GPipe(M), 1)),
        (None, None, 2),
        S.ZeroBubbleH1(M),
    ),
}


@pytest.mark.parametrize("case", CASES)
def test_regions_match_the_unsplit_gradient(case):
    step, (loss, grads), (ref_loss, ref_grads), args = run(*CASES[case])
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_cross_region_edges_and_local_numbering():
    step, *_, args = run(*CASES["gpipe-vision_1f1b-text"])
    plan = step.plan_for(*args)
    assert plan.graph.stage_regions == (("vision", 0), ("vision", 1), ("text", 0), ("text", 1))
    assert {(e.src, e.dst) for e in plan.graph.edges} == {(0, 1), (2, 3), (1, 3)}
    assert plan.stage_ranks == (0, 1, 2, 3)
    # the text tower's first stage does not wait for the vision tower; its second waits for V1
    simulated = S.simulate(plan.schedule, 4)
    start = {cell_label(e.cell, simulated.stage_labels): e.start for row in simulated.events for e in row}
    assert start["T0F0"] == 0 and start["T1F0"] >= start["V1F0"] + 1
    assert "V1F3" in S.render_grid(simulated)
    timeline = step.measure_timeline(*args)
    assert timeline.stage_labels == ("V0", "V1", "T0", "T1")
    measured = [cell_label(e.cell, timeline.stage_labels) for e in timeline.events[3]]
    assert measured[0] == "T1F0" and all(x.startswith("T1") for x in measured)


def test_parameters_shared_across_regions_get_summed_gradients():
    step, (loss, grads), (ref_loss, ref_grads), _ = run((VISION,), (None, None, 2), S.Std1F1B(M), shared=True)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_remat_in_regions():
    step, (loss, grads), (ref_loss, ref_grads), _ = run(*CASES["1f1b-vision_zb-text"], remat=True)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_offload_and_per_stage_remat_in_regions():
    """Per model stage over the regions' stages (vision 0, 1; text 2, 3): a checkpoint policy,
    recompute, and offload of all or half the saved values; offloaded values are in host memory."""
    remat, offload = (False, "dots_saveable", True, False), (True, 0.5, True, False)
    step, (loss, grads), (ref_loss, ref_grads), args = run(
        *CASES["1f1b-vision_zb-text"], remat=remat, offload=offload
    )
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert any(step.measure_peak_bytes_by_kind(*args)["host"])


def test_regions_can_share_ranks():
    ranks = (("audio", (0,)), ("vision", (0,)), ("text", (1, 2)))
    towers = (("audio", S.GPipe(M), 1), ("vision", S.GPipe(M), 1))
    step, (loss, grads), (ref_loss, ref_grads), args = run(
        towers, ("text", S.Std1F1B(M), 2), S.Std1F1B(M), region_ranks=ranks
    )
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    plan = step.plan_for(*args)
    assert plan.stage_ranks == (0, 0, 1, 2)
    assert plan.schedule.stage_labels(3) == ("A0", "V0", "T0", "T1")


def _two_towers(vision_stages):
    """Vision (`vision_stages` stages) and text (two stages) as decorated regions; the loss after
    both, in the default region (one stage)."""

    def vision(w, x):
        for k in range(vision_stages):
            x = mp.sxstage_iter(x) if k else x
            x = jnp.tanh(x @ w["vision"][k])
        return x

    def text(w, tokens, image):
        h = jnp.tanh(w["emb"][tokens].mean(1) + image)
        return jnp.tanh(mp.sxstage_iter(h) @ w["text"][1])

    def loss(w, x, tokens, labels):
        image = mp.sxstage_region("vision", schedule=S.GPipe(M))(vision)(w, x)
        logits = mp.sxstage_region("text", schedule=S.GPipe(M))(text)(w, tokens, image) @ w["head"]
        return cross_entropy(logits, labels)

    params = tower_params(jax.random.PRNGKey(0), (("vision", None, vision_stages),), 2)
    inputs, tokens, labels = batch((VISION,))
    return loss, params, (inputs["vision"], tokens, labels)


@pytest.mark.parametrize("n, stage_ranks", [(4, (0, 1, 2, 3, 0)), (2, (0, 1, 0, 1, 0))])
def test_regions_needing_more_ranks_than_the_mesh_has_wrap_around(n, stage_ranks):
    """Vision and text, two stages each, and the loss outside both: five stages on fewer ranks.
    Each region starts on the rank after the previous one's last, counting on from rank 0 past
    the mesh's last rank; the step is exact as on five ranks."""
    loss, params, args = _two_towers(2)
    step = mp.sxvalue_and_grad(loss, mesh=mesh(n), schedule=S.GPipe(M))
    got_loss, got_grads = step(params, *args)
    ref_loss, ref_grads = jax.value_and_grad(loss)(params, *args)
    assert_close(got_loss, ref_loss)
    assert_close(got_grads, ref_grads)
    assert step.plan_for(params, *args).stage_ranks == stage_ranks


def test_placement_errors_name_the_ranks_needed():
    """A region needing more ranks than the mesh has, and regions leaving ranks idle."""
    for vision_stages, n, match in (
        (3, 2, r"region 'vision' needs 3 pipeline ranks \(one per 1 of its 3 stage.* mesh has 2"),
        (2, 6, r"the regions need 5 pipeline ranks \(vision: 2, text: 2, default: 1\) but the mesh has 6"),
    ):
        loss, params, args = _two_towers(vision_stages)
        step = mp.sxvalue_and_grad(loss, mesh=mesh(n), schedule=S.GPipe(M))
        with pytest.raises(mp.MpmdError, match=match):
            step(params, *args)


def test_regions_are_no_ops_outside_the_pipeline():
    towers = (VISION,)
    loss = towers_loss(towers, ("text", S.Std1F1B(M), 2))
    params = tower_params(jax.random.PRNGKey(0), towers, 2)
    args = batch(towers)
    eager = loss(params, *args)
    assert_close(jax.jit(loss)(params, *args), eager)
    jax.grad(loss)(params, *args)


def test_run_trains_and_forwards_a_model_without_blocks_through_its_regions():
    """`mp.run` cuts a model without `blocks` at its own markers and regions; its `loss_fn` runs
    outside every region, so here the text tower is the default region and the loss joins its
    last stage."""
    towers = (VISION,)
    logits = towers_logits(towers, (None, None, 2))
    params = tower_params(jax.random.PRNGKey(0), towers, 2)
    inputs, tokens, labels = batch(towers)
    loss, grads = mp.run(
        params,
        inputs=(inputs, tokens),
        targets=labels,
        mesh=mesh(4),
        loss_fn=cross_entropy,
        schedule=S.Std1F1B(M),
        apply_fn=logits,
        region_ranks={"vision": (2, 3), "default": (0, 1)},
    )
    ref_loss, ref_grads = jax.value_and_grad(lambda p: cross_entropy(logits(p, inputs, tokens), labels))(
        params
    )
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    out = mp.run(
        params, inputs=(inputs, tokens), mesh=mesh(4), mode="forward", schedule=S.GPipe(M), apply_fn=logits
    )
    assert_close(out, logits(params, inputs, tokens))


def test_sxjit_runs_regions_forward():
    towers = (("vision", None, 2),)
    loss = towers_loss(towers, ("text", None, 2))
    params = tower_params(jax.random.PRNGKey(0), towers, 2)
    args = batch(towers)
    forward = mp.sxjit(loss, mesh=mesh(4))
    assert_close(forward(params, *args), loss(params, *args))


# --- bad input ------------------------------------------------------------------------------


def _fails(fn, n, match, towers=(VISION,), **kw):
    params = tower_params(jax.random.PRNGKey(0), towers, 2)
    step = mp.sxvalue_and_grad(fn, mesh=mesh(n), schedule=S.Std1F1B(M), **kw)
    with pytest.raises(mp.MpmdError, match=match):
        step(params, *batch(towers))
    assert step.compiler.cache == {}


def test_a_region_entered_twice_is_an_error():
    inner = towers_loss((VISION,), ("text", None, 2))

    def twice(params, inputs, tokens, labels):
        with mp.sxstage_region("vision"):
            params["emb"] * 1
        return inner(params, inputs, tokens, labels)

    _fails(twice, 4, r"sxstage_region\('vision'\) is entered twice")


def test_a_cycle_between_regions_is_an_error():
    def cyclic(params, inputs, tokens, labels):
        h = params["emb"][tokens].mean(1) @ params["text"][0]
        h = mp.sxstage_iter(h)
        h = h @ params["text"][1]
        with mp.sxstage_region("vision"):
            v = jnp.tanh(inputs["vision"] @ params["vision"][0] + h)
        return jnp.mean(h + v)

    _fails(cyclic, 3, r"regions \['default', 'vision'\] read each other's values in a cycle")


def test_marker_count_must_match_the_region_ranks():
    towers = (("vision", S.GPipe(M), 3),)
    loss = towers_loss(towers, ("text", None, 2))
    ranks = {"vision": (0, 1), "text": (2, 3)}
    _fails(
        loss,
        4,
        r"region 'vision' has 3 stage\(s\), but GPipe.* on its 2 rank\(s\) runs 2",
        towers,
        region_ranks=ranks,
    )
    _fails(loss, 6, r"the regions need 5 pipeline ranks \(vision: 3, text: 2\) but the mesh has 6", towers)


def test_a_region_schedule_that_does_not_validate_names_the_region():
    towers = (("vision", S.DualPipeV(2), 4),)
    loss = towers_loss(towers, ("text", S.Std1F1B(2), 2))
    ranks = {"vision": (0, 1), "text": (2, 3)}
    _fails(
        loss,
        4,
        r"region 'vision': its schedule is not valid on 2 rank\(s\): DualPipeV",
        towers,
        region_ranks=ranks,
    )


def test_microbatch_counts_must_agree():
    loss = towers_loss((("vision", S.GPipe(2), 2),), ("text", None, 2))
    _fails(loss, 4, r"same number of microbatches .*\{'vision': 2, 'text': 4\}")


def test_region_ranks_must_name_the_regions():
    loss = towers_loss((VISION,), ("text", None, 2))
    _fails(
        loss,
        4,
        r"region_ranks names \['pictures', 'text'\] but the function's regions are \['vision', 'text'\]",
        region_ranks={"pictures": (0, 1), "text": (2, 3)},
    )
    _fails(
        loss, 4, r"rank\(s\) \[3\] hold no region's stage", region_ranks={"vision": (0, 1), "text": (1, 2)}
    )


def test_region_names_and_nesting():
    with pytest.raises(mp.StageSplitError, match="'default' names the code outside every region"):
        mp.sxstage_region("default")
    with pytest.raises(mp.StageSplitError, match="name must be an identifier-like string"):
        mp.sxstage_region("a/b")

    def nested(params, inputs, tokens, labels):
        with mp.sxstage_region("vision"), mp.sxstage_region("patches"):
            return jnp.mean(inputs["vision"] @ params["vision"][0])

    _fails(nested, 1, r"sxstage_region\('patches'\) is opened inside sxstage_region\('vision'\)")


def test_region_ranks_without_regions_is_an_error():
    def plain(params, inputs, tokens, labels):
        h = mp.sxstage_iter(inputs["vision"] @ params["vision"][0])
        return jnp.mean(h @ params["vision"][1])

    _fails(
        plain, 2, "region_ranks places sxstage_regions, but the function opens none", region_ranks={"a": (0,)}
    )


def test_a_region_refuses_a_schedule_that_copies_its_stages():
    towers = (("vision", S.DualPipe(M), 2),)  # two copies of each stage: a region holds its own
    loss, ranks = towers_loss(towers, ("text", None, 2)), {"vision": (0, 1), "text": (2, 3)}
    _fails(loss, 4, "runs copies of the model's stages", towers=towers, region_ranks=ranks)


def test_schedule_may_be_omitted_when_every_stage_sits_in_a_region_with_its_own():
    """Each region's schedule runs it; the batch splits into their (common) microbatches."""
    text = ("text", S.Std1F1B(M), 2)
    _, got, want, _ = run((VISION,), text, None)
    assert_close(got, want)
    apply = mp.sxvalue_and_grad_and_apply(
        towers_loss((VISION,), text), optax.sgd(0.1), mesh=mesh(4), donate=False
    )
    params = tower_params(jax.random.PRNGKey(0), (VISION,), 2)
    loss, new, _ = apply(params, optax.sgd(0.1).init(params), *batch((VISION,)))
    assert_close(loss, want[0])
    assert_close(new, jax.tree.map(lambda p, g: p - 0.1 * g, params, want[1]))


@pytest.mark.parametrize(
    "text, vision, message",
    [
        (("text", None, 2), VISION, r"region\(s\) \['text'\] name none"),
        ((None, None, 2), VISION, r"some stages run outside every region; wrap that code"),
        (("text", S.Std1F1B(2 * M), 2), VISION, r"split the batch into \[4, 8\] microbatches"),
    ],
)
def test_without_schedule_every_stage_needs_a_region_with_a_schedule(text, vision, message):
    loss = towers_loss((vision,), text)
    step = mp.sxvalue_and_grad(loss, mesh=mesh(4))
    params = tower_params(jax.random.PRNGKey(0), (vision,), 2)
    with pytest.raises(mp.MpmdError, match=message):
        step(params, *batch((vision,)))


@pytest.mark.parametrize("schedule", [None, S.Std1F1B(M)], ids=["regions' schedules", "schedule="])
def test_the_function_is_traced_on_the_whole_batch_at_most_once(schedule):
    """Reading the regions' schedules (no `schedule=`) and weighing a mean loss's microbatches
    share one trace on the whole batch: the loss runs once per microbatch shape and once per
    whole-batch shape, whichever says how many microbatches there are."""
    text = ("text", S.Std1F1B(M), 2)
    loss = towers_loss((VISION,), text)
    shapes = []

    def counted(params, inputs, tokens, labels):
        shapes.append(tokens.shape[0])
        return loss(params, inputs, tokens, labels)

    step = mp.sxvalue_and_grad(counted, mesh=mesh(4), schedule=schedule)
    params = tower_params(jax.random.PRNGKey(0), (VISION,), 2)
    got = step(params, *batch((VISION,)))
    assert sorted(shapes) == [BATCH // M, BATCH]
    assert_close(got, jax.value_and_grad(loss)(params, *batch((VISION,))))
