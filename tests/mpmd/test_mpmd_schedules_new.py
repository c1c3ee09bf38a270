"""The zero-bubble family, DualPipe, hand-written and searched tables through the MPMD runtime:
exact loss and gradients against `jax.value_and_grad` of the unsplit function, and the dispatch log.

Heterogeneous 4-rank pipelines at m < n, m = n and m not a multiple of n, with remat on and
off; ZB-V also on 8 ranks (16 stages); DualPipe (two copies of every stage, needs m >= 2n)
on 4 and 8 ranks at m = 2n and 4n. Each configuration compiles and runs once per session.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from mpmd_cases import _block_apply, _block_params, assert_close, hetero_batch, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S

VOCAB, LENGTH, CLASSES = 11, 3, 5
WIDTHS = (8, 12, 6, 10, 7, 9, 13, 5)


def deep_params(key, n_stages: int) -> dict:
    """Embedding, n_stages − 2 blocks of three structures and cycling widths, a head."""
    keys = jax.random.split(key, n_stages + 1)
    width = [WIDTHS[k % len(WIDTHS)] for k in range(n_stages - 1)]
    return {
        "embed": {"table": jax.random.normal(keys[0], (VOCAB, width[0])) * 0.5},
        "blocks": [_block_params(keys[1 + k], k % 3, width[k], width[k + 1]) for k in range(n_stages - 2)],
        "head": jax.random.normal(keys[-1], (width[-1], CLASSES)) * 0.3,
    }


def deep_loss(params, batch):
    tokens, labels = batch
    h = mp.sxstage_iter(params["embed"]["table"][tokens])
    for k, block in enumerate(params["blocks"]):
        h = mp.sxstage_iter(_block_apply(k % 3, block, h))
    logp = jax.nn.log_softmax(jnp.mean(h, axis=1) @ params["head"])
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def text_table(n: int, m: int) -> S.UserSchedule:
    """A hand-written table: ZB-H1's order, read back from its text."""
    return S.UserSchedule.from_text(S.format_table(S.ZeroBubbleH1(m).actions(n)))


def uneven_table(n: int, m: int) -> S.UserSchedule:
    """A hand-written table whose ranks hold different numbers of stages: n + 2 stages, ranks 0 and
    n − 2 two each (stages 0, 1 and n − 1, n), the others one; every rank runs its forwards in
    microbatch order, then its backwards."""
    owner = [0, 0, *range(1, n - 2), n - 2, n - 2, n - 1]
    rows = []
    for rank in range(n):
        held = [s for s, o in enumerate(owner) if o == rank]
        forwards = [f"{s}F{i}" for i in range(m) for s in held]
        rows.append(" ".join(forwards + [f"{s}B{i}" for i in range(m) for s in reversed(held)]))
    return S.UserSchedule.from_text("\n".join(rows))


def searched(n: int, m: int) -> S.Schedule:
    f = (0.3,) + (1.0,) * (n - 2) + (2.5,)
    return S.search(
        n, m, S.StageCost(f, tuple(2 * x for x in f), f, tuple(0.5 * x for x in f)), memory_budget=n
    )


MAKERS = {
    "ZeroBubbleH2": lambda n, m: S.ZeroBubbleH2(m),
    "ZeroBubbleH2-latency": lambda n, m: S.ZeroBubbleH2(m, latency=1.0),
    "ZBV": lambda n, m: S.ZBV(m),
    "VHalf": lambda n, m: S.VHalf(m),
    "VMin": lambda n, m: S.VMin(m),
    "text": text_table,
    "uneven": uneven_table,
    "searched": searched,
    "DualPipe": lambda n, m: S.DualPipe(m),
}


@functools.lru_cache(maxsize=None)
def run(name: str, n: int, m: int, remat: bool):
    schedule = MAKERS[name](n, m)
    stages = schedule.num_model_stages(n)
    params, batch = deep_params(jax.random.key(stages), stages), hetero_batch(batch=2 * m)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(deep_loss))(params, batch)
    step = mp.sxvalue_and_grad(deep_loss, mesh=pipeline_mesh(n), schedule=schedule, remat=remat)
    loss, grads = step(params, batch)
    return schedule, loss, grads, ref_loss, ref_grads, step.dispatch_log


