"""JAX's trace context as the runtime sees it: what changes a trace, and whether one is active.

Both questions have an exact answer in JAX's private `jax._src` modules (listed in
`jax_private`); each is used only when present, with a public fallback that is never less safe:

* `config_key()`: the configuration values that change what tracing produces
  (x64, rank promotion, default matmul precision, ...). Privately JAX's own
  `trace_context()`; publicly every `jax.config` value (a superset: it can only
  cause extra retraces, never a stale plan).
* `active_trace()`: whether a JAX transformation is tracing right now.
  Privately `trace_state_clean()`; publicly a probe primitive is bound, which
  returns a tracer under any jaxpr-building transformation (jit, scan,
  checkpoint, make_jaxpr). Under grad / vmap with only concrete inputs the
  probe cannot see the trace; the call then computes on concrete values, which
  is correct and leaves no tracer in any cache.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Callable

import jax
import numpy as np

from ..errors import MpmdError, TraceContextError
from .jax_private import private
from .marker import sxstage_iter_p


def public_config_key() -> tuple:
    """Every `jax.config` value as currently in force (context managers included)."""
    return tuple((name, getattr(jax.config, name, None)) for name in sorted(jax.config.values))


def public_active_trace() -> bool:
    """Whether binding a probe primitive yields a tracer (a jaxpr-building trace is active)."""
    (out,) = sxstage_iter_p.bind(np.int32(0), stage=None, sharding=(None,))
    return isinstance(out, jax.core.Tracer)


_trace_context = private("jax._src.config.trace_context")
_trace_state_clean = private("jax._src.core.trace_state_clean")


def config_key() -> tuple:
    """The JAX configuration in force that changes what tracing produces (hashable)."""
    return _trace_context() if _trace_context is not None else public_config_key()


def active_trace() -> bool:
    """Whether any JAX transformation is active in the calling thread."""
    if _trace_state_clean is not None:
        return not _trace_state_clean()
    return public_active_trace()


def check_no_trace(name: str) -> None:
    """Raise `TraceContextError` if `name` is called under an active JAX transformation."""
    if active_trace():
        raise TraceContextError(
            f"{name} was called inside a JAX transformation (jax.jit, jax.grad, jax.vmap, lax.scan, "
            "jax.checkpoint, ...): an MPMD step compiles and runs one program per pipeline rank and "
            "cannot be traced into another program. Call it from plain Python; it is compiled already. "
            "To differentiate, use sxvalue_and_grad / sxgrad instead of wrapping the step in jax.grad."
        )


def own_mesh(mesh=None):
    """A context in which JAX's context mesh is `mesh` (None: no mesh), whatever the caller set.

    A caller's `with mesh:` or `jax.set_mesh(...)` names the whole mesh; the
    runtime traces the function without it and each stage program with its
    own submesh, so programs never see devices they do not run on. Inside a
    JAX trace (where JAX sets no mesh) it changes nothing."""
    if mesh is None and jax.sharding.get_abstract_mesh().empty:
        return contextlib.nullcontext()
    try:
        context = jax.set_mesh(mesh)
        context.__enter__()
    except ValueError:  # "`set_mesh` can only be used outside of `jax.jit`"
        return contextlib.nullcontext()
    return _Entered(context)


class _Entered(contextlib.AbstractContextManager):
    """A context already entered: leaving it leaves `context`."""

    def __init__(self, context):
        self.context = context

    def __exit__(self, *exc):
        return self.context.__exit__(*exc)


_STAGE_MESH: contextvars.ContextVar = contextvars.ContextVar("stage_mesh", default=None)


def stage_mesh(mesh):
    """The abstract mesh every pipeline rank's submesh of `mesh` has, its axes all `Auto` (None:
    `mesh` is not a pipeline mesh, its ranks differ in shape, or an axis is `Explicit`)."""
    if not getattr(mesh, "is_mpmd", False):
        return None
    shapes = {mesh.submesh(r).abstract_mesh for r in range(mesh.mpmd_dim)}
    if len(shapes) != 1:
        return None
    abstract = shapes.pop()
    return abstract if all(t == jax.sharding.AxisType.Auto for t in abstract.axis_types) else None


@contextlib.contextmanager
def building_for(mesh):
    """The context a plan for `mesh` is built in: a function traced in it (`traced_mesh`) sees the
    ranks' abstract submesh (`stage_mesh`) as JAX's context mesh, so a bare `PartitionSpec`
    (`with_sharding_constraint(x, P("dp"))`) names the submesh's axes, and each stage program,
    compiled on its own submesh, resolves it there. Without one (ranks of different shapes, or
    `Explicit` axes) a bare `PartitionSpec` is refused with an `MpmdError` naming the working
    form."""
    abstract = stage_mesh(mesh)
    token = _STAGE_MESH.set(abstract)
    try:
        if abstract is None:
            with _bare_specs_refused(mesh):
                yield
        else:
            yield
    finally:
        _STAGE_MESH.reset(token)


def traced_mesh():
    """A context for tracing a function of the plan being built: JAX's abstract mesh is the ranks'
    (see `building_for`); no change outside a build, or for ranks without one."""
    abstract = _STAGE_MESH.get()
    return contextlib.nullcontext() if abstract is None else jax.sharding.use_abstract_mesh(abstract)


@contextlib.contextmanager
def _bare_specs_refused(mesh):
    """JAX's error for a bare `PartitionSpec` traced without a context mesh, as an `MpmdError`."""
    try:
        yield
    except RuntimeError as e:
        if not getattr(mesh, "is_mpmd", False) or "non-empty mesh in context" not in str(e):
            raise
        raise MpmdError(
            "a bare PartitionSpec was given to a sharding constraint in a pipelined function, but the "
            "pipeline ranks' submeshes differ in shape or have Explicit axes, so no one mesh resolves "
            "it (it does when every rank's submesh has the same Auto axes, as create_mesh makes "
            "them). Name the rank's submesh: jax.lax.with_sharding_constraint(x, "
            "NamedSharding(mesh.submesh(k), P(...))), k the pipeline rank whose stage computes x."
        ) from e


def outside_context_mesh(fn: Callable) -> Callable:
    """`fn` run with JAX's context mesh cleared (`own_mesh()`): a public entry point that runs
    per-rank programs, each of which sets its own submesh where it needs one."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with own_mesh():
            return fn(*args, **kwargs)

    return wrapper


def methods_outside_context_mesh(cls: type) -> type:
    """`cls` with `__call__` and every public method wrapped by `outside_context_mesh`."""
    for name, member in list(vars(cls).items()):
        plain = inspect.isfunction(member)  # not a property, staticmethod, classmethod or nested class
        if plain and (name == "__call__" or not name.startswith("_")):
            setattr(cls, name, outside_context_mesh(member))
    return cls
