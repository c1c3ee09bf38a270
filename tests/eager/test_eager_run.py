"""`spx.run`: eager modules trained or run on MPMD and SPMD meshes through their own forward.

References are independent single-device computations: `spx.value_and_grad`
of the same loss on the whole batch (under `jax.jit`), a plain `model(x)`
call, and `spx.Optimizer` updates with those reference gradients. Each
`spx.run` configuration compiles once (`functools.cache`) and is shared
by the tests that inspect it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import spectrax_eager as spx
import spectrax_mpmd as mp
from spectrax_core.losses import softmax_cross_entropy
from spectrax_eager._pipeline import run as eager_run

VOCAB, D, LEN, BATCH, N_BLOCKS = 16, 16, 4, 8, 5
RTOL, ATOL = 1e-5, 1e-6

CALLS: list[int] = []  # block indices, appended whenever a Block runs (i.e. while tracing)


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    """Same tree structure, every leaf equal to fp32 rounding."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


@functools.cache
def mesh_of(kind: str):
    """`ppN`: N pipeline ranks (the rest of the 8 devices on fsdp); `spmd`: no pipeline axis."""
    if kind == "spmd":
        return spx.create_mesh((1, 2, -1, 1, 1, 1))
    return spx.create_mesh((int(kind[2:]), 1, -1, 1, 1, 1), mpmd_axis="pp")


def rank_devices(mesh, k: int) -> set:
    return set(mesh.submesh(k).devices.flat)


# --- the model -----------------------------------------------------------------------------------


class Block(spx.Module):
    """A residual tanh layer that records its index each time it runs."""

    def __init__(self, index: int, rngs):
        self.index = index
        self.lin = spx.nn.Linear(D, D, rngs=rngs)

    def forward(self, h):
        CALLS.append(self.index)
        return h + jnp.tanh(self.lin(h))


class Net(spx.Module):
    """`head` declared before `embed`; forward: embed -> blocks (in `order`) -> head (-> * scale)."""

    def __init__(self, rngs, order=tuple(range(N_BLOCKS))):
        self.head = spx.nn.Linear(D, VOCAB, rngs=rngs)
        self.embed = spx.nn.Embed(VOCAB, D, rngs=rngs)
        self.blocks = spx.nn.ModuleList([Block(k, rngs) for k in range(N_BLOCKS)])
        self.order = tuple(order)

    def forward(self, tokens, scale=None):
        h = self.embed(tokens)
        for k in self.order:
            h = self.blocks[k](h)
        out = self.head(h)
        return out if scale is None else out * scale[:, None, None]


def lm_loss(out, targets):
    return softmax_cross_entropy(out, targets)


@functools.cache
def model_and_batch():
    model = Net(spx.Rngs(0))
    k1, k2 = jax.random.split(jax.random.key(1))
    tokens = jax.random.randint(k1, (BATCH, LEN), 0, VOCAB)
    targets = jax.random.randint(k2, (BATCH, LEN), 0, VOCAB)
    return model, tokens, targets


@jax.jit
def reference_value_and_grad(model, inputs, targets):
    """`spx.value_and_grad` of the whole-batch loss on one device."""

    def loss(m):
        out = m(**inputs) if isinstance(inputs, dict) else m(inputs)
        return lm_loss(out, targets)

    return spx.value_and_grad(loss)(model)


@functools.cache
def reference():
    model, tokens, targets = model_and_batch()
    return reference_value_and_grad(model, tokens, targets)


# name -> (mesh kind, keyword arguments of spx.run, stage of each block on an MPMD mesh)
TRAIN_CONFIGS = {
    "mpmd4-Std1F1B-m4": ("pp4", lambda: {"schedule": spx.Std1F1B(microbatches=4)}, (0, 1, 1, 2, 3)),
    "spmd-m4": ("spmd", lambda: {"microbatches": 4}, None),
    "mpmd4-sizes-1112": ("pp4", lambda: {"microbatches": 2, "stage_sizes": (1, 1, 1, 2)}, (0, 1, 2, 3, 3)),
}


@functools.cache
def train_run(name: str):
    """`(loss, grads, calls, runner)`: `spx.run(mode="train")` for `name`, run (and traced) once here."""
    kind, kwargs, _ = TRAIN_CONFIGS[name]
    model, tokens, targets = model_and_batch()
    kwargs = kwargs()
    before = {id(r) for r, _ in eager_run._runners.values()}
    CALLS.clear()
    loss, grads = spx.run(
        model, inputs=tokens, targets=targets, mesh=mesh_of(kind), loss_fn=lm_loss, **kwargs
    )
    calls = list(CALLS)
    (runner,) = [r for r, _ in eager_run._runners.values() if id(r) not in before]
    return loss, grads, calls, runner


# --- 10. train and forward on both paths -------------------------------------------------------------


