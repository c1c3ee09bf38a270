"""Multi-process MPMD train steps against the single-process step of the same model.

Model: a 4-layer tanh MLP (D=256, B=64, the small config of `mpmd_overhead.py`), MSE
loss, 4 pipeline ranks, Std1F1B with m=8 microbatches. Layouts of the same 4 ranks,
each its own job (CPU devices, loopback), the multi-process ones through each
cross-process transport:

  1 x 4             one process holding all four ranks (the single-process runtime)
  2 x 2 transfer    two processes, two ranks each, `jax.experimental.transfer` pulls
  2 x 2 ppermute    the same, two-sided `lax.ppermute` programs
  4 x 1 transfer    four processes, one rank each
  4 x 1 ppermute

Per layout, `--rounds` rounds of `--calls` steps (each call waited for: the loss and
this process's gradients): step wall time min, median and spread ((max - min) /
median), and each process's issuing-thread CPU time per step (`_timing.issue_clock`
around the calls: the host cost of issuing its own ranks' cells, transfers and the
wait for its receives), next to the number of plan steps the process issues per
call and the CPU time per issued step. Layouts are separate jobs, so their rounds are
not interleaved with each other; rounds within a job are. Transfer latency per MiB
(process 0 -> process 1, median over rounds): the transfer server's pull, the
`ppermute` pair program, and the in-process device-to-device copy, each through the
runtime's own code.

On this 2-core machine the processes compete for the same cores, so wall time does
not show the pipeline's speed-up; the issued steps and issue CPU per process are the
figures that should fall as 1/processes.

    python benchmarks/multihost.py [--rounds 5] [--calls 5]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from _timing import interleaved, ratio, summary, times

LAYOUTS = ((1, 4, None), (2, 2, "transfer"), (2, 2, "ppermute"), (4, 1, "transfer"), (4, 1, "ppermute"))
D, B, LAYERS, M = 256, 64, 4, 8
MIB = 1 << 20


# --- the worker (one per process) ----------------------------------------------------------------


_BARRIERS: dict = {}


def _barrier(world: int) -> None:
    """A barrier through the key-value store (a device collective here could deadlock with a
    transfer still being pulled; see docs/multihost.md)."""
    if world > 1:
        from spectrax_mpmd._comm import Exchange

        _BARRIERS.setdefault("x", Exchange("benchmark-barrier")).allgather("")


def _mlp_loss(params, batch):
    import jax.numpy as jnp

    import spectrax_mpmd as mp

    x, y = batch
    h = x
    for k, layer in enumerate(params):
        h = jnp.tanh(h @ layer["w"] + layer["b"])
        if k < len(params) - 1:
            h = mp.sxstage_iter(h)
    return jnp.mean((h - y) ** 2)


def _step_figures(world: int, rounds: int, calls: int) -> dict:
    import jax
    import numpy as np

    import spectrax_mpmd as mp
    from spectrax_core import schedules as S

    rng = np.random.default_rng(0)
    params = [
        {"w": (rng.standard_normal((D, D)) / np.sqrt(D)).astype(np.float32), "b": np.zeros(D, np.float32)}
        for _ in range(LAYERS)
    ]
    batch = tuple(rng.standard_normal((B, D)).astype(np.float32) for _ in range(2))
    mesh = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
    step = mp.sxvalue_and_grad(_mlp_loss, mesh=mesh, schedule=S.Std1F1B(microbatches=M))
    params, batch = jax.device_put((params, batch), jax.local_devices()[0])

    def call():
        loss, grads = step(params, batch)
        return loss, [g for g in jax.tree.leaves(grads) if g.is_fully_addressable]

    for _ in range(3):
        jax.block_until_ready(call())
    issued = len(step.plan_for(params, batch).hot_steps)
    wall, cpu = interleaved({"step": call}, rounds, calls, setup=lambda _: _barrier(world))
    return {"wall": wall["step"], "cpu": cpu["step"], "issued": issued}


def _copy_per_mib(rounds: int, mib: int) -> float | None:
    """In-process device-to-device copy (the runtime's `_comm.local` path), seconds per MiB."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from spectrax_mpmd._comm import transfer

    local = jax.local_devices()
    if len(local) < 2:
        return None
    src, dst = SingleDeviceSharding(local[0]), SingleDeviceSharding(local[1])
    x = jax.block_until_ready(jax.device_put(jnp.ones(mib * MIB // 4, jnp.float32), src))
    move = transfer([src], [dst])
    wall, _ = interleaved({"copy": lambda: move(x)}, rounds)
    return summary(wall["copy"], unit="s")["median_s"] / mib


def _cross_process_per_mib(name: str, rounds: int, mib: int) -> float | None:
    """Process 0 -> process 1 through the runtime's transport `name`: the receiving process's
    time from issuing the receive step to having the array, both sides issuing together."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from spectrax_mpmd._comm import PairTransport, TransferServerTransport

    transport = {"transfer": TransferServerTransport, "ppermute": PairTransport}[name]()
    me = jax.process_index()
    first, second = (jax.devices()[p * jax.local_device_count()] for p in (0, 1))
    source, target = SingleDeviceSharding(first), SingleDeviceSharding(second)
    spec = jax.ShapeDtypeStruct((mib * MIB // 4,), jnp.float32, sharding=target)
    group = transport.new_group("benchmark", 0)
    send = transport.send_step(group, 1, [source], [spec])
    recv = transport.recv_step(group, 0, [source], [spec])
    sent, fill = {}, iter(range(rounds + 1))

    def begin(_):
        transport.begin()
        r = next(fill)
        if me == 0:
            sent["x"] = jax.block_until_ready(jax.device_put(jnp.full(spec.shape, r, jnp.float32), first))
        _barrier(2)  # both sides issue at once (a ppermute runs when both have)

    def end(*_):
        transport.end()
        _barrier(2)

    def one():  # the sender's side is not timed: only the receiver's figures are kept
        if me == 0:
            send(sent.pop("x"))
            return None
        return recv()

    # the first round connects the pair
    wall, _ = interleaved({"pull": one}, rounds + 1, setup=begin, after=end)
    return summary(wall["pull"][1:], unit="s")["median_s"] / mib if me != 0 else None


def worker(out: str, rounds: int, calls: int) -> None:
    world = int(os.environ.get("JAX_NUM_PROCESSES", "1"))
    transport = os.environ.get("SPECTRAX_MPMD_TRANSPORT", "transfer")
    if world > 1:
        import spectrax_mpmd as mp

        mp.initialize()
    import jax

    result = {"process": jax.process_index(), "world": world, **_step_figures(world, rounds, calls)}
    if jax.process_index() == 0:
        result["copy_s_per_mib"] = _copy_per_mib(rounds, 4)
    if world == 2:
        result["cross_process_s_per_mib"] = _cross_process_per_mib(transport, rounds, 4)
    Path(out, f"p{jax.process_index()}.json").write_text(json.dumps(result))


# --- the driver ------------------------------------------------------------------------------------


def _run_layout(nproc: int, devices: int, transport: str | None, rounds: int, calls: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        me = [os.path.abspath(__file__), "--worker", out, "--rounds", str(rounds), "--calls", str(calls)]
        env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
        env.setdefault("JAX_PLATFORMS", "cpu")
        if nproc == 1:
            env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
            cmd = [sys.executable, *me]
        else:
            launch = [sys.executable, "-m", "spectrax_mpmd.launch", "--nproc", str(nproc)]
            cmd = [*launch, "--devices-per-proc", str(devices), "--transport", transport, *me]
        subprocess.run(cmd, env=env, check=True, timeout=900, stdout=subprocess.DEVNULL)
        return [json.loads(p.read_text()) for p in sorted(Path(out).glob("p*.json"))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5, help="rounds per layout (default 5)")
    ap.add_argument("--calls", type=int, default=5, help="steps per round (default 5)")
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "multihost.json"))
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args.worker, args.rounds, args.calls)
        return
    rows, transfers = [], {}
    for nproc, devices, transport in LAYOUTS:
        procs = _run_layout(nproc, devices, transport, args.rounds, args.calls)
        wall = [max(p["wall"][r] for p in procs) for r in range(args.rounds)]  # the slowest process
        layout = f"{nproc} x {devices}" + (f" {transport}" if transport else "")
        row = {"layout": layout, "processes": nproc, **summary(wall, procs[0]["cpu"])}
        row["cpu_per_process_ms"] = [statistics.median(p["cpu"]) * 1e3 for p in procs]
        row["issued_per_process"] = [p["issued"] for p in procs]
        row["cpu_per_issued_us"] = [
            c * 1e3 / n for c, n in zip(row["cpu_per_process_ms"], row["issued_per_process"])
        ]
        rows.append(row)
        for p in procs:
            if p.get("copy_s_per_mib") is not None:
                transfers["in-process copy"] = p["copy_s_per_mib"] * 1e3
            if p.get("cross_process_s_per_mib") is not None:
                transfers[transport] = p["cross_process_s_per_mib"] * 1e3
    base = rows[0]["median_ms"]
    base_cpu = statistics.mean(rows[0]["cpu_per_process_ms"])
    base_issued = statistics.mean(rows[0]["issued_per_process"])
    print(f"MLP D={D} B={B}, {LAYERS} ranks, Std1F1B m={M}; {args.rounds} rounds x {args.calls} steps")
    print(
        f"{'layout':17} {'min ms':>7} {'median':>7} {'spread':>6} {'ratio':>5}  "
        "per process: issue CPU ms/step | plan steps issued | CPU us per issued step"
    )
    for row in rows:
        row["ratio"] = row["median_ms"] / base
        row["cpu_ratio"] = ratio(statistics.mean(row["cpu_per_process_ms"]), base_cpu)
        row["issued_ratio"] = statistics.mean(row["issued_per_process"]) / base_issued
        cpus = " ".join(f"{c:.1f}" for c in row["cpu_per_process_ms"])
        issued = " ".join(str(n) for n in row["issued_per_process"])
        per = " ".join(f"{u:.0f}" for u in row["cpu_per_issued_us"])
        print(
            f"{row['layout']:17} {row['min_ms']:7.1f} {row['median_ms']:7.1f} {row['spread']:6.2f} "
            f"{row['ratio']:5.2f}  {cpus} ({times(row['cpu_ratio'])}) | {issued} ({row['issued_ratio']:.2f}x) "
            f"| {per}"
        )
    print("transfer latency, ms per MiB (4 MiB messages, median):")
    for key, ms in transfers.items():
        print(f"  {key:16} {ms:6.2f}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"steps": rows, "transfer_ms_per_mib": transfers}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
