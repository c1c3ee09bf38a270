"""The identity of a traced cell program, before it is lowered.

Lowering a cell to StableHLO costs far more than tracing it, and the same stage
program often runs on several ranks. `jaxpr_key` turns a traced program into a
hashable key derived from the program itself, so that a program already lowered
(on any devices) is recognised without lowering it again:

* every equation: its primitive, its operands (numbered by binding order),
  the avals of its results (shape, dtype, weak type, sharding type) and its
  parameters, nested jaxprs included with their constants;
* every constant and literal by its value: dtype, shape and a digest of its
  bytes (so `0.0` and `-0.0` differ, and a closure's array is read, not named;
  a typed PRNG key by its implementation and key data);
* floats by their exact bits, ints and bools with their type;
* a sharding by its layout with each device named by its position among the
  cell's devices (the same program on another rank's devices keys the same);
* a callable or any other object whose value cannot be read (a custom rule, a
  host function) by identity: the key holds the object, so its id cannot be
  reused while the key lives. Such programs are shared only with themselves.

Programs with side effects (host callbacks, ordered effects) get no key: the
compiler identifies those from their lowering, where the executable's own list
of host functions is visible.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
from typing import Any

import jax
import numpy as np
from jax import Array
from jax.sharding import Mesh, NamedSharding, Sharding

from .._trace import jax_private as jex_core


class Held:
    """An object in a key by identity; the key holds it, so its id is not reused while the key lives."""

    __slots__ = ("obj",)

    def __init__(self, obj):
        self.obj = obj

    def __eq__(self, other) -> bool:
        return isinstance(other, Held) and other.obj is self.obj

    def __hash__(self) -> int:
        return id(self.obj)


class _Unkeyable(Exception):
    """Raised inside `jaxpr_key` when a program has side effects."""


def _array_key(value) -> Any:
    """An array's dtype, shape and bytes (a typed key: its impl and key data); by identity where
    its value cannot be read in this process."""
    if isinstance(value, Array) and jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
        if jax.dtypes.issubdtype(value.dtype, jax.dtypes.prng_key):  # a typed key: its impl and data
            return ("key", value.dtype, _array_key(jax.random.key_data(value)))
        return Held(value)  # another extended dtype: by identity
    try:
        array = np.asarray(value)
    except (TypeError, ValueError, RuntimeError):  # not readable here (e.g. spans other processes)
        return Held(value)
    return ("array", array.dtype.str, array.shape, hashlib.sha256(array.tobytes()).hexdigest())


def _value_key(value: Any, position: dict, layout_key) -> Any:
    """A hashable key of a parameter, constant or literal value (see the module docstring)."""
    if value is None or isinstance(value, (str, bytes)):
        return value
    if isinstance(value, (bool, int)):
        return (type(value).__name__, value)
    if isinstance(value, float):
        return ("float", value.hex())
    if isinstance(value, complex):
        return ("complex", value.real.hex(), value.imag.hex())
    if isinstance(value, (tuple, list)):
        keys = tuple(_value_key(v, position, layout_key) for v in value)
        fields = getattr(type(value), "_fields", None)  # a NamedTuple: its type and fields
        return (Held(type(value)), fields, keys) if fields is not None else (type(value).__name__, keys)
    if isinstance(value, (dict, frozenset, set)):
        items = value.items() if isinstance(value, dict) else ((v, None) for v in value)
        return (
            type(value).__name__,
            frozenset(
                (_value_key(k, position, layout_key), _value_key(v, position, layout_key)) for k, v in items
            ),
        )
    if isinstance(value, jex_core.ClosedJaxpr):
        return ("closed", _jaxpr(value.jaxpr, value.consts, position, layout_key))
    if isinstance(value, jex_core.Jaxpr):
        return ("open", _jaxpr(value, (), position, layout_key))
    if isinstance(value, (np.ndarray, np.generic, Array)):
        return _array_key(value)
    if isinstance(value, (enum.Enum, np.dtype)):
        return (Held(type(value)), value)
    if isinstance(value, Sharding):
        concrete = isinstance(value, NamedSharding) and isinstance(value.mesh, Mesh)
        if concrete and all(d in position for d in value.mesh.devices.flat):
            return layout_key(value, position)
        return ("sharding", value)  # its own equality: the same (abstract or concrete) mesh and layout
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        fields = tuple(
            (f.name, _value_key(getattr(value, f.name), position, layout_key))
            for f in dataclasses.fields(value)
        )
        return (Held(type(value)), fields)
    return Held(value)


def _jaxpr(jaxpr, consts, position: dict, layout_key) -> tuple:
    """The structure of `jaxpr` with its constants' values; operands are numbered in binding order."""
    if jaxpr.effects:
        raise _Unkeyable
    ids: dict = {}

    def bind(v) -> Any:
        if isinstance(v, jex_core.DropVar):
            return ("drop", v.aval)
        ids[v] = len(ids)
        return v.aval

    def operand(a) -> Any:
        if isinstance(a, jex_core.Literal):
            return ("literal", _value_key(a.val, position, layout_key), a.aval)
        return ids[a]

    head = (
        tuple(bind(v) for v in jaxpr.constvars),
        tuple(_value_key(c, position, layout_key) for c in consts),
        tuple(bind(v) for v in jaxpr.invars),
    )
    eqns = []
    for e in jaxpr.eqns:
        if e.effects:
            raise _Unkeyable
        ins = tuple(operand(a) for a in e.invars)
        params = tuple(sorted((k, _value_key(v, position, layout_key)) for k, v in e.params.items()))
        eqns.append((Held(e.primitive), ins, params, tuple(bind(v) for v in e.outvars)))
    return head, tuple(eqns), tuple(operand(a) for a in jaxpr.outvars)


def jaxpr_key(closed_jaxpr, position: dict, layout_key) -> tuple | None:
    """The key of a traced program (a `ClosedJaxpr`), its devices named by `position`; None for a
    program with side effects. `layout_key(sharding, position)` keys a sharding."""
    try:
        return _jaxpr(closed_jaxpr.jaxpr, closed_jaxpr.consts, position, layout_key)
    except _Unkeyable:
        return None


def jaxpr_size(jaxpr) -> int:
    """The equations of `jaxpr` (a `Jaxpr` or `ClosedJaxpr`) and of the jaxprs in their parameters."""
    inner = getattr(jaxpr, "jaxpr", jaxpr)
    return sum(1 + sum(jaxpr_size(j) for j in _jaxprs(e.params.values())) for e in inner.eqns)


def _jaxprs(values):
    for value in values:
        if isinstance(value, (jex_core.ClosedJaxpr, jex_core.Jaxpr)):
            yield value
        elif isinstance(value, (tuple, list)):
            yield from _jaxprs(value)
