"""A long run that builds many plans keeps JAX's jit caches bounded and frees dropped plans' programs.

JAX keeps one process-wide table of jitted functions for its fast C++ dispatch path (8192
entries per kind in JAX 0.10); past that it evicts, and every jitted function, the user's
training step included, may fall back to the slow path. A plan's cells are compiled programs
called directly (never entries of that table), so building plan after plan, for new steps or
new signatures of one step, adds none; the programs of a step that is dropped are freed with it.
"""

from __future__ import annotations

import gc
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_mpmd as mp
from spectrax_core import schedules as S

MESH = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
PLANS = 12
TABLES = ("_cpp_pjit_cache_fun_only", "_cpp_pjit_cache_explicit_attributes")  # JAX 0.10's names


def jit_table_entries() -> int:
    """Entries of JAX's fast-dispatch tables of jitted functions (skips where JAX has others)."""
    pjit = importlib.import_module("jax._src.pjit")
    tables = [getattr(pjit, name, None) for name in TABLES]
    if any(t is None or not hasattr(t, "size") for t in tables):
        pytest.skip("this JAX keeps its jit dispatch tables under other names")
    return sum(t.size() for t in tables)


def live_programs() -> int:
    return len(jax.devices()[0].client.live_executables())


def loss(params, x):
    x = jnp.tanh(x @ params[0])
    x = mp.sxstage_iter(x)
    return jnp.mean(jnp.tanh(x @ params[1]))


PARAMS = [np.full((8, 8), 0.1, np.float32)] * 2
TX = optax.sgd(0.1)


def batch(rows: int) -> np.ndarray:
    return np.ones((rows, 8), np.float32)


def build_and_run(make, signatures: int) -> object:
    step = make()
    for k in range(signatures):
        jax.block_until_ready(step(PARAMS, batch(2 + 2 * k)))
    return step


def grad_step():
    return mp.sxvalue_and_grad(loss, mesh=MESH, schedule=S.GPipe(microbatches=2))


def test_plans_of_new_steps_add_no_jitted_functions_and_free_their_programs():
    build_and_run(grad_step, 1)  # JAX's own first-use jits (eager ops of the setup) are made here
    gc.collect()
    entries, programs = jit_table_entries(), live_programs()
    for _ in range(PLANS):
        build_and_run(grad_step, 1)
    gc.collect()
    assert jit_table_entries() == entries
    assert live_programs() <= programs


def test_many_signatures_of_one_step_add_no_jitted_functions():
    build_and_run(grad_step, 1)
    entries = jit_table_entries()
    step = build_and_run(grad_step, PLANS)
    assert len(step.cache) == PLANS
    assert jit_table_entries() == entries


def test_whole_training_steps_add_no_jitted_functions_per_plan():
    def run_apply(rows: int):
        step = mp.sxvalue_and_grad_and_apply(loss, TX, mesh=MESH, schedule=S.GPipe(microbatches=2))
        jax.block_until_ready(step(PARAMS, TX.init(PARAMS), batch(rows)))

    run_apply(2)
    entries = jit_table_entries()
    for k in range(PLANS // 2):
        run_apply(4 + 2 * k)
    assert jit_table_entries() == entries