CASES = [
    pytest.param(name, 4, m, remat, id=f"{name}-m{m}-{'remat' if remat else 'saved'}")
    for name in MAKERS
    if name != "DualPipe"
    for m in (2, 4, 6)
    for remat in (False, True)
]
DUAL = [
    pytest.param(
        "DualPipe", n, m, remat, id=f"DualPipe-n{n}-m{m}-{'remat' if remat else 'saved'}", marks=marks
    )
    for n, m, remat, marks in (
        (4, 8, False, ()),
        (4, 8, True, ()),
        (4, 16, False, ()),
        (4, 16, True, ()),
        (8, 16, False, ()),
        (8, 32, True, pytest.mark.slow),
    )
]
WIDE = [pytest.param("ZBV", 8, 8, False, id="ZBV-n8-m8", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,n,m,remat", CASES + DUAL + WIDE)
def test_loss_and_gradients_match_the_unsplit_function(name, n, m, remat):
    schedule, loss, grads, ref_loss, ref_grads, log = run(name, n, m, remat)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    per_rank = [tuple(a for r, a, _ in log if r == rank) for rank in range(n)]
    assert per_rank == [tuple(row) for row in schedule.actions(n)]


def tied_loss(params, batch):
    """`deep_loss` whose head also reads the embedding table (a leaf of the first and the last
    stage), with each microbatch's loss as aux."""
    tokens, labels = batch
    table = params["embed"]["table"]
    h = mp.sxstage_iter(table[tokens])
    for k, block in enumerate(params["blocks"]):
        h = mp.sxstage_iter(_block_apply(k % 3, block, h))
    pooled = jnp.mean(h, axis=1) @ params["head"]
    logits = pooled + jnp.mean(pooled, axis=-1, keepdims=True) * jnp.sum(table[:CLASSES], axis=-1)
    logp = jax.nn.log_softmax(logits)
    loss = -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))
    return loss, {"loss": loss}


def test_dualpipe_sums_tied_weights_over_both_copies_and_gathers_aux_in_microbatch_order():
    """reduce="sum" with aux: the loss is the sum over the microbatches of both directions, the
    embedding's gradient sums four readers (two copies each of the first and the last stage),
    and aux comes back stacked in microbatch order from the two ranks that compute the loss."""
    n, m = 4, 8
    params, batch = deep_params(jax.random.key(1), n), hetero_batch(batch=2 * m)
    micro = [jax.tree.map(lambda x: x[2 * i : 2 * i + 2], batch) for i in range(m)]
    per = [jax.value_and_grad(tied_loss, has_aux=True)(params, b) for b in micro]
    step = mp.sxvalue_and_grad(
        tied_loss, mesh=pipeline_mesh(n), schedule=S.DualPipe(m), has_aux=True, reduce="sum"
    )
    (loss, aux), grads = step(params, batch)
    assert_close(loss, sum(value for (value, _), _ in per))
    assert_close(aux["loss"], jnp.stack([value for (value, _), _ in per]))
    assert_close(grads, jax.tree.map(lambda *g: sum(g), *(g for _, g in per)))
    plan = step.plan_for(params, batch)
    assert plan.stage_ranks == (0, 1, 2, 3, 3, 2, 1, 0)
    readers = {key.rank for key in plan.slot_names.values() if getattr(key, "kind", None) == "param"}
    assert readers == set(range(n))


def test_dualpipe_measurements_follow_the_schedule():
    """Peak live activations per rank as simulated (a rank holding a loss stage may stay below:
    the fused loss cell keeps nothing), peak bytes on every rank, one timed event per action
    that runs a cell, in the table's order."""
    n, m = 4, 8
    schedule, *_ = run("DualPipe", n, m, False)
    params, batch = deep_params(jax.random.key(n), n), hetero_batch(batch=2 * m)
    step = mp.sxvalue_and_grad(deep_loss, mesh=pipeline_mesh(n), schedule=schedule)
    measured = step.measure_peak_activations(params, batch)
    simulated = schedule.timeline(n).peak_activations
    loss_ranks = {schedule.rank_of(s, n) for s in (n - 1, 2 * n - 1)}
    for r in range(n):
        assert measured[r] <= simulated[r] if r in loss_ranks else measured[r] == simulated[r]
    assert all(b > 0 for b in step.measure_peak_bytes(params, batch))
    timeline = step.measure_timeline(params, batch)
    ran = step.plan_for(params, batch).action_steps  # actions that became steps, in issue order
    rows = [tuple(a for r, a, start, end in ran if r == rank and end > start) for rank in range(n)]
    assert [tuple(e.cell for e in row) for row in timeline.events] == rows
    assert [tuple(a for a in row if a in rows[r]) for r, row in enumerate(schedule.actions(n))] == rows
