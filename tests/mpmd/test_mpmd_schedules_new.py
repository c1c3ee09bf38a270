"""The zero-bubble family, hand-written and searched tables through the MPMD runtime: exact loss
and gradients against `jax.value_and_grad` of the unsplit function, and the dispatch log.

Heterogeneous 4-rank pipelines at m < n, m = n and m not a multiple of n, with remat on and
off; ZB-V also on 8 ranks (16 stages). Each configuration compiles and runs once per session.
"""

import functools

import jax
import jax.numpy as jnp
import pytest
from mpmd_cases import _block_apply, _block_params, assert_close, hetero_batch, pipeline_mesh

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_mpmd.errors import StageSplitError

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
    "searched": searched,
}


@functools.lru_cache(maxsize=None)
def run(name: str, n: int, m: int, remat: bool):
    schedule = MAKERS[name](n, m)
    stages = schedule.num_stages(n)
    params, batch = deep_params(jax.random.key(stages), stages), hetero_batch(batch=2 * m)
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(deep_loss))(params, batch)
    step = mp.sxvalue_and_grad(deep_loss, mesh=pipeline_mesh(n), schedule=schedule, remat=remat)
    loss, grads = step(params, batch)
    return schedule, loss, grads, ref_loss, ref_grads, step.dispatch_log


CASES = [
    pytest.param(name, 4, m, remat, id=f"{name}-m{m}-{'remat' if remat else 'saved'}")
    for name in MAKERS
    for m in (2, 4, 6)
    for remat in (False, True)
]
WIDE = [pytest.param("ZBV", 8, 8, False, id="ZBV-n8-m8", marks=pytest.mark.slow)]


@pytest.mark.parametrize("name,n,m,remat", CASES + WIDE)
def test_loss_and_gradients_match_the_unsplit_function(name, n, m, remat):
    schedule, loss, grads, ref_loss, ref_grads, log = run(name, n, m, remat)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    per_rank = [tuple(a for r, a, _ in log if r == rank) for rank in range(n)]
    assert per_rank == [tuple(row) for row in schedule.actions(n)]


def test_dualpipe_is_refused_by_the_runtime_with_a_clear_error():
    n, m = 2, 4
    params, batch = deep_params(jax.random.key(0), 2 * n), hetero_batch(batch=2 * m)
    step = mp.sxvalue_and_grad(deep_loss, mesh=pipeline_mesh(n), schedule=S.DualPipe(m))
    with pytest.raises(StageSplitError, match="two copies of each model stage"):
        step(params, batch)
