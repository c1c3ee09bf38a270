"""Generation through a run's entry points (`runner(...).generate`, `run` and `spx.run` with
`mode="generate"`) and the early exit of groups whose sequences have all stopped.

Every result is compared with the unsplit reference `spectrax_core.models.generate` on one
device, over the gathered, unsplit parameters where they come from a pipelined training step.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpmd_cases import pipeline_mesh

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import Sampler, TransformerLM, generate

BATCH, STEPS = 4, 4
SEEDED = dict(
    sampler=Sampler(0.8, top_k=4, top_p=0.9), keys=jax.random.split(jax.random.key(7), BATCH), stop_tokens=[3]
)


@functools.cache
def lm():
    return TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=4, n_heads=2, d_ff=32)


def prompt(length: int = 5):
    return jax.random.randint(jax.random.key(1), (BATCH, length), 0, 16)


def unsplit(params):
    return mp.unstage_blocks(mp.gather(params))


def _count_compiles():
    compiles = []

    def count(event, duration, **_):
        compiles.append(event) if event == "/jax/core/compile/backend_compile_duration" else None

    return compiles, count


@pytest.mark.parametrize("n, sizes", [(2, None), (2, (3, 1))])
def test_runner_generates_from_the_training_steps_params_without_copies_or_recompiles(n, sizes):
    mesh, schedule, tx = pipeline_mesh(n), S.GPipe(microbatches=2), optax.sgd(0.5)
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule, tx=tx, stage_sizes=sizes)
    data = jax.random.randint(jax.random.key(2), (BATCH, 6), 0, 16)
    params = mp.stage_blocks(jax.tree.map(jnp.copy, lm()), n, sizes)  # the step consumes what it is given
    state = tx.init(params)
    _, params, state = step.update(params, state, data[:, :-1], data[:, 1:])
    for kw in ({}, SEEDED):
        got = step.generate(params, prompt(), STEPS, groups=2, **kw)
        np.testing.assert_array_equal(got, generate(unsplit(params), prompt(), STEPS, **kw))
    owned = {id(x) for x in jax.tree.leaves(params)}
    for view in step.generate.decoder.views:  # every leaf is the training step's own array
        assert all(id(x) in owned for x in jax.tree.leaves(view))

    _, params, state = step.update(params, state, data[:, :-1], data[:, 1:])
    want = [generate(unsplit(params), prompt(), STEPS, **kw) for kw in ({}, SEEDED)]
    compiles, count = _count_compiles()
    jax.monitoring.register_event_duration_secs_listener(count)
    try:
        got = [step.generate(params, prompt(), STEPS, groups=2, **kw) for kw in ({}, SEEDED)]
    finally:
        jax.monitoring.unregister_event_duration_listener(count)
    assert compiles == []
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)


def test_run_and_spx_run_generate_on_pipeline_and_spmd_meshes():
    want = generate(lm(), prompt(), STEPS, **SEEDED)
    spmd = mp.create_mesh((1, 2, 1, 1, 1, 1), devices=jax.devices()[:2])
    for mesh in (pipeline_mesh(2), spmd):
        got = mp.run(lm(), inputs=prompt(), mesh=mesh, mode="generate", max_new_tokens=STEPS, **SEEDED)
        np.testing.assert_array_equal(got, want)
    got = spx.run(
        lm(),
        inputs=prompt(),
        mesh=pipeline_mesh(4),
        mode="generate",
        max_new_tokens=STEPS,
        groups=4,
        **SEEDED,
    )
    np.testing.assert_array_equal(got, want)


def test_generation_options_are_checked_early():
    mesh = pipeline_mesh(2)
    with pytest.raises(mp.MpmdError, match=r"unknown generation option\(s\) \['temperature'\]"):
        mp.run(lm(), inputs=prompt(), mesh=mesh, mode="generate", max_new_tokens=2, temperature=1.0)
    with pytest.raises(mp.MpmdError, match=r"\['groups'\] are generation options; pass mode='generate'"):
        mp.run(lm(), inputs=prompt(), mesh=mesh, mode="forward", groups=2)
    with pytest.raises(mp.MpmdError, match=r"needs max_new_tokens="):
        mp.run(lm(), inputs=prompt(), mesh=mesh, mode="generate")
    with pytest.raises(mp.MpmdError, match=r"runs a core LM"):
        spx.run(
            spx.nn.Linear(2, 2, rngs=spx.Rngs(0)),
            inputs=prompt(),
            mesh=mesh,
            mode="generate",
            max_new_tokens=2,
        )


def _rounds_issued(tokens, stops, budgets, groups: int) -> list[int]:
    """Rounds each group is issued under the early exit, from the reference tokens: up to its budget,
    and no further than two rounds after the round at which all its sequences had stopped."""
    tokens, size, out = np.asarray(tokens), tokens.shape[0] // groups, []
    for i in range(groups):
        finished = []
        for b in range(i * size, (i + 1) * size):
            hits = [t for t in range(budgets[b]) if tokens[b, t] in stops]
            finished.append(min(hits[0] if hits else budgets[b] - 1, budgets[b] - 1))
        out.append(min(max(budgets[i * size : (i + 1) * size]), max(finished) + 2))
    return out


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("case", ["budgets", "one group stops", "every group stops"])
def test_stopped_groups_are_no_longer_issued_and_tokens_are_unchanged(n, case):
    steps, groups = 6, 2
    mesh = mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])
    decoder = mp.PipelineDecoder(lm(), mesh=mesh)
    free = np.asarray(generate(lm(), prompt(), steps))
    budgets, stops = [steps] * BATCH, []
    if case == "budgets":
        budgets = [1, 2, steps, 3]
    elif case == "one group stops":
        stops = sorted({int(free[0, 0]), int(free[1, 0])})
    else:
        stops = sorted(set(free[:, 0].tolist()))
    want = generate(lm(), prompt(), budgets, stop_tokens=stops, pad_id=15)
    record = []
    got = decoder.generate(prompt(), budgets, groups=groups, stop_tokens=stops, pad_id=15, record=record)
    np.testing.assert_array_equal(got, want)
    rounds = _rounds_issued(want, stops, budgets, groups)
    assert len(record) == n * sum(rounds) < n * groups * steps  # fewer cells than every round of every group
    for i in range(groups):
        assert sorted({t for _, _, g, t, *_ in record if g == i}) == list(range(rounds[i]))
    fast = decoder.generate(prompt(), budgets, groups=groups, stop_tokens=stops, pad_id=15)
    np.testing.assert_array_equal(fast, want)  # the same without waiting for each cell
