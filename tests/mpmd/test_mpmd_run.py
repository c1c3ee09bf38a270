"""`mp.run` / `mp.runner` / `mp.sxcall` / `mp.gather` / stage splitting / `PipelineDecoder`.

Every pipelined or SPMD result is compared with an independent single-device
computation: `jax.value_and_grad` of the whole-batch loss of the unsplit model,
a plain `apply`, the unsplit composition of `sxcall`'s stages, or a greedy
decode without any KV cache. Each configuration compiles once
(`functools.cache`) and is shared by the tests that inspect it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from mpmd_cases import assert_close, lm_batch, pipeline_mesh, tiny_lm

import spectrax_core as sc
import spectrax_mpmd as mp
from spectrax_core import apply
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import greedy_decode

BATCH, N_LAYERS = 8, 4


# --- shared pieces ---------------------------------------------------------------------------


@functools.cache
def lm_and_batch():
    """A 4-layer, 16-wide core TransformerLM (vocab 16) and one batch of 8 `(tokens, targets)`."""
    lm = tiny_lm(jax.random.key(0), n_layers=N_LAYERS, tie_embeddings=False)
    tokens, targets = lm_batch(jax.random.key(1), BATCH)
    return lm, tokens, targets


def lm_loss(model, tokens, targets):
    return softmax_cross_entropy(apply(model, tokens), targets)


ref_value_and_grad = jax.jit(jax.value_and_grad(lm_loss))
full_logits = jax.jit(apply)  # the unsplit forward on one device


@functools.cache
def reference():
    """`(loss, grads)` of the whole batch on one device, unsplit."""
    lm, tokens, targets = lm_and_batch()
    return ref_value_and_grad(lm, tokens, targets)


@functools.cache
def mesh_of(kind: str):
    """`pp2` / `pp4`: pipeline meshes; `spmd`: no pipeline axis (dp=2, fsdp=4)."""
    if kind == "spmd":
        return mp.create_mesh((1, 2, -1, 1, 1, 1))
    return pipeline_mesh(int(kind[2:]))


def rank_devices(mesh, k: int) -> set:
    return set(mesh.submesh(k).devices.flat)


def leaf_devices(tree) -> set:
    return {d for leaf in jax.tree.leaves(tree) for d in leaf.devices()}


def scan_lengths(graph) -> list[list[int]]:
    """Per stage of a stage graph, the lengths of its top-level scans (a BlockStack part is one scan)."""
    return [[e.params["length"] for e in s.eqns if e.primitive.name == "scan"] for s in graph.stages]


# name -> (mesh kind, keyword arguments of run)
TRAIN_CONFIGS = {
    "mpmd4-Std1F1B-m4": ("pp4", lambda: {"schedule": S.Std1F1B(microbatches=4)}),
    "mpmd2-InterleavedH1-v2-m4": (
        "pp2",
        lambda: {"schedule": S.InterleavedH1(microbatches=4, virtual_stages=2)},
    ),
    "mpmd2-DualPipe-m4": ("pp2", lambda: {"schedule": S.DualPipe(microbatches=4)}),  # each stage twice
    "spmd-m4": ("spmd", lambda: {"microbatches": 4}),
}


@functools.cache
def train_run(name: str):
    """`(loss, grads)` of `mp.run(mode="train")` for configuration `name` (run once)."""
    kind, kwargs = TRAIN_CONFIGS[name]
    lm, tokens, targets = lm_and_batch()
    return mp.run(
        lm, inputs=tokens, targets=targets, mesh=mesh_of(kind), loss_fn=softmax_cross_entropy, **kwargs()
    )


# --- 1. train on both paths --------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TRAIN_CONFIGS))
def test_run_train_matches_value_and_grad(name):
    lm, _, _ = lm_and_batch()
    loss, grads = train_run(name)
    ref_loss, ref_grads = reference()
    assert jax.tree.structure(grads) == jax.tree.structure(lm)
    assert isinstance(grads, sc.models.TransformerLM)
    assert jnp.shape(loss) == ()
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


# --- 2. forward on both paths ------------------------------------------------------------------

FORWARD_CONFIGS = {
    "mpmd4-default-GPipe-m4": ("pp4", lambda: {"microbatches": 4}),
    "mpmd2-InterleavedH1-v2-m2": (
        "pp2",
        lambda: {"schedule": S.InterleavedH1(microbatches=2, virtual_stages=2)},
    ),
    "spmd-m2": ("spmd", lambda: {"microbatches": 2}),
}


@pytest.mark.parametrize("name", list(FORWARD_CONFIGS))
def test_run_forward_matches_apply_in_batch_order(name):
    kind, kwargs = FORWARD_CONFIGS[name]
    lm, tokens, _ = lm_and_batch()
    out = mp.run(lm, inputs=tokens, mesh=mesh_of(kind), mode="forward", **kwargs())
    assert out.shape == (BATCH, tokens.shape[1], lm.vocab_size)
    assert_close(out, full_logits(lm, tokens))


# --- 3. stage sizes ----------------------------------------------------------------------------


def scaled_apply(model, tokens, scale):
    """Logits scaled per row: `scale` is a batch input read only by the last stage."""
    return apply(model, tokens) * scale[:, None, None]


SCALE = jnp.linspace(0.5, 2.0, BATCH)


@functools.cache
def scaled_reference():
    """`(logits, loss, grads)` of `scaled_apply` on the whole batch, on one device."""
    lm, tokens, targets = lm_and_batch()
    loss, grads = jax.jit(
        jax.value_and_grad(lambda m: softmax_cross_entropy(scaled_apply(m, tokens, SCALE), targets))
    )(lm)
    return full_logits(lm, tokens) * SCALE[:, None, None], loss, grads


@functools.cache
def uneven_tuple_train():
    """`(step, loss, grads)`: 2 ranks, `stage_sizes=(1, 3)`, inputs `(tokens, SCALE)` (one compile, two tests)."""
    lm, tokens, targets = lm_and_batch()
    step = mp.runner(
        mesh=mesh_of("pp2"),
        loss_fn=softmax_cross_entropy,
        microbatches=2,
        stage_sizes=(1, 3),
        apply_fn=scaled_apply,
    )
    loss, grads = step(lm, (tokens, SCALE), targets)
    return step, loss, grads


def test_uneven_stage_sizes_train_matches_reference_and_cuts_there():
    step, loss, grads = uneven_tuple_train()
    _, ref_loss, ref_grads = scaled_reference()
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    # stage k runs exactly sizes[k] blocks: its part of the BlockStack is one scan of that length
    assert scan_lengths(step.runner.step.last_graph) == [[1], [3]]


def test_uneven_stage_sizes_forward_matches_reference_and_cuts_there():
    lm, tokens, _ = lm_and_batch()
    step = mp.runner(mesh=mesh_of("pp2"), mode="forward", microbatches=2, stage_sizes=(3, 1))
    assert_close(step(lm, tokens), full_logits(lm, tokens))
    assert scan_lengths(step.runner.step.last_graph) == [[3], [1]]


def test_auto_stage_sizes_train_matches_reference_and_cuts_where_balance_says(caplog):
    """`stage_sizes="auto"` on 2 ranks: the blocks are profiled once, the chosen split is logged and
    kept as `step.balance`, and the step it runs is the exact training step, cut there."""
    lm, tokens, targets = lm_and_batch()
    step = mp.runner(mesh=mesh_of("pp2"), loss_fn=softmax_cross_entropy, microbatches=2, stage_sizes="auto")
    with caplog.at_level("INFO", logger="spectrax_mpmd"):
        loss, grads = step(lm, tokens, targets)
    ref_loss, ref_grads = reference()
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    sizes = step.balance.sizes
    assert sum(sizes) == N_LAYERS and min(sizes) >= 1 and len(step.balance.block_s) == N_LAYERS
    assert scan_lengths(step.runner.step.last_graph) == [[k] for k in sizes]
    assert "stage_sizes='auto'" in caplog.text and "even" in caplog.text
    with pytest.raises(mp.MpmdError, match="mode='forward'"):
        mp.runner(mesh=mesh_of("pp2"), mode="forward", microbatches=2, stage_sizes="auto")
    with pytest.raises(mp.MpmdError, match="'auto'"):
        mp.runner(mesh=mesh_of("pp2"), loss_fn=softmax_cross_entropy, stage_sizes="balanced")


@pytest.mark.parametrize(
    "n_blocks, n_stages, expected",
    [
        (4, 4, (1, 1, 1, 1)),
        (8, 4, (2, 2, 2, 2)),
        (5, 4, (1, 2, 1, 1)),  # the one extra block goes to the second stage
        (6, 4, (1, 2, 2, 1)),
        (7, 4, (1, 2, 2, 2)),  # never to the first stage (it also embeds)
        (7, 2, (3, 4)),
        (3, 1, (3,)),
    ],
)
def test_stage_sizes_even_split_rule(n_blocks, n_stages, expected):
    assert mp.stage_sizes(n_blocks, n_stages) == expected
    assert mp.stage_sizes(n_blocks, n_stages, list(expected)) == expected


@pytest.mark.parametrize(
    "n_blocks, n_stages, sizes, match",
    [
        (4, 2, (1, 2, 1), r"stage_sizes=\(1, 2, 1\) gives 3 stages.*need 2"),
        (4, 2, (1, 2), r"stage_sizes=\(1, 2\) must be positive and sum to the model's 4 blocks"),
        (4, 2, (0, 4), r"stage_sizes=\(0, 4\).*at least one block"),
        (3, 4, None, r"3 blocks but the mesh and schedule need 4 stages"),
    ],
)
def test_stage_sizes_invalid(n_blocks, n_stages, sizes, match):
    with pytest.raises(mp.StageSplitError, match=match):
        mp.stage_sizes(n_blocks, n_stages, sizes)


def test_run_rejects_bad_stage_sizes_and_too_few_blocks():
    lm, tokens, targets = lm_and_batch()
    with pytest.raises(mp.StageSplitError, match=r"stage_sizes=\(1, 1, 2\) gives 3 stages"):
        mp.run(
            lm,
            inputs=tokens,
            targets=targets,
            mesh=mesh_of("pp2"),
            loss_fn=softmax_cross_entropy,
            microbatches=2,
            stage_sizes=(1, 1, 2),
        )
    with pytest.raises(mp.StageSplitError, match=r"stage_sizes=\(2, 1\) must .*sum to the model's 4 blocks"):
        mp.run(lm, inputs=tokens, mesh=mesh_of("pp2"), mode="forward", microbatches=2, stage_sizes=(2, 1))
    # 4 ranks x 2 virtual stages = 8 stages > 4 blocks
    with pytest.raises(mp.StageSplitError, match=r"4 blocks but the mesh and schedule need 8 stages"):
        mp.run(
            lm,
            inputs=tokens,
            targets=targets,
            mesh=mesh_of("pp4"),
            loss_fn=softmax_cross_entropy,
            schedule=S.InterleavedH1(microbatches=4, virtual_stages=2),
        )
    with pytest.raises(mp.StageSplitError, match=r"4 blocks but the mesh and schedule need 8 stages"):
        mp.stage_blocks(lm, 8)


def test_stage_blocks_round_trip_and_restage():
    lm, _, _ = lm_and_batch()
    staged = mp.stage_blocks(lm, 2, (1, 3))
    assert isinstance(staged.blocks, mp.StagedStack)
    assert staged.blocks.sizes == (1, 3) and staged.blocks.n_layers == N_LAYERS
    # parts hold consecutive slices of the stacked layers
    for whole, first, rest in zip(
        jax.tree.leaves(lm.blocks.layers), *(jax.tree.leaves(p.layers) for p in staged.blocks.parts)
    ):
        np.testing.assert_array_equal(first, whole[:1])
        np.testing.assert_array_equal(rest, whole[1:])
    assert mp.stage_blocks(staged, 2, (1, 3)) is staged
    restaged = mp.stage_blocks(staged, 4)
    assert restaged.blocks.sizes == (1, 1, 1, 1)
    for back in (mp.unstage_blocks(staged), mp.unstage_blocks(restaged)):
        assert jax.tree.structure(back) == jax.tree.structure(lm)
        for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(lm)):
            np.testing.assert_array_equal(a, b)
    assert mp.unstage_blocks(lm) is lm


# --- 4. a staged model in a training loop --------------------------------------------------------


@functools.cache
def staged_training():
    """Three sgd steps of a staged LM through `mp.runner` on 4 ranks, and the same steps unstaged."""
    lm, tokens, targets = lm_and_batch()
    mesh = mesh_of("pp4")
    tx = optax.sgd(0.1)
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=S.GPipe(microbatches=2))
    staged = mp.stage_blocks(lm, 4)
    opt_state = tx.init(staged)
    losses, first_grads = [], None
    for _ in range(3):
        loss, grads = step(staged, tokens, targets)
        first_grads = grads if first_grads is None else first_grads
        losses.append(loss)
        updates, opt_state = tx.update(grads, opt_state, staged)
        staged = optax.apply_updates(staged, updates)
    ref, ref_state, ref_losses = lm, tx.init(lm), []
    for _ in range(3):
        loss, grads = ref_value_and_grad(ref, tokens, targets)
        ref_losses.append(loss)
        updates, ref_state = tx.update(grads, ref_state, ref)
        ref = optax.apply_updates(ref, updates)
    return mesh, staged, losses, first_grads, ref, ref_losses


def test_staged_model_trains_like_unstaged_sgd():
    _, staged, losses, _, ref, ref_losses = staged_training()
    assert isinstance(staged.blocks, mp.StagedStack)
    assert ref_losses[2] < ref_losses[0]  # the loop does train
    for loss, ref_loss in zip(losses, ref_losses):
        assert_close(loss, ref_loss)
    assert_close(mp.unstage_blocks(staged), ref)


def test_staged_step_grads_live_on_their_stage_rank():
    mesh, _, _, grads, _, _ = staged_training()
    assert isinstance(grads.blocks, mp.StagedStack) and len(grads.blocks.parts) == 4
    for k, part in enumerate(grads.blocks.parts):
        assert leaf_devices(part) <= rank_devices(mesh, k), k
    assert leaf_devices(grads.embed) <= rank_devices(mesh, 0)
    assert leaf_devices(grads.head) <= rank_devices(mesh, 3)
    ref_grads = reference()[1]
    assert_close(mp.unstage_blocks(grads), ref_grads)


# --- 5. tuple and dict inputs ------------------------------------------------------------------


@pytest.mark.parametrize(
    "kind, structure, mode, microbatches",
    [
        ("pp2", "tuple", "train", 2),
        ("pp2", "dict", "forward", 2),
        ("spmd", "dict", "train", 1),  # one microbatch: the batch is split over dp x fsdp
        ("spmd", "tuple", "forward", 2),
    ],
)
def test_run_tuple_and_dict_inputs(kind, structure, mode, microbatches):
    lm, tokens, targets = lm_and_batch()
    ref_out, ref_loss, ref_grads = scaled_reference()
    inputs = (tokens, SCALE) if structure == "tuple" else {"scale": SCALE, "tokens": tokens}
    if (kind, structure, mode) == ("pp2", "tuple", "train"):
        # this configuration (with stage_sizes=(1, 3)) is run once for the stage-size tests too
        _, loss, grads = uneven_tuple_train()
        assert_close(loss, ref_loss)
        assert_close(grads, ref_grads)
        return
    kwargs = {"mesh": mesh_of(kind), "microbatches": microbatches, "apply_fn": scaled_apply, "mode": mode}
    if mode == "forward":
        assert_close(mp.run(lm, inputs=inputs, **kwargs), ref_out)
        return
    loss, grads = mp.run(lm, inputs=inputs, targets=targets, loss_fn=softmax_cross_entropy, **kwargs)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


# --- 6. sxcall ----------------------------------------------------------------------------------


def dense_tanh(p, x):
    return jnp.tanh(x @ p["w"] + p["b"])


def dense_gelu(p, x):
    return jax.nn.gelu(x @ p["w"]) + p["b"]


def mse(out, y):
    return jnp.mean((out - y) ** 2)


def sxcall_case(n: int):
    widths = (6, 8, 5, 7, 3)[:n] + (4,)
    keys = jax.random.split(jax.random.key(30 + n), n + 2)
    fns = [dense_tanh if k % 2 == 0 else dense_gelu for k in range(n)]
    params = [
        {
            "w": jax.random.normal(keys[k], (widths[k], widths[k + 1])) * 0.5,
            "b": jnp.full((widths[k + 1],), 0.1 * (k + 1)),
        }
        for k in range(n)
    ]
    x = jax.random.normal(keys[n], (BATCH, widths[0]))
    y = jax.random.normal(keys[n + 1], (BATCH, widths[-1]))

    def compose(ps, x):
        for fn, p in zip(fns, ps):
            x = fn(p, x)
        return x

    return fns, params, x, y, compose


@pytest.mark.parametrize("n, schedule", [(2, S.GPipe(microbatches=4)), (4, S.Std1F1B(microbatches=4))])
def test_sxcall_train_matches_unsplit_composition(n, schedule):
    fns, params, x, y, compose = sxcall_case(n)
    loss, grads = mp.sxcall(
        list(zip(fns, params)), (x, y), mesh=mesh_of(f"pp{n}"), schedule=schedule, loss_fn=mse
    )
    ref_loss, ref_grads = jax.jit(jax.value_and_grad(lambda ps: mse(compose(ps, x), y)))(params)
    assert isinstance(grads, list) and len(grads) == n
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    for k in range(n):
        assert leaf_devices(grads[k]) <= rank_devices(mesh_of(f"pp{n}"), k)


@pytest.mark.parametrize("n", [2, 4])
def test_sxcall_forward_matches_unsplit_composition(n):
    fns, params, x, _, compose = sxcall_case(n)
    out = mp.sxcall(
        list(zip(fns, params)), x, mesh=mesh_of(f"pp{n}"), mode="forward", schedule=S.GPipe(microbatches=2)
    )
    assert_close(out, jax.jit(compose)(params, x))


def test_sxcall_rejects_bad_stages_and_batch():
    fns, params, x, y, _ = sxcall_case(2)
    with pytest.raises(mp.MpmdError, match="stages must be a non-empty list of"):
        mp.sxcall([], (x, y), mesh=mesh_of("pp2"), loss_fn=mse)
    with pytest.raises(mp.MpmdError, match="stages must be a non-empty list of"):
        mp.sxcall([params[0], params[1]], (x, y), mesh=mesh_of("pp2"), loss_fn=mse)
    with pytest.raises(mp.MpmdError, match=r"batch must be a pair \(inputs, targets\)"):
        mp.sxcall(list(zip(fns, params)), x, mesh=mesh_of("pp2"), loss_fn=mse)


# --- 7. gather ----------------------------------------------------------------------------------


def test_gather_puts_every_leaf_on_one_device():
    _, grads = train_run("mpmd4-Std1F1B-m4")
    assert len(leaf_devices(grads)) > 1  # the pipelined gradients are spread over the ranks
    for device in (None, jax.devices()[5]):
        gathered = mp.gather(grads, device)
        target = jax.devices()[0] if device is None else device
        assert jax.tree.structure(gathered) == jax.tree.structure(grads)
        for g, a in zip(jax.tree.leaves(gathered), jax.tree.leaves(grads)):
            assert g.devices() == {target}
            np.testing.assert_array_equal(np.asarray(g), np.asarray(a))


# --- 8. errors ------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pp2", "spmd"])
def test_run_argument_errors(kind):
    lm, tokens, targets = lm_and_batch()
    mesh = mesh_of(kind)
    with pytest.raises(mp.MpmdError, match=r"mode='train' needs loss_fn="):
        mp.run(lm, inputs=tokens, targets=targets, mesh=mesh)
    with pytest.raises(mp.MpmdError, match=r"mode must be 'train' or 'forward', got 'eval'"):
        mp.run(lm, inputs=tokens, mesh=mesh, mode="eval")
    with pytest.raises(mp.MpmdError, match=r"batch size 8 is not divisible by microbatches=3"):
        mp.run(lm, inputs=tokens, targets=targets, mesh=mesh, loss_fn=softmax_cross_entropy, microbatches=3)
    with pytest.raises(mp.MpmdError, match=r"targets have batch size \['4'\] but inputs have 8"):
        mp.run(
            lm, inputs=tokens, targets=targets[:4], mesh=mesh, loss_fn=softmax_cross_entropy, microbatches=2
        )
    with pytest.raises(mp.MpmdError, match=r"every input leaf needs the same leading batch size"):
        mp.run(lm, inputs=(tokens, jnp.ones(4)), mesh=mesh, mode="forward", apply_fn=scaled_apply)
    with pytest.raises(mp.MpmdError, match=r"mode='forward' takes no targets"):
        mp.run(lm, inputs=tokens, targets=targets, mesh=mesh, mode="forward")
    with pytest.raises(mp.MpmdError, match=r"microbatches=2 but the schedule has microbatches=4"):
        mp.run(
            lm,
            inputs=tokens,
            targets=targets,
            mesh=mesh,
            loss_fn=softmax_cross_entropy,
            microbatches=2,
            schedule=S.GPipe(microbatches=4),
        )


def test_run_rejects_non_mesh():
    lm, tokens, targets = lm_and_batch()
    with pytest.raises(mp.MpmdError, match="mesh must be an MpmdMesh or a jax.sharding.Mesh, got str"):
        mp.run(lm, inputs=tokens, targets=targets, mesh="pp", loss_fn=softmax_cross_entropy)


def test_run_model_without_blocks_on_mpmd_mesh():
    linear = sc.nn.Linear.init(jax.random.key(3), 4, 4)
    x = jnp.ones((BATCH, 4))
    # a model without `blocks` is cut at its forward's own markers: a plain Linear has none
    message = r"found 0 stage marker\(s\).*need 2 stages"
    with pytest.raises(mp.StageSplitError, match=message):
        mp.run(linear, inputs=x, targets=x, mesh=mesh_of("pp2"), loss_fn=mse, microbatches=2)
    with pytest.raises(mp.StageSplitError, match=message):
        mp.run(linear, inputs=x, mesh=mesh_of("pp2"), mode="forward")


# --- extra: has_aux on both paths --------------------------------------------------------------


def two_stage_forward(params, _extra, x):
    return mp.sxstage_iter(jnp.tanh(x @ params[0])) @ params[1]


def mse_and_max(out, y):
    return mse(out, y), jnp.max(out)


@functools.cache
def aux_case():
    k1, k2, k3, k4 = jax.random.split(jax.random.key(60), 4)
    params = [jax.random.normal(k1, (5, 6)) * 0.5, jax.random.normal(k2, (6, 3)) * 0.5]
    x, y = jax.random.normal(k3, (BATCH, 5)), jax.random.normal(k4, (BATCH, 3))
    return params, x, y


@pytest.mark.parametrize("kind", ["pp2", "spmd"])
def test_runner_has_aux_with_two_microbatches_is_stacked_per_microbatch(kind):
    params, x, y = aux_case()
    step = mp.Runner(two_stage_forward, mesh=mesh_of(kind), loss_fn=mse_and_max, has_aux=True, microbatches=2)
    (loss, aux), grads = step(params, None, x, y)
    ref_loss, ref_grads = jax.value_and_grad(lambda p: mse(two_stage_forward(p, None, x), y))(params)
    out = two_stage_forward(params, None, x)
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert_close(aux, jnp.stack([jnp.max(out[:4]), jnp.max(out[4:])]))


def test_runner_has_aux_with_one_microbatch_has_the_same_shape_on_both_paths():
    params, x, y = aux_case()
    out = two_stage_forward(params, None, x)
    auxes = {}
    for kind in ("pp2", "spmd"):
        step = mp.Runner(two_stage_forward, mesh=mesh_of(kind), loss_fn=mse_and_max, has_aux=True)
        (_, auxes[kind]), _ = step(params, None, x, y)
        np.testing.assert_allclose(np.ravel(auxes[kind]), [jnp.max(out)], rtol=1e-5)
    assert jnp.shape(auxes["pp2"]) == jnp.shape(auxes["spmd"])


# --- 9. pipelined decoding ------------------------------------------------------------------------

STEPS = 4
PROMPT_SHAPES = ((2, 3), (2, 3), (2, 6))
MAX_LEN = 6 + STEPS  # every decode uses one cache length; the 6-token prompt gets it by default


def max_len_for(i: int):
    return None if PROMPT_SHAPES[i][1] + STEPS == MAX_LEN else MAX_LEN


def prompt(i: int):
    return jax.random.randint(jax.random.key(50 + i), PROMPT_SHAPES[i], 0, 16)


@functools.cache
def decoder(n: int):
    lm, _, _ = lm_and_batch()
    return mp.PipelineDecoder(lm, mesh=mesh_of(f"pp{n}"))


def greedy_without_cache(p, steps: int) -> np.ndarray:
    """Greedy tokens from full causal forwards over a fixed-length buffer (no KV cache at all)."""
    batch, length = p.shape
    seq = np.zeros((batch, MAX_LEN), np.int32)  # causal: the zero padding after a position never reaches it
    seq[:, :length] = np.asarray(p)
    lm, _, _ = lm_and_batch()
    for i in range(steps):
        logits = np.asarray(full_logits(lm, jnp.asarray(seq)))
        seq[:, length + i] = np.argmax(logits[:, length + i - 1], axis=-1)
    return seq[:, length : length + steps]


@pytest.mark.parametrize("i", range(len(PROMPT_SHAPES)))
def test_greedy_decode_reference_matches_cacheless_decode(i):
    lm, _, _ = lm_and_batch()
    got = greedy_decode(lm, prompt(i), STEPS, max_len=max_len_for(i))
    np.testing.assert_array_equal(np.asarray(got), greedy_without_cache(prompt(i), STEPS))


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("i", range(len(PROMPT_SHAPES)))
def test_pipeline_decoder_generates_greedy_tokens(n, i):
    lm, _, _ = lm_and_batch()
    got = decoder(n).generate(prompt(i), STEPS, max_len=max_len_for(i))
    want = greedy_decode(lm, prompt(i), STEPS, max_len=max_len_for(i))
    assert got.shape == (2, STEPS)
    assert np.array_equal(np.asarray(got), np.asarray(want)), (got, want)


@pytest.mark.parametrize("n", [2, 4])
def test_pipeline_decoder_caches_stay_on_their_rank(n):
    lm, _, _ = lm_and_batch()
    dec, mesh, p = decoder(n), mesh_of(f"pp{n}"), prompt(0)
    cache0 = dec.init_cache(2, MAX_LEN)
    assert isinstance(cache0, tuple) and len(cache0) == n
    logits, cache = dec.step(p, cache0)
    assert_close(logits, full_logits(lm, p))
    assert isinstance(cache, tuple) and len(cache) == n
    for k, part in enumerate(cache):
        assert leaf_devices(part) <= rank_devices(mesh, k), k
        assert part.k.shape[0] == N_LAYERS // n  # this stage's blocks only
        np.testing.assert_array_equal(np.asarray(part.index), p.shape[1])


def test_greedy_decode_rejects_prompt_longer_than_max_len():
    lm, _, _ = lm_and_batch()
    with pytest.raises(ValueError, match=r"max_len is 4"):
        greedy_decode(lm, prompt(2), 2, max_len=4)
    with pytest.raises(ValueError, match=r"max_len is 4"):
        decoder(2).generate(prompt(2), 2, max_len=4)


@pytest.mark.parametrize(
    "kind, kwargs", [("pp2", {"schedule": S.GPipe(microbatches=2)}), ("spmd", {"microbatches": 2})]
)
def test_run_shards_parameters_by_the_rules(kind, kwargs):
    """With `rules`, both paths shard each parameter as the rules say (FSDP over `fsdp` here) and the
    numbers still equal the unsplit reference."""
    lm, tokens, targets = lm_and_batch()
    rules = sc.sharding.Rules.default()
    loss, grads = mp.run(
        lm,
        inputs=tokens,
        targets=targets,
        mesh=mesh_of(kind),
        loss_fn=softmax_cross_entropy,
        rules=rules,
        **kwargs,
    )
    ref_loss, ref_grads = reference()
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)
    assert grads.embed.table.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
