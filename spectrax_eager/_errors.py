"""Error types of the eager facade."""

from __future__ import annotations


class SpecTraxError(Exception):
    """Base of the facade's own errors (each also derives from the builtin error it refines)."""


class IllegalMutationError(SpecTraxError, RuntimeError):
    """A transform's function wrote a Variable that its `mutable=` selector does not allow."""


class StructureChangeError(SpecTraxError, RuntimeError):
    """A transform's function added, removed or replaced a sub-module or Variable while traced."""


class CyclicGraphError(SpecTraxError, ValueError):
    """A module is reachable from itself (a sub-module refers back to an ancestor)."""


class SelectorError(SpecTraxError, TypeError):
    """A value given where a selector is expected is not one (see `spx.as_selector`)."""


class StaticEditError(SpecTraxError, TypeError):
    """An in-place edit of a module's static list, dict or set (or a Variable's metadata container).

    They are stored immutable; assign a new value to the attribute instead.
    """


#: A lazy layer first called inside a transform is a structure change (call it once eagerly first).
LazyInitUnderTransformError = StructureChangeError
