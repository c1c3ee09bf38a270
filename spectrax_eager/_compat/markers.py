"""Wrappers that say how a module attribute takes part in the structure: `Static` (by value) and
`Opaque` (by identity). Every non-array attribute is already static; these make the intent explicit
in code written for the seed library and allow objects that cannot be hashed by value."""

from __future__ import annotations

import dataclasses
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class Static(Generic[T]):
    """A hyperparameter held as a static attribute, compared by value (it must be hashable):
    `self.activation = spx.Static("gelu")`, read as `self.activation.value`. Changing it retraces."""

    value: T


class Opaque(Generic[T]):
    """Any object held as a static attribute, compared by identity (its content is never hashed or
    traversed; a compiled program sees the object it traced with). Read it as `.value`."""

    __slots__ = ("value",)

    def __init__(self, value: T):
        self.value = value

    def __repr__(self) -> str:
        return f"Opaque({self.value!r})"
