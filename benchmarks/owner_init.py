"""Owner-rank initialisation and restores in host batches: what they cost.

Sections (`--sections`, all by default):

  init      the main job's LM (examples/train_lm.py: byte vocabulary, d_model 128, 4 blocks,
            4 ranks, Std1F1B over 8 microbatches, clipped AdamW) and an 8-block d512 LM: the
            whole-tree initialisation (`init(key)` and `tx.init`, all on one device, as the
            step then moves each leaf) against `mp.init_on_owners` (each rank makes its own
            leaves). Wall seconds of each (the owner-rank one after `mp.owner_layout` has built
            the step's plan, which the first step reuses; the plan's own seconds next to it), and
            per device the bytes of live arrays once made (`jax.live_arrays()`, each buffer once),
            the most they reached while being made, and the temporaries of each device's
            owner-rank program (XLA's `memory_analysis`), which live arrays do not show.
  restore   the d512 LM's parameters and Adam state saved (as a dict of its leaves, so that no
            layers are stacked after the reads), then restored onto the 4 ranks
            (`mp.owner_layout`) in one read (`host_bytes` above the checkpoint) and in host
            batches (`host_bytes=0`: one array at a time; the default, 64 MiB): wall seconds,
            the tracemalloc peak, and the host bytes staged beyond the restored arrays (that peak
            minus what is still held after: on CPU a restored array may keep the host buffer it
            was read into, which is that device's memory).

    python benchmarks/owner_init.py [--sections init,restore]
        [--json benchmarks/results/owner_init.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import threading
import tracemalloc
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _timing import once  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core import schedules as S  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM  # noqa: E402

MIB = 2**20
MODELS = {  # name -> TransformerLM.init's sizes
    "train_lm (d128, 4 blocks)": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, d_ff=512),
    "d512, 8 blocks": dict(vocab_size=256, d_model=512, n_layers=8, n_heads=8, d_ff=2048),
}
TX = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(3e-3))


def lm_init(sizes: dict, ranks: int):
    return lambda key: mp.stage_blocks(TransformerLM.init(key, **sizes), ranks)


def live_mib(before: set) -> dict:
    """MiB of live arrays per device id, made since `before` (ids), each buffer once."""
    buffers = {}
    for x in jax.live_arrays():
        if id(x) in before or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            buffers[shard.device.id, shard.data.unsafe_buffer_pointer()] = shard.data.nbytes
    out: dict = {}
    for (device, _), size in buffers.items():
        out[device] = out.get(device, 0) + size / MIB
    return dict(sorted(out.items()))


class PeakLive:
    """The most MiB of live arrays per device while the block runs (made since it started, each
    buffer once), sampled by a thread every millisecond; the block's result is kept alive."""

    def __enter__(self):
        gc.collect()
        self.before = {id(x) for x in jax.live_arrays()}
        self.peak: dict = {}
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while not self.stop.wait(1e-3):
            self._take()

    def _take(self) -> None:
        for device, mib in live_mib(self.before).items():
            self.peak[device] = max(self.peak.get(device, 0.0), mib)

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()
        self._take()


class ProgramTemps:
    """Per device id, the most MiB of temporaries (XLA's `memory_analysis`: what a program needs
    beyond its arguments and outputs, which `jax.live_arrays()` does not see) of the programs that
    `compiler` (the step's, which compiles the owner-rank programs) compiles inside the block."""

    def __init__(self, compiler):
        self.compiler = compiler

    def __enter__(self):
        self.before = set(self.compiler.cache)
        return self

    def __exit__(self, *exc):
        self.made = {k: v for k, v in self.compiler.cache.items() if k not in self.before}

    def mib(self) -> dict:
        out: dict = {}
        for (_, devices), executable in self.made.items():
            temp = executable.memory_analysis().temp_size_in_bytes / MIB
            for device in devices:
                out[device.id] = max(out.get(device.id, 0.0), temp)
        return dict(sorted(out.items()))


def with_temps(row: dict, temps: dict) -> dict:
    """`row` with each device's program temporaries and its share plus them over the share: a
    lower bound of the device's peak while its program runs (its outputs are its share)."""
    final = row["final_mib"]
    ratios = {d: (final[d] + temps.get(d, 0.0)) / final[d] for d in final if final[d]}
    return row | {"temp_mib": temps, "with_temps_vs_final": ratios, "max_with_temps_vs_final": max(ratios.values())}


def peak_row(peak: dict, final: dict) -> dict:
    """Per device the peak MiB and its ratio to the final share, and the largest ratio."""
    ratios = {d: peak[d] / final[d] for d in final if final[d]}
    return {
        "peak_mib": peak,
        "final_mib": final,
        "peak_vs_final": ratios,
        "max_peak_vs_final": max(ratios.values()),
    }


