"""`spx.run(..., optimizer=)`: the whole training step, its update inside the compiled step.

The reference is the eager loop on one device: `spx.value_and_grad(loss, wrt=opt.wrt)` of the
whole-batch loss, then `opt.update(model, grads)`, on an identical copy of the model.
"""

from __future__ import annotations

import jax
import optax
import pytest
from test_eager_run import BATCH, LEN, VOCAB, Net, assert_close, lm_loss, mesh_of

import spectrax_eager as spx
import spectrax_mpmd as mp

STEPS = 3


def lora_net():
    model = Net(spx.Rngs(0))
    spx.nn.inject_lora(model, rank=2, alpha=4.0, where=lambda path, m: path.endswith("lin"), rngs=spx.Rngs(3))
    return model


def data():
    out = []
    for k in range(STEPS):
        k1, k2 = jax.random.split(jax.random.key(10 + k))
        out.append(
            (jax.random.randint(k1, (BATCH, LEN), 0, VOCAB), jax.random.randint(k2, (BATCH, LEN), 0, VOCAB))
        )
    return out


def eager_training(make_optimizer):
    model = lora_net()
    opt = make_optimizer(model)

    @spx.jit(mutable=("parameters", "lora", "opt_state"))
    def step(model, opt, tokens, targets):
        loss, grads = spx.value_and_grad(lambda m: lm_loss(m(tokens), targets), wrt=opt.wrt)(model)
        opt.update(model, grads)
        return loss

    losses = [step(model, opt, *batch) for batch in data()]
    return losses, model, opt


def run_training(make_optimizer, mesh_kind, **kwargs):
    model = lora_net()
    opt = make_optimizer(model)
    losses = [
        spx.run(model, inputs=t, targets=y, mesh=mesh_of(mesh_kind), loss_fn=lm_loss, optimizer=opt, **kwargs)
        for t, y in data()
    ]
    return losses, model, opt


def assert_same_training(got, want):
    for a, b in zip(got[0], want[0]):
        assert_close(a, b)
    assert_close(spx.tree_state(got[1]), spx.tree_state(want[1]))
    assert_close(spx.tree_state(got[2]), spx.tree_state(want[2]))


def adam_on_lora(model):
    return spx.Optimizer(model, optax.adam(1e-2), wrt="lora")


@pytest.mark.parametrize(
    "mesh_kind, kwargs",
    [("pp4", {"schedule": spx.Std1F1B(microbatches=4)}), ("spmd", {"microbatches": 4})],
    ids=["pp4-Std1F1B", "spmd"],
)
def test_lora_fine_tuning_through_run(mesh_kind, kwargs):
    got = run_training(adam_on_lora, mesh_kind, **kwargs)
    want = eager_training(adam_on_lora)
    assert_same_training(got, want)
    base = spx.tree_state(lora_net())["parameters"]
    assert_close(spx.tree_state(got[1])["parameters"], base)  # only the adapters trained
    assert int(got[2].step.value) == STEPS


def test_a_multi_optimizer_through_run():
    def two(model):
        return spx.MultiOptimizer(
            model, {"lora": optax.adam(1e-2), "parameters": optax.sgd(0.05, momentum=0.9)}
        )

    got = run_training(two, "pp4", schedule=spx.ZeroBubbleH1(microbatches=4))
    assert_same_training(got, eager_training(two))


def test_wrt_selects_what_run_differentiates():
    model = lora_net()
    tokens, targets = data()[0]
    loss, grads = spx.run(
        model,
        inputs=tokens,
        targets=targets,
        mesh=mesh_of("pp4"),
        loss_fn=lm_loss,
        schedule=spx.GPipe(microbatches=4),
        wrt="lora",
    )
    ref_loss, ref_grads = jax.jit(
        lambda m: spx.value_and_grad(lambda m: lm_loss(m(tokens), targets), wrt="lora")(m)
    )(model)
    assert set(grads) == {"lora"}
    assert_close(loss, ref_loss)
    assert_close(grads, ref_grads)


def test_optimizer_needs_train_mode():
    model = lora_net()
    tokens, _ = data()[0]
    with pytest.raises(mp.MpmdError, match="optimizer= updates a training step"):
        spx.run(model, inputs=tokens, mesh=mesh_of("pp4"), mode="forward", optimizer=adam_on_lora(model))
    with pytest.raises(TypeError, match="optimizer must be an spx.Optimizer"):
        spx.run(
            model,
            inputs=tokens,
            targets=tokens,
            mesh=mesh_of("pp4"),
            loss_fn=lm_loss,
            optimizer=optax.adam(1),
        )
