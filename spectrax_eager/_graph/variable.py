"""Variable cells: the only place the eager facade keeps array state.

A `Variable` holds one value (an array or a pytree of arrays) in `.value`, a
collection name (`kind`) and free-form metadata (logical sharding axes,
pipeline stage, ...). Collections come from the class: `Parameter` is
`"parameters"`, `Buffer` is `"buffers"`; a user collection is a subclass with
its own `default_kind`.
"""

from __future__ import annotations

from typing import Any

import jax

from .._scope import ambient
from .._scope.init_placement import placed
from .._sharding.rules import Sharding, annotation_axes
from . import structure
from .arraylike import ArrayLike
from .static import immutable


def _new_like(cls: type, value: Any, kind: str, metadata: dict) -> Variable:
    """A Variable of class `cls` built without running `__init__` (pytree unflatten, bind)."""
    var = object.__new__(cls)
    object.__setattr__(var, "_value", value)
    object.__setattr__(var, "kind", kind)
    object.__setattr__(var, "metadata", dict(metadata))
    return var


def _flatten_variable(var: Variable):
    return (var._value,), (type(var), var.kind, structure.freeze_metadata(var.metadata))


def _unflatten_variable(aux, children):
    cls, kind, meta = aux
    return _new_like(cls, children[0], kind, {k: structure.thaw(v) for k, v in meta})


def _immutable_metadata(owner: type, metadata: dict) -> dict:
    """`metadata` with its list, dict and set values stored immutable (see `static`)."""
    return {
        k: immutable(v, f"{owner.__name__} metadata {k!r}", f"set it with `variable.set_metadata({k}=new)`")
        for k, v in metadata.items()
    }


def _stamped(metadata: dict) -> dict:
    """`metadata` with the pipeline stage of the innermost `spx.assign_stage` block added (an
    explicit `stage=` wins)."""
    stages = ambient.current().stages
    if not stages or "stage" in metadata:
        return metadata
    current, total = stages[-1]
    return {**metadata, "stage": current, "stages": total}


def register_variable_class(cls: type) -> None:
    """Register a Variable class as a JAX pytree (one leaf subtree: its value)."""
    jax.tree_util.register_pytree_node(cls, _flatten_variable, _unflatten_variable)


class Variable(ArrayLike):
    """A mutable cell holding an array (or pytree of arrays) plus its collection and metadata.

    Args:
        value: the initial value.
        kind: the collection name; defaults to the class's `default_kind`.
        **metadata: free-form, hashable annotations (e.g. `axes=("EMBED", "MLP")`,
            `stage=1`), readable as attributes (`var.axes`).
    """

    __slots__ = ("_value", "kind", "metadata")
    default_kind: str = "buffers"  # as the seed library: a plain Variable is not trained

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        register_variable_class(cls)

    def __init__(
        self,
        value: Any,
        *,
        kind: str | None = None,
        dtype: Any = None,
        sharding: Any = None,
        axis_names: Any = None,
        metadata: dict | None = None,
        **more: Any,
    ):
        """`sharding=` / `axis_names=` (logical names, one per axis) are stored as `axes`
        metadata; `dtype=` casts the value; `metadata=` is a dict of more entries. Inside
        `spx.variable_init_placement(hook)` the value is what the hook returns."""
        if isinstance(value, Variable):
            value = value.value
        if dtype is not None:
            value = jax.numpy.asarray(value, dtype)
        metadata = {**(metadata or {}), **more}
        names = sharding if sharding is not None else axis_names
        if names is not None:
            metadata["axes"] = annotation_axes(type(self).__name__, names)
        value = placed(value, metadata, names is not None)
        object.__setattr__(self, "_value", value)
        object.__setattr__(self, "kind", kind if kind is not None else type(self).default_kind)
        object.__setattr__(self, "metadata", _stamped(_immutable_metadata(type(self), metadata)))
        if not isinstance(self.kind, str):
            raise TypeError(f"{type(self).__name__}: kind must be a str, received {self.kind!r}.")

    @property
    def value(self) -> Any:
        """The held value."""
        return self._value

    @value.setter
    def value(self, new: Any) -> None:
        set_value(self, new)

    def set_metadata(self, **metadata: Any) -> None:
        """Add or replace metadata entries (a structural change: jitted callers retrace)."""
        self.metadata.update(_immutable_metadata(type(self), metadata))
        structure.bump()

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "value":
            set_value(self, value)
        elif name == "kind":
            object.__setattr__(self, "kind", value)
            structure.bump()
        else:
            raise AttributeError(
                f"{type(self).__name__}: cannot set attribute {name!r}; "
                f"use `.value = ...` for the value or `.set_metadata({name}=...)` for metadata."
            )

    def __getattr__(self, name: str) -> Any:
        # Only reached when normal lookup fails: expose metadata entries as attributes.
        try:
            return object.__getattribute__(self, "metadata")[name]
        except (KeyError, AttributeError):
            raise AttributeError(f"{type(self).__name__} has no attribute or metadata {name!r}") from None

    @property
    def axis_names(self) -> tuple | None:
        """The logical axis names (`axes` metadata), or None."""
        return self.metadata.get("axes")

    @property
    def sharding(self) -> Sharding | None:
        """The `axes` metadata as an `spx.Sharding`, or None."""
        axes = self.metadata.get("axes")
        return None if axes is None else Sharding(axis_names=axes)

    @property
    def shape(self) -> tuple[int, ...]:
        return self._value.shape

    @property
    def dtype(self):
        return self._value.dtype

    @property
    def ndim(self) -> int:
        return self._value.ndim

    @property
    def size(self) -> int:
        return self._value.size

    def __repr__(self) -> str:
        extra = "".join(f", {k}={v!r}" for k, v in self.metadata.items())
        kind = "" if self.kind == type(self).default_kind else f", kind={self.kind!r}"
        return f"{type(self).__name__}({_short(self._value)}{kind}{extra})"


class Parameter(Variable):
    """A trainable array: collection `"parameters"`."""

    __slots__ = ()
    default_kind = "parameters"


class Buffer(Variable):
    """A non-trainable array the model updates itself (running statistics): collection `"buffers"`."""

    __slots__ = ()
    default_kind = "buffers"


def _short(value: Any) -> str:
    """`float32[4,8]` for arrays, a compact form for pytrees."""
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype}[{','.join(map(str, value.shape))}]"
    leaves = jax.tree.leaves(value)
    if not leaves:
        return repr(value)
    return f"<pytree of {len(leaves)} leaves>"


register_variable_class(Variable)

#: Fast setter of a Variable's value (the slot's descriptor), for write-back loops.
set_value = Variable.__dict__["_value"].__set__
