"""The key of the `spx.run` runner cache, made of values: what a loss function, a mesh and an
optimizer are, not which object.

A loss written inline (`loss_fn=lambda o, t: ...`) is a new function object on
every call, and a mesh built inside a step function a new mesh; a cache keyed
by object would compile again each time and keep every copy. The key of a
function is its code with the values it reads when traced: its closure cells,
defaults and the globals its code names. Functions among them are keyed the
same way, except a global function of another module (a library's), which is
keyed as itself: it is bound once at import, and keying it by content would
walk the library. The key of a mesh is its devices, axis names, axis types and pipeline
axis. A value that has no key by content (a module or Variable, whose values a
trace would bake in; a tracer) gives no key, and the run is not cached.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import Mesh

from .._graph.module import Module
from .._graph.variable import Variable
from .._graph.walk import trainable

_SCALARS = (type(None), bool, int, float, complex, str, bytes)


class Uncacheable(Exception):
    """A value that a key by content cannot cover."""


def _names(code: types.CodeType) -> set[str]:
    """The global names `code` (and the functions, lambdas and comprehensions inside it) may read."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _names(const)
    return names


def _array_key(x: Any) -> tuple:
    if isinstance(x, jax.core.Tracer):
        raise Uncacheable(x)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
        return ("key", str(x.dtype), _array_key(jax.random.key_data(x)))
    data = np.ascontiguousarray(np.asarray(x))
    digest = hashlib.blake2b(data.tobytes(), digest_size=16).hexdigest()
    return ("array", str(data.dtype), data.shape, bool(getattr(x, "weak_type", False)), digest)


def _function_key(fn: types.FunctionType, active: frozenset) -> tuple:
    if id(fn) in active:  # recursion (a function naming itself): its code is already in the key
        return ("recursive", fn.__code__)
    active = active | {id(fn)}
    cells = tuple(value_key(c.cell_contents, active) for c in fn.__closure__ or ())
    names = sorted(n for n in _names(fn.__code__) if n in fn.__globals__)
    globals_ = tuple((n, value_key(fn.__globals__[n], active, fn.__globals__)) for n in names)
    defaults = value_key(fn.__defaults__, active), value_key(fn.__kwdefaults__, active)
    return ("function", fn.__code__, cells, defaults, globals_)


def value_key(value: Any, active: frozenset = frozenset(), home: dict | None = None) -> Any:
    """A hashable key equal for values a trace treats alike; raises `Uncacheable` if there is none.

    `home`: the globals of the function that names `value` as a global (None otherwise).
    """
    if isinstance(value, _SCALARS):
        return (type(value).__name__, value)
    if isinstance(value, types.FunctionType):
        if home is not None and value.__globals__ is not home:
            return ("object", types.FunctionType, value)
        return _function_key(value, active)
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(value_key(v, active, home) for v in value))
    if isinstance(value, dict):
        items = value.items()
        return ("dict", tuple((value_key(k, active, home), value_key(v, active, home)) for k, v in items))
    if isinstance(value, set | frozenset):
        return ("set", frozenset(value_key(v, active, home) for v in value))
    if isinstance(value, functools.partial):
        parts = (value.func, value.args, value.keywords)
        return ("partial", *(value_key(v, active, home) for v in parts))
    if isinstance(value, types.MethodType):
        return ("method", value_key(value.__func__, active, home), value_key(value.__self__, active, home))
    if isinstance(value, jax.Array | np.ndarray | np.generic):
        return _array_key(value)
    if isinstance(value, Module | Variable):
        raise Uncacheable(value)
    try:
        hash(value)
    except TypeError:
        raise Uncacheable(value) from None
    return ("object", type(value), value)  # modules, classes, jitted functions: by their own equality


def function_key(fn: Any) -> Any:
    """The cache key of a loss function (None for no loss function); raises `Uncacheable`."""
    return None if fn is None else value_key(fn)


def mesh_key(mesh: Any) -> tuple:
    """The cache key of an `MpmdMesh` or `jax.sharding.Mesh`: devices, axis names and types, MPMD
    axis; an MPMD mesh by each pipeline rank's submesh (ranks may differ in shape)."""
    if getattr(mesh, "is_mpmd", False):
        return (type(mesh).__name__, mesh.mpmd_axis, tuple(_grid_key(sub) for sub in mesh.unstack()))
    jax_mesh = getattr(mesh, "jax_mesh", mesh)
    if not isinstance(jax_mesh, Mesh):
        raise Uncacheable(mesh)
    return (type(mesh).__name__, getattr(mesh, "mpmd_axis", None), _grid_key(jax_mesh))


def _grid_key(jax_mesh: Mesh) -> tuple:
    devices = np.asarray(jax_mesh.devices)
    return (
        tuple(jax_mesh.axis_names),
        devices.shape,
        tuple((d.platform, d.id) for d in devices.flat),
        tuple(map(str, getattr(jax_mesh, "axis_types", ()))),
    )


def optimizer_key(plan, optimizers: list) -> tuple:
    """What of the optimizers changes the compiled step, by value: each transformation's code and
    the values it closes over, and the variables it updates (raises `Uncacheable`)."""
    return tuple(
        (function_key(opt.tx.init), function_key(opt.tx.update), trainable(plan, opt.wrt))
        for opt in optimizers
    )


class RunKey(NamedTuple):
    """Everything that changes a run's programs, by value (see this module)."""

    graphdef: Any
    selected: tuple[bool, ...]
    mesh: tuple
    mode: str
    microbatches: int
    schedule: Any
    has_aux: bool
    stage_sizes: Any
    loss: Any
    optimizer: Any  # the optimizers' transformations and selections, by value (None: gradients out)
    memory: Any = ()  # what each stage keeps (remat, offload), the weight, the budget, the buckets


def run_key(plan, selected, settings, loss_fn, optimizers) -> RunKey | None:
    """The `RunKey` of a run of `plan` with `settings` (a `spectrax_mpmd.StepSettings`), or None
    when a value it depends on has no key by content."""
    memory = {"remat": settings.remat, "offload": settings.offload}
    for name in ("microbatch_weight_fn", "memory_budget", "length_buckets"):  # when given, by value
        if getattr(settings, name) is not None:
            memory[name] = getattr(settings, name)
    try:
        return RunKey(
            plan.graphdef,
            selected,
            mesh_key(settings.mesh),
            settings.mode,
            settings.microbatches,
            settings.schedule,
            settings.has_aux,
            settings.stage_sizes,
            function_key(loss_fn),
            None if optimizers is None else optimizer_key(plan, optimizers),
            _hashable(memory),
        )
    except Uncacheable:
        return None


def _hashable(value):
    """`value` with its lists and mappings as (sorted) tuples and its functions by value
    (`value_key`); `Uncacheable` if it cannot be hashed."""
    if inspect.isfunction(value):
        return value_key(value)
    if isinstance(value, dict):
        value = tuple(sorted((k, _hashable(v)) for k, v in value.items()))
    elif isinstance(value, (list, tuple)):
        value = tuple(_hashable(v) for v in value)
    try:
        hash(value)
    except TypeError as err:
        raise Uncacheable(f"{value!r} has no key by value") from err
    return value
