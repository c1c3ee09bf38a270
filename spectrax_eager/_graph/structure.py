"""The module graph's structure: a global structure epoch, hashable static values, GraphDef.

Every structural change (setting a Module attribute, changing a Variable's
kind or metadata) bumps `epoch`; cached flatten plans carry the epoch they were
built at and are rebuilt when it moved. Value writes (`var.value = x`) do not
bump it, so the hot path never re-walks the graph.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# Not ambient state: a process-wide stamp that every cached plan is checked against (a change
# made in one thread must invalidate the plans every thread uses).
epoch: int = 0


def bump() -> None:
    """Mark that some module graph changed structure: cached plans are rebuilt on next use."""
    global epoch
    epoch += 1


class Frozen:
    """A hashable stand-in for an unhashable static value (list, dict, set) that keeps the original."""

    __slots__ = ("value", "key")

    def __init__(self, value: Any, key: Any):
        self.value = value
        self.key = key

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, Frozen) and self.key == other.key

    def __repr__(self) -> str:
        return repr(self.value)


def _key(value: Any, where: str) -> Any:
    if isinstance(value, list | tuple):
        return (type(value).__name__, tuple(_key(v, where) for v in value))
    if isinstance(value, dict):
        return ("dict", tuple((k, _key(v, where)) for k, v in value.items()))
    if isinstance(value, set | frozenset):
        return ("set", frozenset(_key(v, where) for v in value))
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{where}: static (non-array) values must be hashable so the module structure can "
            f"key the jit cache; received {type(value).__name__}. Store arrays in a "
            "spx.Parameter/spx.Buffer, other values as tuples/ints/strings."
        ) from None
    return value


def freeze_static(value: Any, where: str) -> Any:
    """`value` itself when hashable, else a `Frozen` wrapper comparing by content."""
    try:
        hash(value)
        return value
    except TypeError:
        return Frozen(value, _key(value, where))


def thaw(value: Any) -> Any:
    """Inverse of `freeze_static`."""
    return value.value if isinstance(value, Frozen) else value


def freeze_metadata(metadata: dict) -> tuple:
    """Metadata as a hashable, ordered tuple of `(name, frozen value)`."""
    return tuple((k, freeze_static(v, f"metadata {k!r}")) for k, v in sorted(metadata.items()))


class GraphDef:
    """The immutable, hashable structure of one or more module graphs (no array values).

    Holds the classes, static attributes, child names, Variable classes,
    collections and metadata, and shared-reference links. Two graphs with the
    same structure compare equal whatever their values; this is the jit cache key.
    """

    __slots__ = ("specs", "num_variables", "_hash")

    def __init__(self, specs: tuple, num_variables: int):
        object.__setattr__(self, "specs", specs)
        object.__setattr__(self, "num_variables", num_variables)
        object.__setattr__(self, "_hash", hash(specs))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("GraphDef is immutable.")

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: Any) -> bool:
        return self is other or (
            isinstance(other, GraphDef) and self._hash == other._hash and self.specs == other.specs
        )

    def __repr__(self) -> str:
        names = ", ".join(s[1].__name__ if s[0] == "M" else s[0] for s in self.specs)
        return f"GraphDef({names}; {self.num_variables} variables)"


class VarInfo(NamedTuple):
    """What a selector sees of a variable besides its value."""

    path: str
    kind: str
    type: type
    metadata: tuple
    owners: tuple  # classes of the modules on the path from the root, outermost first
