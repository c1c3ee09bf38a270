"""Error types of the eager facade."""

from __future__ import annotations


class IllegalMutationError(RuntimeError):
    """A transform's function wrote a Variable that its `mutable=` selector does not allow."""


class StructureChangeError(RuntimeError):
    """A transform's function added, removed or replaced a sub-module or Variable while traced."""
