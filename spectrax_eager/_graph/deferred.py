"""`DeferredParameter` / `DeferredBuffer`: a variable whose shape is known only later.

A layer whose input size is found on its first call creates its weight as
`DeferredParameter((None, d_out), init, rngs, dtype)`, then in `forward`
calls `resolve_shape(x.shape[-1:] + (d_out,))`; the first read of `.value`
(or `materialize()`) then draws it. Until then the variable holds the key its
value will be drawn with (so it moves through `spx.jit` / `spx.export` like any
variable), and reading `.value` with the shape unknown is an error: a
placeholder would silently compute with wrong numbers.
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from .._scope.lazy import building_lazily, check_may_materialize
from . import structure
from .rngs import Rngs
from .variable import Buffer, Parameter, Variable

_SPEC, _INIT, _DTYPE, _DONE = "deferred_shape", "deferred_init", "deferred_dtype", "materialized"
_EXPLICIT = "deferred_explicit"  # built under spx.lazy_init()


def _key(rngs: Any, where: str) -> jax.Array:
    if isinstance(rngs, Rngs):
        return rngs.params()
    if isinstance(rngs, int):
        return jax.random.key(rngs)
    if isinstance(rngs, jax.Array) and jax.dtypes.issubdtype(rngs.dtype, jax.dtypes.prng_key):
        return rngs
    raise TypeError(f"{where}: rngs must be an spx.Rngs, an int seed or a PRNG key, received {rngs!r}.")


class _Deferred:
    """What both deferred classes add to their Variable class."""

    def _setup(self, shape_spec, init: Callable, rngs: Any, dtype: Any, **kw: Any) -> None:
        where = type(self).__name__
        spec = tuple(None if d is None else int(d) for d in shape_spec)
        if not callable(init):
            raise TypeError(f"{where}: init must be init(key, shape, dtype), received {init!r}.")
        meta = {
            _SPEC: spec,
            _INIT: init,
            _DTYPE: dtype,
            _DONE: False,
            _EXPLICIT: building_lazily(),
            **(kw.pop("metadata", None) or {}),
        }
        Variable.__init__(self, _key(rngs, where), metadata=meta, **kw)

    @property
    def is_materialized(self) -> bool:
        return self.metadata.get(_DONE, True)

    def resolve_shape(self, shape: tuple[int, ...]) -> None:
        """Fix the unknown sizes of the shape spec (known ones must match); no-op once materialized."""
        if self.is_materialized:
            return
        spec, shape = self.metadata[_SPEC], tuple(int(d) for d in shape)
        if len(shape) != len(spec) or any(s is not None and s != d for s, d in zip(spec, shape)):
            raise ValueError(f"{type(self).__name__}: shape {shape} does not fit the shape spec {spec}.")
        self.set_metadata(**{_SPEC: shape})

    def materialize(self) -> None:
        """Draw the value `init(key, shape, dtype)`; needs every size known. No-op once done."""
        if self.is_materialized:
            return
        check_may_materialize(self.metadata[_EXPLICIT], type(self).__name__)
        spec = self.metadata[_SPEC]
        if None in spec:
            raise RuntimeError(
                f"{type(self).__name__}: shape {spec} is not known yet; call resolve_shape(shape) first "
                "(a lazy layer does on its first call)."
            )
        self._fill(self.metadata[_INIT](self._value, spec, self.metadata[_DTYPE]))

    def _fill(self, value: Any) -> None:
        object.__setattr__(self, "_value", value)
        for name in (_SPEC, _INIT, _DTYPE, _EXPLICIT):
            self.metadata.pop(name, None)
        self.metadata[_DONE] = True
        structure.bump()

    @property
    def value(self) -> Any:
        """The value; the first read with the shape known materializes it (as `materialize()`)."""
        if not self.is_materialized and None not in self.metadata[_SPEC]:
            self.materialize()
        if not self.is_materialized:
            raise RuntimeError(
                f"{type(self).__name__} of shape {self.metadata[_SPEC]} is not materialized; call "
                "resolve_shape(shape) first (or give it a value)."
            )
        return self._value

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "value" and not self.is_materialized:
            self._fill(value)  # a value given by hand materializes the variable
        else:
            super().__setattr__(name, value)


class DeferredParameter(_Deferred, Parameter):
    """A `Parameter` created from a shape spec (None: not known yet), an initializer
    `init(key, shape, dtype)`, `rngs` (an `spx.Rngs`, a seed or a key) and a dtype."""

    def __init__(
        self, shape_spec, init, rngs, dtype, *, sharding=None, axis_names=None, metadata=None, **more
    ):
        self._setup(
            shape_spec, init, rngs, dtype, sharding=sharding, axis_names=axis_names, metadata=metadata, **more
        )


class DeferredBuffer(_Deferred, Buffer):
    """A `Buffer` made as `DeferredParameter` makes a `Parameter`."""

    def __init__(
        self,
        shape_spec,
        init,
        rngs,
        dtype,
        *,
        kind=None,
        sharding=None,
        axis_names=None,
        metadata=None,
        **more,
    ):
        self._setup(
            shape_spec,
            init,
            rngs,
            dtype,
            kind=kind,
            sharding=sharding,
            axis_names=axis_names,
            metadata=metadata,
            **more,
        )
