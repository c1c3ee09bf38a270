"""`spx.assign_stage` and `spx.sxcall`: variables carry their stage, and `spx.run` cuts the model where its forward
moves from one stage's modules to the next."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_core import schedules as S
from spectrax_eager._pipeline import run as _run
from spectrax_eager._pipeline.key import function_key, mesh_key

X = jax.random.normal(jax.random.key(1), (16, 8))
Y = jax.random.normal(jax.random.key(2), (16, 3))


def mse(out, target):
    return jnp.mean((out - target) ** 2)


class TwoTowers(spx.Module):
    """Stage 0: embed and a shared `mid` layer used twice; stage 1: `out` and `head`."""

    def __init__(self, rngs, revisit: bool = False):
        with spx.assign_stage(total=2, current=0):
            self.embed = spx.nn.Linear(8, 16, rngs=rngs)
            self.mid = spx.nn.Linear(16, 16, rngs=rngs)
        with spx.assign_stage(total=2, current=1):
            self.head = spx.nn.Linear(16, 3, rngs=rngs)  # declared before `out`: order does not matter
            self.out = spx.nn.Linear(16, 16, rngs=rngs)
        self.revisit = revisit

    def forward(self, x):
        h = jnp.tanh(self.embed(x))
        h = jnp.tanh(self.mid(h))
        h = jnp.tanh(self.mid(h))  # the same stage-0 module twice
        h = jnp.tanh(self.out(h))
        if self.revisit:
            h = self.mid(h)  # back to stage 0 after stage 1
        return self.head(h)


@functools.lru_cache(maxsize=None)
def mesh2():
    return mp.create_mesh((2, 1, -1, 1, 1, 1), mpmd_axis="pp")


def test_variables_carry_their_stage():
    model = TwoTowers(spx.Rngs(0))
    stages = {path: var.metadata.get("stage") for path, var in spx.iter_variables(model)}
    assert stages == {
        "embed.weight": 0,
        "embed.bias": 0,
        "mid.weight": 0,
        "mid.bias": 0,
        "head.weight": 1,
        "head.bias": 1,
        "out.weight": 1,
        "out.bias": 1,
    }
    assert spx.Parameter(jnp.ones(2)).metadata == {}  # nothing outside a context
    with spx.assign_stage(total=3, current=2):
        with spx.assign_stage(total=3, current=1):
            assert spx.Parameter(jnp.ones(2)).metadata == {"stage": 1, "stages": 3}
        assert spx.Parameter(jnp.ones(2), stage=0).metadata["stage"] == 0  # explicit wins


def test_stamped_model_trains_through_its_own_forward():
    model = TwoTowers(spx.Rngs(0))
    ref_loss, ref_grads = spx.value_and_grad(lambda m: mse(m(X), Y))(model)
    loss, grads = spx.run(
        model, inputs=X, targets=Y, mesh=mesh2(), loss_fn=mse, schedule=S.Std1F1B(microbatches=4)
    )
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    wanted = (mesh_key(mesh2()), function_key(mse))
    runner = next(r for key, (r, _) in _run._runners.items() if (key.mesh, key.loss) == wanted)
    graph = runner.step.last_graph
    assert len(graph.stages) == 2
    # stage 0 reads embed and mid (4 leaves) and x; stage 1 reads out and head (4 leaves) and y
    assert [len(s.arg_inputs) for s in graph.stages] == [5, 5]


def test_returning_to_an_earlier_stage_is_refused():
    model = TwoTowers(spx.Rngs(0), revisit=True)
    with pytest.raises(mp.StageSplitError, match=r"stage order \[0, 0, 0, 1, 0, 1\].*may not return"):
        spx.run(model, inputs=X, targets=Y, mesh=mesh2(), loss_fn=mse, schedule=S.GPipe(microbatches=2))


def test_stamp_total_must_match_the_mesh():
    model = TwoTowers(spx.Rngs(0))
    mesh4 = mp.create_mesh((4, 1, -1, 1, 1, 1), mpmd_axis="pp")
    with pytest.raises(mp.StageSplitError, match=r"assign_stage\(total=2\).*need stages 0\.\.3"):
        spx.run(model, inputs=X, targets=Y, mesh=mesh4, loss_fn=mse)


@pytest.mark.parametrize("current, total", [(2, 2), (-1, 2), (0, 0)])
def test_assign_stage_rejects_bad_numbers(current, total):
    with pytest.raises(ValueError, match=r"0 <= current < total"):
        with spx.assign_stage(total=total, current=current):
            pass


def test_sxcall_over_a_pipeline_sequential():
    rngs = spx.Rngs(3)
    pipe = spx.nn.PipelineSequential(
        spx.nn.Sequential(spx.nn.Linear(8, 16, rngs=rngs)),
        spx.nn.Sequential(spx.nn.Linear(16, 3, rngs=rngs)),
    )
    ref_loss, ref_grads = spx.value_and_grad(lambda m: mse(m(X), Y))(pipe)
    loss, grads = spx.sxcall(pipe, (X, Y), mesh=mesh2(), schedule=S.GPipe(microbatches=4), loss_fn=mse)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(ref_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    out = spx.sxcall(pipe, X, mesh=mesh2(), schedule=S.GPipe(microbatches=4), mode="forward")
    np.testing.assert_allclose(out, pipe(X), rtol=1e-5, atol=1e-6)
    with pytest.raises(mp.MpmdError, match=r"spectrax_eager\.sxcall"):
        mp.sxcall(pipe, (X, Y), mesh=mesh2(), loss_fn=mse)
