"""The devices the main job's ranks run on (`train_lm.py`): the machine's own when it has one per
rank, else its CPU as fake devices, with a note that says so and how to run on its own."""

from __future__ import annotations

from collections.abc import Callable, Sequence

SPLIT_CPU = "--xla_force_host_platform_device_count"  # how many fake CPU devices JAX makes


def choose_devices(ranks: int, devices: Sequence, cpu_devices: Callable[[], Sequence]) -> tuple[list, str]:
    """`(one device per rank, note)` for `ranks` ranks: the first of `devices` (JAX's default
    platform's) when there are enough, with no note; else the first of `cpu_devices()` (the fake
    CPU devices the script asks JAX for) with a note that says why and which `--stages` runs on
    `devices`. A `SystemExit` says what to change when neither has enough."""
    if len(devices) >= ranks:
        return list(devices[:ranks]), ""
    have, kind, platform = len(devices), devices[0].device_kind, devices[0].platform
    try:
        cpus = list(devices if platform == "cpu" else cpu_devices())
    except RuntimeError:  # JAX_PLATFORMS leaves the CPU out
        cpus = []
    if len(cpus) < ranks:
        found = f"{have} CPU device(s)" if platform == "cpu" else f"{have} {kind} and {len(cpus)} CPU device(s)"
        raise SystemExit(
            f"--stages {ranks} needs {ranks} devices; JAX sees {found} here. Pass --stages {have} or "
            f"fewer, or give JAX {ranks} fake CPU devices: XLA_FLAGS={SPLIT_CPU}={max(ranks, 8)}, with "
            "JAX_PLATFORMS unset or naming cpu."
        )
    one_rank = " (one rank runs every stage; add --schedule InterleavedH1 --virtual-stages 2 for two)"
    return cpus[:ranks], (
        f"note: --stages {ranks} needs {ranks} devices and this machine has {have} {kind}: the "
        f"pipeline runs on {ranks} of its {len(cpus)} fake CPU devices instead, which share the host's "
        f"cores. To train on the {platform.upper()}, pass --stages {have}{one_rank if have == 1 else ''}."
    )
