"""Loading a compiled program onto other devices instead of compiling it again.

Pipeline ranks often run the same program on different devices (the middle
stages of a homogeneous stack, each rank's accumulator setup). XLA compiles a
program for a device assignment, but the compiled code itself does not depend on
which physical devices those are: a serialized executable can be loaded with
the assignment remapped, for a few milliseconds instead of a fresh compile.

This uses JAX's executable serialization (`jax.experimental.serialize_executable`)
and two private pieces (its unpickler, and `jax._src.compiler.get_compile_options`
to state the new assignment), feature-detected at import. When any of them is
missing, or a program cannot be serialized (host callbacks, closed-over
constants), `relocate` returns None and the caller compiles as usual; a test
checks that both give equal results.
"""

from __future__ import annotations

import io
from typing import Sequence

import jax
import numpy as np

from .._trace.jax_private import private


def _detect():
    try:
        from jax.experimental import serialize_executable
    except ImportError:
        return None
    unpickler = private("jax.experimental.serialize_executable._JaxPjrtUnpickler")
    options = private("jax._src.compiler.get_compile_options")
    if unpickler is None or options is None or not hasattr(serialize_executable, "serialize"):
        return None

    class RemappingUnpickler(unpickler):
        """Loads a pickled executable with each device replaced by its counterpart."""

        def __init__(self, file, backend, mapping: dict, devices: list):
            super().__init__(file, backend, devices)
            self.devices_by_id = mapping
            assignment = np.array([[d.id for d in devices]])
            self.options = options(
                num_replicas=1, num_partitions=len(devices), device_assignment=assignment, backend=backend
            )

        def persistent_load(self, pid):
            if pid[0] == "exec":
                return self.backend.deserialize_executable(
                    pid[1], executable_devices=self.execution_devices, compile_options=self.options
                )
            return super().persistent_load(pid)

    return serialize_executable.serialize, RemappingUnpickler


_TOOLS = _detect()


def relocation_available() -> bool:
    """Whether this JAX lets a compiled program be loaded onto other devices."""
    return _TOOLS is not None


def _detect_cache_state():
    """JAX's compilation-cache module if it shows whether JAX holds an open cache, or None."""
    compilation_cache = private("jax._src.compilation_cache")
    return compilation_cache if hasattr(compilation_cache, "_cache") else None


_CACHE_STATE = _detect_cache_state()


def persistent_cache_configured() -> bool:
    """Whether JAX's configuration turns the persistent compilation cache on (public)."""
    return bool(getattr(jax.config, "jax_compilation_cache_dir", None)) and bool(
        getattr(jax.config, "jax_enable_compilation_cache", True)
    )


def persistent_cache_active() -> bool:
    """Whether JAX's persistent compilation cache is in use: configured on, or opened by JAX.

    Programs then come back from `compile()` already deserialized from the cache,
    and such an executable cannot be serialized again faithfully (on CPU its copy
    fails at run time), so relocation stands aside: every rank's program is
    compiled, or loaded from the cache, by JAX itself. Once JAX has opened its
    cache it keeps reading and writing it even after the cache directory is set
    back to None, so JAX's own state (private, feature-detected) counts too;
    without it, the configuration alone decides.
    """
    opened = _CACHE_STATE is not None and getattr(_CACHE_STATE, "_cache", None) is not None
    return opened or persistent_cache_configured()


class Serialized:
    """A compiled program in serialized form, with the devices it was compiled for."""

    def __init__(self, compiled: jax.stages.Compiled, devices: Sequence):
        serialize, _ = _TOOLS
        self.payload, self.in_tree, self.out_tree = serialize(compiled)
        self.devices = tuple(devices)
        self.order = tuple(compiled._executable._unloaded_executable.device_list)


def serialized(compiled: jax.stages.Compiled, devices: Sequence) -> Serialized | None:
    """`compiled` ready to be relocated, or None when it cannot be serialized."""
    if _TOOLS is None:
        return None
    try:
        return Serialized(compiled, devices)
    except Exception:  # host callbacks, constants, or a backend without serialization
        return None


def relocate(source: Serialized, devices: Sequence) -> jax.stages.Compiled | None:
    """`source`'s program loaded for `devices` (position k takes the place of
    `source.devices[k]`), or None when loading fails."""
    _, unpickler = _TOOLS
    mapping = {old.id: new for old, new in zip(source.devices, devices)}
    if set(mapping) != {d.id for d in source.order}:
        return None
    order = [mapping[d.id] for d in source.order]
    try:
        loader = unpickler(io.BytesIO(source.payload), order[0].client, mapping, order)
        unloaded, args_info, no_kwargs = loader.load()
        return jax.stages.Compiled(
            unloaded.load(), [], source.in_tree.unflatten(args_info), source.out_tree, no_kwargs=no_kwargs
        )
    except Exception:  # a backend that cannot load the remapped executable: compile instead
        return None
