"""The script the multi-host tests launch: one pipelined job, run by every process.

    python -m spectrax_mpmd.launch --nproc P [--devices-per-proc K] multihost_worker.py MODE OUT

Each process writes what it owns (the loss, and every gradient leaf whose
devices are its own) to `OUT/<case>_p<process>.npz`. The tests compute their
references in their own process with this module's functions (`model`,
`adamw_losses`, `eager_run`, ...).

MODE:

* `schedules` (2 x 2): GPipe, Std1F1B, ZeroBubbleH1 and InterleavedH1 (two virtual
  stages) on 4 ranks, a parameter read by the first and last stages, a model on 2
  ranks of two devices each with its activation split over them, and an `sxjit`
  forward; each through both transports, saved as `<case>-<transport>`.
* `adamw` (4 x 1): Std1F1B, a 10-step AdamW loop, an `mp.Runner` training step and
  the eager `spx.run`, each through both transports; then the exchange's two paths,
  processes choosing different transports, and a mesh that leaves processes without
  a rank, whose errors each process records.
* `hang`: process 0 stops answering after the first step; the others must time out.
* `die`: process 1 kills itself in the middle of the second step.
* `fewer`, `raise` (2 x 1): process 1 makes two calls where process 0 makes three,
  or raises after two; the job must end within the timeout.
* `empty` (2 x 1): a step whose edge, cotangent and tied gradient hold zero-size
  arrays, through each transport.
* `inputs` (2 x 1): through each transport, calls where process 1 passes other
  values, shapes, parameters or argument structure than process 0 (each refused
  on every process), then the same arguments; an `sxjit` call and a check on
  every call (`SPECTRAX_MPMD_CHECK_INPUTS=always`).
* `noinit` (2 x 2, `mp.initialize()` not called): `create_mesh` and the first
  call of a function on a plain `jax.sharding.Mesh` refuse to run.

`hang`, `die`, `fewer` and `raise` use the launcher's `--transport`.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import jax
import numpy as np
import optax

import spectrax_mpmd as mp
from spectrax_core import schedules as S

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SCHEDULES = (
    ("GPipe", S.GPipe(microbatches=4)),
    ("Std1F1B", S.Std1F1B(microbatches=4)),
    ("ZeroBubbleH1", S.ZeroBubbleH1(microbatches=4)),
    ("InterleavedH1", S.InterleavedH1(microbatches=4, virtual_stages=2)),
)


def _mesh(n: int):
    return mp.create_mesh((n, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:n])


def model(n_stages: int) -> tuple:
    """`(params, batch)` of the heterogeneous test model, each made by one compiled program
    (eager random ops would compile one small program each, in every process)."""
    from mpmd_cases import hetero_batch, hetero_params

    params = jax.jit(hetero_params, static_argnums=1)(jax.random.key(n_stages), n_stages)
    return params, jax.jit(hetero_batch)(jax.random.key(7))


def _owned(loss, grads) -> dict:
    """The loss and the gradient leaves this process holds, by flat index."""
    out = {"loss": np.asarray(loss)}
    for k, g in enumerate(jax.tree.leaves(grads)):
        if g.is_fully_addressable:
            out[f"g{k}"] = np.asarray(g)
    return out


def _forward(params, tokens):
    """The heterogeneous model's logits (its loss without the cross-entropy)."""
    from mpmd_cases import _block_apply

    h = mp.sxstage_iter(params["embed"]["table"][tokens] + params["embed"]["pos"])
    for k, block in enumerate(params["blocks"]):
        h = mp.sxstage_iter(_block_apply(k % 3, block, h))
    return jax.numpy.mean(h, axis=1) @ params["head"]


def _tied_params():
    rng = np.random.default_rng(5)
    return {
        "table": (rng.standard_normal((11, 8)) * 0.5).astype(np.float32),
        "w1": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32),
        "w2": (rng.standard_normal((8, 8)) * 0.3).astype(np.float32),
    }


def _tied_loss(params, batch):
    """The embedding table is read by the first stage and, transposed, by the last: its
    gradient is summed across ranks (here across processes)."""
    tokens, labels = batch
    h = mp.sxstage_iter(params["table"][tokens])
    h = mp.sxstage_iter(jax.numpy.tanh(h @ params["w1"]))
    h = mp.sxstage_iter(jax.numpy.tanh(h @ params["w2"]))
    return _tied_head(params, h, labels)


