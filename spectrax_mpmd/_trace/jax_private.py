"""Every JAX name the package reads from outside JAX's stable `jax.*` API, in one place.

Three kinds, so that a JAX release that moves one is a change to this file alone:

* `PRIVATE`: names under `jax._src` and private names of public modules. Each
  is read only through `private(path)`, which gives None when this JAX lacks
  it; the reader then takes the public fallback written next to it in the
  table (a newer JAX degrades instead of failing), and a test checks that both
  paths give equal results.
* `ATTRIBUTES`: private attributes of JAX objects (a compiled or lowered
  program), read where they are used behind a default or a `try`; listed here
  with their fallbacks and tested alike.
* The extension API (`jax.extend.core`, `jax.interpreters`): the documented way
  to define a primitive and to read a jaxpr, but it moves between releases
  (`DropVar` joined `jax.extend.core` in 0.10). Every module imports it from here.
"""

from __future__ import annotations

import importlib
from typing import NamedTuple

from jax.extend import source_info_util
from jax.extend.core import ClosedJaxpr, DropVar, Jaxpr, JaxprEqn, Literal, Primitive, Var
from jax.interpreters import ad, batching, mlir


class Private(NamedTuple):
    """One private JAX name: where it lives, which module reads it, and the public fallback."""

    path: str
    reader: str
    fallback: str


PRIVATE = (
    Private(
        "jax._src.config.trace_context",
        "spectrax_mpmd._trace.context",
        "every `jax.config` value (a superset of the trace-relevant ones)",
    ),
    Private(
        "jax._src.core.trace_state_clean",
        "spectrax_mpmd._trace.context",
        "a probe primitive bound: a tracer comes back under a jaxpr-building trace",
    ),
    Private(
        "jax._src.compiler.get_compile_options",
        "spectrax_mpmd._compile.relocate",
        "no relocation: every program is compiled",
    ),
    Private(
        "jax.experimental.serialize_executable._JaxPjrtUnpickler",
        "spectrax_mpmd._compile.relocate",
        "no relocation: every program is compiled",
    ),
    Private(
        "jax._src.compilation_cache",
        "spectrax_mpmd._compile.relocate",
        "whether JAX opened its cache (`_cache`) unknown: the public configuration alone decides",
    ),
    Private(
        "jax._src.distributed.global_state",
        "spectrax_mpmd._comm",
        "the coordinator address from the environment; exchanges as a collective all-gather program",
    ),
    Private(
        "jax._src.lib.xla_client.batched_copy_array_to_devices_with_sharding",
        "spectrax_mpmd._comm.local",
        "`jax.device_put`",
    ),
    Private(
        "jax._src.lib.xla_client.ArrayCopySemantics",
        "spectrax_mpmd._comm.local",
        "`jax.device_put`",
    ),
    Private(
        "jax.sharding.NamedSharding._internal_device_list",
        "spectrax_mpmd._comm.local",
        "`jax.device_put`",
    ),
    Private(
        "jax._src.clusters.ClusterEnv",
        "spectrax_mpmd._comm.distributed",
        "assume a cluster and let `jax.distributed.initialize` decide",
    ),
)
_LISTED = {entry.path for entry in PRIVATE}


def private(path: str):
    """The object at `path` (one of `PRIVATE`) if this JAX has it, else None (take the fallback)."""
    if path not in _LISTED:
        raise KeyError(f"{path} is not listed in PRIVATE: add it there with its public fallback")
    parts = path.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            obj = getattr(obj, name, None)
        return obj
    return None


ATTRIBUTES = (
    Private(
        "jax.stages.Compiled._executable._unloaded_executable.device_list",
        "spectrax_mpmd._compile.relocate",
        "no relocation: every program is compiled",
    ),
    Private(
        "jax.stages.Compiled._executable.create_cpp_call",
        "spectrax_mpmd._compile.calls",
        "each program called through its `Compiled` object (one Python frame more per call)",
    ),
    Private(
        "jax.stages.Compiled._params",
        "spectrax_mpmd._compile.calls",
        "each program called through its `Compiled` object (one Python frame more per call)",
    ),
    Private(
        "jax.stages.Lowered._lowering.compile_args",
        "spectrax_mpmd._compile.compiler",
        "a token unique to each lowering: equal programs are compiled once each instead of shared",
    ),
)
EXTENSION = [
    "ClosedJaxpr",
    "DropVar",
    "Jaxpr",
    "JaxprEqn",
    "Literal",
    "Primitive",
    "Var",
    "ad",
    "batching",
    "mlir",
    "source_info_util",
]
__all__ = ["ATTRIBUTES", "EXTENSION", "PRIVATE", "Private", "private", *EXTENSION]
