"""Owner-rank init programs compile together with the step's programs, in the same threads.

`mp.init_on_owners` on a step not built yet hands the programs making each rank's leaves to
the step's build, which compiles them with its own (`Compiler.companions`): making the leaves
afterwards compiles nothing. On a step already built (`mp.owner_layout` first) they compile
afterwards. Either way the leaves are `jax.jit(init)`'s values and the step trains from them.
"""

import jax
import numpy as np
import pytest
from test_mpmd_owner_init import MESH, TX, batch, init, lm_init, lm_loss
from test_mpmd_owner_programs import ULPS, ulps

import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_mpmd._compile import compiler as compiler_module


@pytest.fixture
def builds(monkeypatch):
    """Per `Compiler.prefetch` call: (specs asked, programs compiled or loaded by it)."""
    seen = []
    original = compiler_module.Compiler.prefetch

    def counting(self, specs):
        specs = list(specs)
        before = self.stats.compiled + self.stats.relocated
        original(self, specs)
        seen.append((len(specs), self.stats.compiled + self.stats.relocated - before))

    monkeypatch.setattr(compiler_module.Compiler, "prefetch", counting)
    return seen


def runner():
    return mp.runner(mesh=MESH, loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(microbatches=4), tx=TX)


def same_as_jit(made, fn, key):
    whole = jax.jit(fn)(key)
    return max(ulps(a, b) for a, b in zip(jax.tree.leaves(made), jax.tree.leaves(whole))) <= ULPS


def test_a_runner_step_compiles_the_init_programs_in_its_build(builds):
    step, key = runner(), jax.random.key(1)
    params, state = mp.init_on_owners(step, lm_init, key, *batch())
    assert builds[-1][1] == 0, builds  # making the leaves compiled nothing more
    assert builds[-2][0] > 4, builds  # the step's build compiled the 4 ranks' programs with its own
    assert same_as_jit((params, state), lambda k: (lm_init(k), TX.init(lm_init(k))), key)
    loss, *_ = step.update(params, state, *batch())
    assert np.isfinite(float(loss))


def test_a_gradient_step_compiles_them_in_its_build(builds):
    grad = mp.sxvalue_and_grad(lm_loss(4), mesh=MESH, schedule=S.GPipe(microbatches=4))
    key = jax.random.key(0)
    params = mp.init_on_owners(grad, init, key, *batch())
    assert builds[-1][1] == 0, builds
    assert same_as_jit(params, init, key)


def test_on_a_step_built_already_they_compile_afterwards(builds):
    step, key = runner(), jax.random.key(2)
    mp.owner_layout(step, lm_init, key, *batch())
    built = len(builds)
    params, state = mp.init_on_owners(step, lm_init, key, *batch())
    assert len(builds) == built + 1 and builds[-1][1] > 0, builds
    assert same_as_jit((params, state), lambda k: (lm_init(k), TX.init(lm_init(k))), key)