def _tied_head(params, h, labels):
    """Cross-entropy of the logits through the transposed embedding table."""
    logp = jax.nn.log_softmax(jax.numpy.mean(h, axis=1) @ params["table"].T)
    return -jax.numpy.mean(jax.numpy.take_along_axis(logp, labels[:, None], axis=1))


def sharded_loss(params, batch):
    """Two stages whose activation is split over its rank's two devices (`fsdp`), so every
    cross-process move of it is of a split array; the embedding table is read by both stages."""
    from jax.sharding import PartitionSpec

    tokens, labels = batch
    h = jax.numpy.tanh(params["table"][tokens] @ params["w1"])
    h = mp.sxstage_iter(h, sharding=PartitionSpec("fsdp"))
    return _tied_head(params, jax.numpy.tanh(h @ params["w2"]), labels)


def sharded_step():
    """`sharded_loss` on 2 ranks of (fsdp=2), one per process of the 2 x 2 job."""
    mesh = mp.create_mesh((2, 1, 2, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    return mp.sxvalue_and_grad(sharded_loss, mesh=mesh, schedule=S.Std1F1B(microbatches=2))


def _mlp_forward(params, extra, x):
    """A forward for `mp.Runner` (the functional `mp.run`): a marker after every layer but the last."""
    for k, w in enumerate(params):
        x = jax.numpy.tanh(x @ w)
        if k < len(params) - 1:
            x = mp.sxstage_iter(x)
    return x


def _mse(out, y):
    return jax.numpy.mean((out - y) ** 2)


def _mlp_case():
    """`(params, extra, inputs, targets)` of the `mp.Runner` case."""
    rng = np.random.default_rng(6)
    params = [(rng.standard_normal((8, 8)) * 0.4).astype(np.float32) for _ in range(4)]
    x, y = (rng.standard_normal((8, 8)).astype(np.float32) for _ in range(2))
    return params, None, x, y


def eager_run():
    """`(loss, grads)` of the eager API's `spx.run` on a 4-block `spx.Module`, one block per rank."""
    import jax.numpy as jnp

    import spectrax_eager as spx

    class Net(spx.Module):
        def __init__(self, rngs):
            self.embed = spx.nn.Linear(8, 16, rngs=rngs)
            self.blocks = spx.nn.ModuleList([spx.nn.Linear(16, 16, rngs=rngs) for _ in range(4)])
            self.head = spx.nn.Linear(16, 4, rngs=rngs)

        def forward(self, x):
            h = self.embed(x)
            for block in self.blocks:
                h = h + jnp.tanh(block(h))
            return self.head(h)

    x, y = _mlp_case()[2], _mlp_case()[3][:, :4]
    return spx.run(
        Net(spx.Rngs(0)), inputs=x, targets=y, mesh=_mesh(4), loss_fn=_mse, schedule=S.Std1F1B(microbatches=2)
    )


def empty_loss(params, x, y):
    """A zero-size array crosses the stage boundary next to a full one (and so do their
    cotangents), and the zero-size parameter `z`, read by both stages, sends only its zero-size
    gradient to its owner."""
    h = jax.numpy.tanh(x @ params["w0"])
    e = x[:, :0] * jax.numpy.sum(params["z"])
    h, e = mp.sxstage_iter((h, e))
    out = jax.numpy.tanh(h @ params["w1"]) + jax.numpy.sum(e, axis=1, keepdims=True) + jax.numpy.sum(params["z"])
    return jax.numpy.mean((out - y) ** 2)


def empty_case() -> tuple:
    """`(params, x, y)` of `empty_loss`."""
    rng = np.random.default_rng(8)
    w0, w1, x, y = ((rng.standard_normal((8, 8)) * 0.4).astype(np.float32) for _ in range(4))
    return {"w0": w0, "w1": w1, "z": np.zeros((0,), np.float32)}, x, y


def _refused(call) -> dict:
    """`{"error": message}` of the `DistributedError` that `call()` raises, `"none"` if it returns."""
    try:
        call()
    except mp.DistributedError as err:
        return {"error": np.asarray(str(err))}
    return {"error": np.asarray("none")}


def _inputs() -> dict:
    """The `inputs` mode's cases (see the module docstring)."""
    from mpmd_cases import hetero_loss

    from spectrax_mpmd._env import CHECK_INPUTS_ENV, TRANSPORT_ENV, TRANSPORTS

    params, batch = model(2)
    tokens, labels = batch
    alone = jax.process_index() == 0
    other = {  # what process 1 passes instead of `(params, batch)`
        "values": (params, ((tokens + 1) % 11, labels)),
        "shapes": (params, (tokens[:8], labels[:8])),
        "params": ({**params, "head": params["head"] * 2}, batch),
        "tree": (params, [tokens, labels]),
    }
    results = {}
    for transport in TRANSPORTS:
        os.environ[TRANSPORT_ENV] = transport
        step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(2), schedule=S.GPipe(microbatches=2))
        for case, args in other.items():
            results[f"{case}-{transport}"] = _refused(lambda: step(*((params, batch) if alone else args)))
        results[f"same-{transport}"] = _owned(*step(params, batch))  # refused calls leave the job usable
    forward = mp.sxjit(_forward, mesh=_mesh(2), schedule=S.GPipe(microbatches=2), batch_argnums=1)
    results["sxjit"] = _refused(lambda: forward(params, tokens if alone else tokens[::-1]))
    os.environ[CHECK_INPUTS_ENV] = "always"
    step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(2), schedule=S.GPipe(microbatches=2))
    float(step(params, batch)[0])
    results["always"] = _refused(lambda: step(params, batch if alone else (tokens, (labels + 1) % 5)))
    return results