def lm_step(ranks: int = 4):
    mesh = mp.create_mesh((ranks, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:ranks])
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=S.Std1F1B(microbatches=8), tx=TX)
    tokens = jax.ShapeDtypeStruct((32, 64), jnp.int32)
    return step, (tokens, tokens)


def measured(make) -> dict:
    """Wall seconds of `make()` (its result waited for), the live MiB per device it leaves and the
    most it held while it ran (`PeakLive`)."""
    held = {}
    with PeakLive() as peak:
        seconds, cpu = once(lambda: held.setdefault("made", jax.block_until_ready(make())), wait=None)
    live = live_mib(peak.before)
    held.clear()
    return {
        "seconds": seconds,
        "cpu_s": cpu,
        "live_mib": live,
        "max_device_mib": max(live.values()),
    } | peak_row(peak.peak, live)


def init_section() -> list[dict]:
    rows = []
    for name, sizes in MODELS.items():
        init = lm_init(sizes, 4)
        step, batch = lm_step()
        key = jax.random.key(0)
        # builds (and compiles) the step's plan
        plan_s, _ = once(lambda: mp.owner_layout(step, init, key, *batch), wait=None)
        whole = measured(lambda: (lambda p: (p, TX.init(p)))(init(key)))
        with ProgramTemps(step.runner.update_step.compiler) as temps:
            owner = measured(lambda: mp.init_on_owners(step, init, key, *batch))
        owner = with_temps(owner, temps.mib())
        rows.append({"model": name, "plan_s": plan_s, "whole_tree": whole, "owner_ranks": owner})
        print(
            f"{name}: whole tree {whole['seconds']:.3f} s, {whole['live_mib']} MiB per device; owner ranks "
            f"{owner['seconds']:.3f} s (plan {plan_s:.1f} s, reused by the first step), {owner['live_mib']}, "
            f"peak / final share {owner['max_peak_vs_final']:.2f}; program temporaries {owner['temp_mib']} MiB, "
            f"share plus them / share {owner['max_with_temps_vs_final']:.2f}"
        )
    return rows


def flat(tree) -> dict:
    """`tree`'s leaves by path: arrays restored as they are, no layers to stack after the reads."""
    return {jax.tree_util.keystr(path): x for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def restore_section() -> list[dict]:
    init = lm_init(MODELS["d512, 8 blocks"], 4)
    step, batch = lm_step()
    params, state = mp.init_on_owners(step, init, jax.random.key(0), *batch)
    like = flat(mp.owner_layout(step, init, jax.random.key(0), *batch))
    total = sum(x.size * x.dtype.itemsize for x in like.values())
    largest = max(x.size * x.dtype.itemsize for x in like.values())
    rows = []
    with tempfile.TemporaryDirectory() as directory:
        mp.save_checkpoint(directory, 1, params=flat((params, state)))
        del params, state
        for label, host_bytes in (("one read", 2 * total), ("default (64 MiB)", None), ("per array", 0)):
            gc.collect()
            tracemalloc.start()
            read = {}
            with PeakLive() as device_peak:
                seconds, _ = once(
                    lambda: read.setdefault(
                        "got",
                        jax.block_until_ready(
                            mp.restore_checkpoint(directory, like=like, host_bytes=host_bytes).params
                        ),
                    ),
                    wait=None,
                )
            final = live_mib(device_peak.before)
            got = read.pop("got")
            held, peak = tracemalloc.get_traced_memory()
            tracemalloc.stop()
            del got
            row = {"read": label, "seconds": seconds, "staged_mib": (peak - held) / MIB}
            row["peak_mib"] = peak / MIB
            row["devices"] = peak_row(device_peak.peak, final)
            rows.append({**row, "checkpoint_mib": total / MIB, "largest_mib": largest / MIB})
            print(
                f"restore {label}: {seconds:.2f} s, staged {row['staged_mib']:.1f} MiB, traced peak "
                f"{row['peak_mib']:.1f} MiB (checkpoint {total / MIB:.1f}, largest {largest / MIB:.1f}), "
                f"per device peak / final share {row['devices']['max_peak_vs_final']:.2f}"
            )
    return rows


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sections", default="init,restore")
    parser.add_argument("--json", default="benchmarks/results/owner_init.json")
    args = parser.parse_args(argv)
    sections = args.sections.split(",")
    out: dict = {"devices": str(jax.devices()[0].platform)}
    if "init" in sections:
        out["init"] = init_section()
    if "restore" in sections:
        out["restore"] = restore_section()
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
