"""Profiles kept on disk, keyed by the program they profile, so a second advice reuses them.

A profile's key is derived from the program itself, as the compile cache's is
(`spectrax_mpmd._compile.identity.jaxpr_key`): the traced loss on its arguments
(every equation, its operands, avals and parameters, constants by their bytes;
its stage markers give the cut), the optimizer's traced update (or the state
estimate), the schedule, `remat`, the step's other settings, the rounds timed, the
mesh (each pipeline rank's axes and sizes) and device kind, and the JAX version. The key is made persistable
by naming each primitive, type and mesh (and JAX's own marker values, such as an
unspecified sharding, by type and value); a program holding anything that can
only be known by identity (a host callback, an opaque object) gets no key and is
profiled each time. The directory is `$SPECTRAX_MPMD_PROFILE_CACHE`, else
`~/.cache/spectrax_mpmd/profiles`; `advise(profile_cache=None)` turns it off.
"""

from __future__ import annotations

import enum
import hashlib
import os
import pickle
import tempfile
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .._compile.identity import Held, jaxpr_key
from .._trace import jax_private as jex_core

ENV = "SPECTRAX_MPMD_PROFILE_CACHE"
FORMAT = 1  # bump when what a profile holds changes


class _Opaque(Exception):
    """A key part known only by identity: the program gets no persistent key."""


def default_directory() -> Path:
    return Path(os.environ.get(ENV) or Path.home() / ".cache" / "spectrax_mpmd" / "profiles")


def _layout(sharding, position: dict) -> tuple:
    if not isinstance(sharding, NamedSharding):
        raise _Opaque
    mesh = sharding.mesh
    devices = tuple(position[d] for d in mesh.devices.flat)
    return ("named", tuple(mesh.axis_names), mesh.devices.shape, devices, str(sharding.spec))


def _plain(part):
    """`part` of an in-process key as plain, persistable values (tuples, strings, numbers)."""
    if isinstance(part, Held):
        obj = part.obj
        if isinstance(obj, jex_core.Primitive):
            return ("primitive", obj.name)
        if isinstance(obj, type):
            return ("type", obj.__module__, obj.__qualname__)
        if isinstance(obj, (Mesh, AbstractMesh)):  # a program's (abstract) mesh: its axes
            return ("mesh", tuple(obj.axis_names), tuple(obj.axis_sizes))
        kind = type(obj)
        if kind.__module__.startswith("jax") and "0x" not in repr(obj):  # a JAX marker value
            return ("jax", kind.__module__, kind.__qualname__, repr(obj))
        raise _Opaque
    if isinstance(part, (tuple, list)):
        return tuple(_plain(p) for p in part)
    if isinstance(part, frozenset):
        return ("set", tuple(sorted(repr(_plain(p)) for p in part)))
    if part is None or isinstance(part, (str, bytes, bool, int, float)):
        return part
    if isinstance(part, np.dtype):
        return ("dtype", part.str)
    if isinstance(part, enum.Enum):
        return ("enum", type(part).__qualname__, part.name)
    if all(hasattr(part, a) for a in ("shape", "dtype", "weak_type")):  # an abstract value
        return ("aval", tuple(part.shape), np.dtype(part.dtype).str, bool(part.weak_type))
    raise _Opaque


def program_digest(fn, *args) -> str | None:
    """A digest of `fn` traced on `args` (see the module docstring), or None when it has none."""
    closed = jax.make_jaxpr(fn)(*args)
    position = {d: k for k, d in enumerate(jax.devices())}
    key = jaxpr_key(closed, position, _layout)
    if key is None:
        return None
    try:
        return hashlib.sha256(repr(_plain(key)).encode()).hexdigest()
    except (_Opaque, KeyError):
        return None


def update_digest(tx, optimizer_states, params) -> str | None:
    """The digest of the optimizer's update traced on `params` (or of the state estimate)."""
    if optimizer_states is not None:
        return f"states {float(optimizer_states).hex()}"

    def update(grads, state, params):
        updates, state = tx.update(grads, state, params)
        return jax.tree.map(lambda p, u: p + u, params, updates), state

    return program_digest(update, params, jax.eval_shape(tx.init, params), params)


def profile_key(program: str | None, update: str | None, settings: tuple, mesh) -> str | None:
    """The key of one profile: the loss's and the update's digests, the profile's `settings`
    (schedule, remat, step keyword arguments, rounds), the mesh (each pipeline rank's axes and
    sizes, so ranks of different shapes key apart) and the JAX version. None when
    a part has no key, or a setting is a function (known only by identity)."""
    if program is None or update is None or any(callable(v) for v in _leaves(settings)):
        return None
    device = mesh.devices.flat[0]
    ranks = tuple(tuple(sub.shape.items()) for sub in mesh.unstack())  # each rank's own axes and sizes
    where = (tuple(mesh.axis_names), ranks, device.device_kind, device.platform)
    key = (FORMAT, program, update, settings, where, jax.__version__)
    return hashlib.sha256(repr(key).encode()).hexdigest()


def _leaves(value):
    if isinstance(value, (tuple, list)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


class ProfileCache:
    """Profiles on disk under `directory`, one file per key (written whole, then renamed)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)

    def get(self, key: str | None):
        path = None if key is None else self.directory / f"{key}.pkl"
        if path is None or not path.exists():
            return None
        with open(path, "rb") as f:
            return pickle.load(f)

    def put(self, key: str | None, value) -> None:
        if key is None:
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=self.directory, delete=False, suffix=".tmp") as f:
            pickle.dump(value, f)
        os.replace(f.name, self.directory / f"{key}.pkl")