def _not_joined() -> dict:
    """The `noinit` mode's cases: this process never joined the launcher's job."""
    results = {"mesh": _refused(lambda: _mesh(2))}
    plain = jax.sharding.Mesh(np.asarray(jax.devices()[:2]).reshape(2, 1), ("pp", "dp"))
    double = mp.sxjit(lambda x: mp.sxstage_iter(x) * 2, mesh=plain)
    results["build"] = _refused(lambda: double(np.ones(4, np.float32)))
    return results


def adamw_losses(step, params, batch) -> np.ndarray:
    """The losses of 10 AdamW steps with global-norm clipping (across processes when staged so)."""
    opt = mp.StagedOptimizer(optax.adamw(1e-2), max_grad_norm=1.0)
    losses, state = [], None
    for _ in range(10):
        loss, grads = step(params, batch)
        state = opt.init(params, grads) if state is None else state
        params, state = opt.update(grads, state, params)
        losses.append(float(loss))
    return np.asarray(losses)


def _pipelined(mode: str) -> dict:
    """`{case: {name: array}}` of `mode`'s pipelined steps, through the transport set now."""
    from mpmd_cases import hetero_loss

    results = {}
    if mode == "schedules":
        for name, schedule in SCHEDULES:
            params, batch = model(4 * schedule.virtual_stages)
            step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(4), schedule=schedule)
            results[name] = _owned(*step(params, batch))
        step = mp.sxvalue_and_grad(_tied_loss, mesh=_mesh(4), schedule=S.Std1F1B(microbatches=4))
        results["tied"] = _owned(*step(_tied_params(), batch))
        results["sharded"] = _owned(*sharded_step()(_tied_params(), batch))
        params, batch = model(4)
        fwd = mp.sxjit(_forward, mesh=_mesh(4), schedule=S.GPipe(microbatches=4), batch_argnums=1)
        y = fwd(params, batch[0])
        results["forward"] = {"y": np.asarray(y)} if y.is_fully_addressable else {}
    else:
        params, batch = model(4)
        step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(4), schedule=S.Std1F1B(microbatches=4))
        results["Std1F1B"] = _owned(*step(params, batch))
        results["adamw"] = {"losses": adamw_losses(step, params, batch)}
        runner = mp.Runner(_mlp_forward, mesh=_mesh(4), loss_fn=_mse, schedule=S.GPipe(microbatches=2))
        results["runner"] = _owned(*runner(*_mlp_case()))
        results["eager"] = _owned(*eager_run())
    return results


