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
`~/.cache/spectrax_mpmd/profiles`; `advise(profile_cache=False)` turns it off.

Profiles are stored as data only (`spectrax_mpmd._planner.stored`: JSON with a
versioned, checksummed header), so reading one never runs code. A file that does
not parse, has another version or key, fails its checksum or does not match the
records is a miss: one warning names it, and the profile is measured again and
written over it. Directories the cache creates are the user's only (0o700), and
so are its files (0o600); a directory others can write to (group- or
world-writable, or owned by another user) is still used, after a warning: what
they write there can change the advice, never run.
"""

from __future__ import annotations

import enum
import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
from jax.sharding import AbstractMesh, Mesh, NamedSharding

from .._compile.identity import Held, jaxpr_key
from .._trace import jax_private as jex_core
from .stored import FORMAT, Unreadable, dumped, parsed

ENV = "SPECTRAX_MPMD_PROFILE_CACHE"


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



def _make_private(directory: Path) -> None:
    """`directory` and any missing parent, each created readable by the user only."""
    for folder in reversed([p for p in (directory, *directory.parents) if not p.exists()]):
        folder.mkdir(mode=0o700, exist_ok=True)


def _shared_by(directory: Path) -> str | None:
    """Who else can write into `directory` (None: only its owner, the user)."""
    st = directory.stat()
    if st.st_uid != os.getuid():
        return f"it is owned by user id {st.st_uid}"
    if st.st_mode & 0o022:
        who = "other users" if st.st_mode & 0o002 else "its group"
        return f"its mode {oct(st.st_mode & 0o7777)} lets {who} write"
    return None


class ProfileCache:
    """Profiles on disk under `directory`, one JSON file per key (written whole, then renamed)."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        self._checked = False

    def path(self, key: str) -> Path:
        return self.directory / f"{key}.json"

    def get(self, key: str | None, kind):
        """The value of type `kind` (see `stored.decode`) stored under `key`, or None: no such
        file, or one that is not a profile this version reads (then with a warning naming it)."""
        if key is None:
            return None
        self._check_directory()
        path = self.path(key)
        try:
            return parsed(path.read_bytes(), key, kind)
        except FileNotFoundError:
            return None
        except (OSError, Unreadable) as err:
            warnings.warn(
                f"profile cache: {path} is not a profile this version reads ({err}); measuring the "
                "profile again and writing it over the file.",
                stacklevel=2,
            )
            return None

    def put(self, key: str | None, value) -> None:
        """Store `value` (records, tuples, numbers, strings) under `key`, readable by the user only."""
        if key is None:
            return
        data = dumped(key, value)
        _make_private(self.directory)
        self._check_directory()
        fd, name = tempfile.mkstemp(dir=self.directory, suffix=".tmp")  # mode 0o600
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(name, self.path(key))
        except BaseException:
            os.unlink(name)
            raise

    def _check_directory(self) -> None:
        """Warn, once the directory exists and once only, when others can write into it."""
        if self._checked or not self.directory.exists():
            return
        self._checked = True
        shared = _shared_by(self.directory)
        if shared is not None:
            warnings.warn(
                f"profile cache: other users can write to {self.directory} ({shared}); profiles are "
                "read as data only, but a profile written there changes the advice. Use a directory "
                f"only you can write to: chmod 700 it, or set ${ENV} (or advise(profile_cache=)) to "
                "another.",
                stacklevel=3,
            )
