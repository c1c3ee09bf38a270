"""Test setup: eight fake CPU devices, configured before JAX is imported."""

import os

os.environ["JAX_PLATFORMS"] = "cpu"
# LLVM codegen without optimization: compiles dominate the suite and take a third less time
# this way; every test compares programs built with the same flags (and subprocesses inherit them)
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "")
    + " --xla_force_host_platform_device_count=8 --xla_backend_optimization_level=0"
).strip()

import jax  # noqa: E402

jax.config.update("jax_enable_x64", False)
