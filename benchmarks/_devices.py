"""The benchmarks' fake CPU devices: XLA's CPU backend reads their count from XLA_FLAGS when JAX
starts, so a script calls `cpu_devices` before it imports JAX."""

from __future__ import annotations

import os

FLAG = "--xla_force_host_platform_device_count"


def cpu_devices(count: int = 8) -> None:
    """Ask for `count` CPU devices unless XLA_FLAGS already sets a count (other backends ignore it)."""
    if FLAG not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FLAG}={count}".strip()