@pytest.mark.parametrize("name", list(TRAIN_CONFIGS))
def test_run_train_matches_value_and_grad(name):
    loss, grads, _, _ = train_run(name)
    ref_loss, ref_grads = reference()
    assert isinstance(grads, spx.State)
    assert jax.tree.structure(grads) == jax.tree.structure(ref_grads)
    assert list(grads.flat()) == list(ref_grads.flat())
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


@pytest.mark.parametrize("name", [n for n, c in TRAIN_CONFIGS.items() if c[2] is not None])
def test_run_train_grads_live_where_forward_order_puts_them(name):
    """The split follows the forward, not the declaration order: embed on rank 0, head on the last."""
    kind, _, block_stage = TRAIN_CONFIGS[name]
    mesh = mesh_of(kind)
    _, grads, _, _ = train_run(name)
    for (_, path), value in grads.flat().items():
        if path.startswith("embed."):
            rank = 0
        elif path.startswith("head."):
            rank = 3
        else:
            rank = block_stage[int(path.split(".")[1])]
        assert value.devices() <= rank_devices(mesh, rank), path


def test_grads_indexed_by_rank_are_each_rank_s_part_in_path_order():
    """`grads[r]`: the State of rank r's entries (where they live), sorted as spectrax-lib sorts a
    State; a State without ranks and a rank holding nothing are KeyErrors saying so."""
    mesh = mesh_of("pp4")
    _, grads, _, _ = train_run("mpmd4-Std1F1B-m4")
    parts = [grads[r] for r in range(4)]
    assert all(type(part) is spx.State for part in parts)
    assert sorted(key for part in parts for key in part.flat()) == sorted(grads.flat())
    for r, part in enumerate(parts):
        for c, path, value in part.items():
            assert value.devices() <= rank_devices(mesh, r) and grads.get(c, path) is value
    assert [p for _, p in parts[0].paths()] == ["blocks.0.lin.bias", "blocks.0.lin.weight", "embed.table"]
    assert [p for _, p in parts[3].paths()] == [
        "blocks.4.lin.bias",
        "blocks.4.lin.weight",
        "head.bias",
        "head.weight",
    ]
    with pytest.raises(KeyError, match="no entry lies on pipeline rank 4; the entries lie on ranks"):
        grads[4]
    with pytest.raises(KeyError, match="has no pipeline ranks .* index it by collection"):
        jax.tree.map(lambda g: g, grads)[0]
    with pytest.raises(KeyError, match="has no pipeline ranks"):
        train_run("spmd-m4")[1][0]


@pytest.mark.parametrize("kind, microbatches", [("pp4", 2), ("spmd", 2)])
def test_run_forward_matches_model_call(kind, microbatches):
    model, tokens, _ = model_and_batch()
    out = spx.run(model, inputs=tokens, mesh=mesh_of(kind), mode="forward", microbatches=microbatches)
    assert out.shape == (BATCH, LEN, VOCAB)
    assert_close(out, model(tokens))


# --- 11. every block exactly once --------------------------------------------------------------------