def run(mode: str) -> dict:
    """`{case: {name: array}}` of this process's share of `mode`'s results."""
    # imported here: mpmd_cases touches devices at import, which must follow mp.initialize()
    from mpmd_cases import hetero_loss

    from spectrax_mpmd._comm import make_transport
    from spectrax_mpmd._env import TRANSPORT_ENV, TRANSPORTS

    results = {}
    if mode in ("schedules", "adamw"):
        for transport in TRANSPORTS:  # every case through each transport, in one job
            os.environ[TRANSPORT_ENV] = transport
            results.update({f"{case}-{transport}": r for case, r in _pipelined(mode).items()})
    if mode == "schedules":
        params, batch = model(4)
        step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(4), schedule=S.GPipe(microbatches=4))
        try:  # a diagnostic that walks the steps itself is refused, not run half-way
            step.profile(params, batch, rounds=1)
            results["profile"] = {"error": np.asarray("none")}
        except mp.MpmdError as err:
            results["profile"] = {"error": np.asarray(str(err))}
    elif mode == "adamw":
        # the runtime's exchange through the coordination service, and its public fallback (a
        # device collective), with no transfer in flight: the same values in the same order
        from spectrax_mpmd._comm.exchange import Exchange, _collective_allgather

        mine = f"process {jax.process_index()}"
        results["exchange"] = {
            "store": np.asarray(Exchange("check").allgather(mine)),
            "collective": np.asarray(_collective_allgather(mine)),
        }
        # processes that choose different transports: every process refuses at the first build
        os.environ[TRANSPORT_ENV] = "ppermute" if jax.process_index() == 1 else "transfer"
        try:
            make_transport()
            results["mismatch"] = {"error": np.asarray("none")}
        except mp.DistributedError as err:
            results["mismatch"] = {"error": np.asarray(str(err))}
        os.environ[TRANSPORT_ENV] = "transfer"
        if jax.process_count() > 2:  # a mesh of processes 0 and 1 only: every process refuses it
            try:
                step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(2), schedule=S.GPipe(microbatches=2))
                step(model(2)[0], model(2)[1])
                results["idle"] = {"error": np.asarray("none")}
            except mp.DistributedError as err:
                results["idle"] = {"error": np.asarray(str(err))}
    elif mode in ("hang", "die"):  # two ranks, one per process
        step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(2), schedule=S.GPipe(microbatches=2))
        params, batch = model(2)
        for k in range(3):
            if mode == "hang" and k == 1 and jax.process_index() == 0:
                time.sleep(600)  # alive but silent: the other process must give up on its own
            loss, _ = step(params, batch)
            if mode == "die" and k == 1 and jax.process_index() == 1:
                print("killing myself mid-step", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)  # the step's cells are issued, its transfers pending
            float(loss)
    elif mode in ("fewer", "raise"):  # process 1 stops issuing steps between two calls
        step = mp.sxvalue_and_grad(hetero_loss, mesh=_mesh(2), schedule=S.GPipe(microbatches=2))
        params, batch = model(2)
        for k in range(3):
            if k == 2 and jax.process_index() == 1:
                if mode == "raise":
                    raise ValueError("process 1 fails between steps")
                break
            float(step(params, batch)[0])
    elif mode == "empty":
        for transport in TRANSPORTS:
            os.environ[TRANSPORT_ENV] = transport
            step = mp.sxvalue_and_grad(empty_loss, mesh=_mesh(2), schedule=S.GPipe(microbatches=2))
            results[f"empty-{transport}"] = _owned(*step(*empty_case()))
    elif mode == "inputs":
        results = _inputs()
    elif mode == "noinit":
        results = _not_joined()
    else:
        raise SystemExit(f"unknown mode {mode!r}")
    return results


def main() -> None:
    mode, out = sys.argv[1], sys.argv[2]
    if mode != "noinit":
        mp.initialize()
    process = os.environ["JAX_PROCESS_ID"]  # the launcher's index, joined or not
    for case, arrays in run(mode).items():
        np.savez(os.path.join(out, f"{case}_p{process}.npz"), **arrays)
    print(f"{mode}: done", flush=True)


if __name__ == "__main__":
    main()
