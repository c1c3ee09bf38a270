"""Error types of the eager facade."""

from __future__ import annotations


class IllegalMutationError(RuntimeError):
    """A transform's function wrote a Variable that its `mutable=` selector does not allow."""


class StructureChangeError(RuntimeError):
    """A transform's function added, removed or replaced a sub-module or Variable while traced."""


class CyclicGraphError(ValueError):
    """A module is reachable from itself (a sub-module refers back to an ancestor)."""


class SelectorError(TypeError):
    """A value given where a selector is expected is not one (see `spx.as_selector`)."""


class StaticEditError(TypeError):
    """An in-place edit of a module's static list, dict or set (or a Variable's metadata container).

    They are stored immutable; assign a new value to the attribute instead.
    """