def test_each_block_runs_once_per_trace_and_the_step_has_four_stages():
    _, _, calls, runner = train_run("mpmd4-Std1F1B-m4")
    assert calls and len(calls) % N_BLOCKS == 0
    assert calls == list(range(N_BLOCKS)) * (len(calls) // N_BLOCKS)
    step = runner.step
    assert len(step.last_graph.stages) == 4
    log = step.dispatch_log
    assert {rank for rank, _, _ in log} == {0, 1, 2, 3}
    forwards = sorted((a.stage, a.microbatch) for _, a, _ in log if a.kind == "F")
    assert forwards == [(s, i) for s in range(4) for i in range(4)]
    for rank, action, _ in log:
        assert rank == action.stage  # one stage per rank, in order


@pytest.mark.parametrize(
    "order, what",
    [((0, 1, 1, 2, 3, 4), "twice"), ((0, 1, 3, 4), "skipped"), ((1, 0, 2, 3, 4), "out of order")],
)
def test_block_called_twice_or_skipped_is_an_error(order, what):
    _, tokens, targets = model_and_batch()
    bad = Net(spx.Rngs(0), order=order)
    with pytest.raises(mp.StageSplitError, match=r"exactly once, in list order") as info:
        spx.run(bad, inputs=tokens, targets=targets, mesh=mesh_of("pp4"), loss_fn=lm_loss, microbatches=2)
    assert f"order {list(order)}" in str(info.value), what
    with pytest.raises(mp.StageSplitError, match=r"exactly once"):
        spx.run(bad, inputs=tokens, mesh=mesh_of("pp2"), mode="forward", microbatches=2)


def test_auto_stage_sizes_profile_the_blocks_and_train_exactly(caplog):
    """`stage_sizes="auto"` splits the `blocks` ModuleList where the profiled costs say (logged),
    once per configuration, and trains exactly as the unsplit model."""
    model, tokens, targets = model_and_batch()
    kwargs = dict(inputs=tokens, targets=targets, mesh=mesh_of("pp2"), loss_fn=lm_loss, microbatches=2)
    with caplog.at_level("INFO", logger="spectrax_mpmd"):
        loss, grads = spx.run(model, stage_sizes="auto", **kwargs)
    ref_loss, ref_grads = reference()
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert caplog.text.count("stage_sizes='auto'") == 1
    spx.run(model, stage_sizes="auto", **kwargs)  # the same configuration: no second profile
    assert caplog.text.count("stage_sizes='auto'") == 1
    with pytest.raises(mp.MpmdError, match="'auto'"):
        spx.run(model, stage_sizes="even", **kwargs)


def test_model_without_blocks_on_mpmd_mesh_is_an_error():
    class Plain(spx.Module):
        def __init__(self):
            self.a = spx.nn.Linear(3, 3, rngs=spx.Rngs(0))
            self.b = spx.nn.Linear(3, 3, rngs=spx.Rngs(1))

        def forward(self, x):
            return self.b(self.a(x))

    x = jnp.ones((BATCH, 3))
    with pytest.raises(
        mp.StageSplitError, match=r"neither a PipelineSequential nor holds a `blocks` ModuleList"
    ):
        spx.run(Plain(), inputs=x, targets=x, mesh=mesh_of("pp2"), loss_fn=mse, microbatches=2)


def test_bad_stage_sizes_are_an_error():
    model, tokens, targets = model_and_batch()
    with pytest.raises(mp.StageSplitError, match=r"stage_sizes=\(2, 2\) must .*sum to the model's 5 blocks"):
        spx.run(
            model,
            inputs=tokens,
            targets=targets,
            mesh=mesh_of("pp2"),
            loss_fn=lm_loss,
            microbatches=2,
            stage_sizes=(2, 2),
        )


# --- 12. PipelineSequential ------------------------------------------------------------------------------


class Residual(spx.Module):
    def __init__(self, d, rngs):
        self.lin = spx.nn.Linear(d, d, rngs=rngs)

    def forward(self, x):
        return x + jnp.tanh(self.lin(x))


def mse(out, y):
    return jnp.mean((out - y) ** 2)


@functools.cache
def pipeline_case():
    rngs = spx.Rngs(3)
    model = spx.nn.PipelineSequential(
        spx.nn.Linear(6, D, rngs=rngs),
        Residual(D, rngs),
        spx.nn.Sequential(spx.nn.Linear(D, 8, rngs=rngs), Residual(8, rngs)),
        spx.nn.Linear(8, 3, rngs=rngs),
    )
    k1, k2 = jax.random.split(jax.random.key(4))
    return model, jax.random.normal(k1, (BATCH, 6)), jax.random.normal(k2, (BATCH, 3))


def test_pipeline_sequential_on_four_ranks_matches_eager():
    model, x, y = pipeline_case()
    loss, grads = spx.run(
        model, inputs=x, targets=y, mesh=mesh_of("pp4"), loss_fn=mse, schedule=spx.GPipe(microbatches=4)
    )
    ref_loss, ref_grads = jax.jit(lambda m: spx.value_and_grad(lambda mm: mse(mm(x), y))(m))(model)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    for (_, path), value in grads.flat().items():
        assert value.devices() <= rank_devices(mesh_of("pp4"), int(path.split(".")[0])), path
    out = spx.run(model, inputs=x, mesh=mesh_of("pp4"), mode="forward", microbatches=2)
    assert_close(out, model(x))


def test_pipeline_sequential_stage_count_must_match_the_mesh():
    model, x, y = pipeline_case()
    with pytest.raises(mp.StageSplitError, match=r"PipelineSequential has 4 stages .* need 2"):
        spx.run(model, inputs=x, targets=y, mesh=mesh_of("pp2"), loss_fn=mse, microbatches=2)
    with pytest.raises(mp.StageSplitError, match=r"stage_sizes does not apply"):
        spx.run(
            model,
            inputs=x,
            targets=y,
            mesh=mesh_of("pp4"),
            loss_fn=mse,
            microbatches=2,
            stage_sizes=(1, 1, 1, 1),
        )


# --- 13. the gradients feed spx.Optimizer ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["mpmd4-Std1F1B-m4", "spmd-m4"])
def test_run_grads_update_like_value_and_grad_grads(name):
    model, _, _ = model_and_batch()
    _, grads, _, _ = train_run(name)
    _, ref_grads = reference()
    updated, expected = spx.clone(model), spx.clone(model)
    spx.Optimizer(updated, optax.sgd(0.1)).update(updated, grads)
    spx.Optimizer(expected, optax.sgd(0.1)).update(expected, ref_grads)
    before, after, want = (spx.tree_state(m).filter("parameters") for m in (model, updated, expected))
    assert_close(after, want)
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(after), jax.tree.leaves(before))]
    assert all(moved)


@pytest.mark.parametrize("name", ["mpmd4-Std1F1B-m4", "spmd-m4"])
def test_run_grads_feed_a_stateful_optimizer(name):
    """Adam's state spans every parameter; gradients spread over the pipeline ranks are moved to
    their parameters first, so two Adam steps equal the single-device ones."""
    _, grads, _, _ = train_run(name)
    _, ref_grads = reference()
    model, _, _ = model_and_batch()
    updated, expected = spx.clone(model), spx.clone(model)
    opt, ref_opt = spx.Optimizer(updated, optax.adam(1e-2)), spx.Optimizer(expected, optax.adam(1e-2))
    for _ in range(2):
        opt.update(updated, grads)
        ref_opt.update(expected, ref_grads)
    assert_close(spx.tree_state(updated).filter("parameters"), spx.tree_state(expected).filter("parameters"))


def test_second_run_after_an_update_sees_the_new_values():
    """The compiled step is reused for the updated model (same structure) and reads its new values."""
    model, tokens, targets = model_and_batch()
    kind, kwargs, _ = TRAIN_CONFIGS["mpmd4-Std1F1B-m4"]
    _, grads, _, _ = train_run("mpmd4-Std1F1B-m4")
    updated = spx.clone(model)
    spx.Optimizer(updated, optax.sgd(0.5)).update(updated, grads)
    runners = {id(r) for r, _ in eager_run._runners.values()}
    loss, new_grads = spx.run(
        updated, inputs=tokens, targets=targets, mesh=mesh_of(kind), loss_fn=lm_loss, **kwargs()
    )
    # no new compile for the same configuration
    assert {id(r) for r, _ in eager_run._runners.values()} == runners
    # the updated parameters live on the ranks of their gradients; the reference runs on one device
    ref_loss, ref_grads = reference_value_and_grad(mp.gather(updated), tokens, targets)
    assert ref_loss < reference()[0]
    assert_close(loss, ref_loss)
    assert_close(new_grads, ref_grads)


class FrozenBlock(spx.Module):
    def __init__(self, rngs):
        self.lin = spx.nn.Linear(4, 4, rngs=rngs)
        self.shift = spx.Buffer(jnp.full((4,), 0.3))

    def forward(self, h):
        return h + jnp.tanh(self.lin(h) + self.shift.value)


class WithBuffersAndFrozen(spx.Module):
    def __init__(self):
        rngs = spx.Rngs(5)
        self.inp = spx.nn.Linear(3, 4, rngs=rngs)
        self.blocks = spx.nn.ModuleList([FrozenBlock(rngs) for _ in range(4)])

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h


def test_buffers_and_frozen_parameters_get_no_gradient():
    model = spx.freeze(WithBuffersAndFrozen(), spx.path_startswith("blocks.1"))
    k1, k2 = jax.random.split(jax.random.key(6))
    x, y = jax.random.normal(k1, (BATCH, 3)), jax.random.normal(k2, (BATCH, 4))
    loss, grads = spx.run(model, inputs=x, targets=y, mesh=mesh_of("pp2"), loss_fn=mse, microbatches=2)
    ref_loss, ref_grads = jax.jit(lambda m: spx.value_and_grad(lambda mm: mse(mm(x), y))(m))(model)
    paths = [path for _, path in grads.flat()]
    assert not any(p.startswith("blocks.1.") or p.endswith("shift") for p in paths)
    assert len(paths) == 2 * 4  # inp and three unfrozen blocks, weight and bias each
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


# --- 14. dict (and tuple) inputs ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind, microbatches", [("pp2", 2), ("spmd", 2)])
def test_dict_inputs_are_passed_as_keywords(kind, microbatches):
    model, tokens, targets = model_and_batch()
    scale = jnp.linspace(0.5, 2.0, BATCH)
    inputs = {"scale": scale, "tokens": tokens}
    loss, grads = spx.run(
        model, inputs=inputs, targets=targets, mesh=mesh_of(kind), loss_fn=lm_loss, microbatches=microbatches
    )
    ref_loss, ref_grads = reference_value_and_grad(model, inputs, targets)
    assert not np.allclose(ref_loss, reference()[0])  # the scale does reach the loss
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_tuple_inputs_are_passed_positionally():
    model, tokens, _ = model_and_batch()
    scale = jnp.linspace(2.0, 0.5, BATCH)
    out = spx.run(model, inputs=(tokens, scale), mesh=mesh_of("pp2"), mode="forward", microbatches=2)
    assert_close(out, model(tokens, scale))
