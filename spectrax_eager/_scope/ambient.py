"""The facade's ambient state: one immutable record held in one context variable.

A `with` block that sets something for the code it calls — `with spx.seed(0):`,
`with logical_axis_rules(...)` (or a `PartitionManager`), `with spx.scope(...)`,
a module's `policy` while it runs, `variable_init_placement`, `lazy_init`,
`assign_stage`, `with mesh:` of a pipeline mesh, the `Module.sow` sink of an `spx.jit` trace, the call hooks of
`spx.summary` and the stage markers of `spx.run` — replaces one field of the
record for the block and restores that field when the block ends. Nothing else
in the facade keeps ambient state. The record is a `contextvars.ContextVar`'s
value, so it belongs to one thread (and one asyncio task): a thread starts with
the empty record.
"""

from __future__ import annotations

import contextvars
from typing import Any, NamedTuple


class Ambient(NamedTuple):
    """What the enclosing blocks have set; stacks hold the innermost entry last."""

    rngs: tuple = ()  # the `Rngs` of `with spx.seed(...)` / `with rngs:` blocks
    rules: tuple = ()  # `RulesBlock`s of `logical_axis_rules` / `PartitionManager` blocks
    latest_manager: Any = None  # the `PartitionManager` made last
    frames: tuple = ()  # the `{name: value}` dicts of `spx.scope` blocks
    policy: Any = None  # the `spx.Policy` of the innermost running module that has one
    placement: Any = None  # the hook of the innermost `variable_init_placement` block
    lazy_init: bool = False  # inside `spx.lazy_init()`
    materializing: bool = False  # inside `Module.sequential_init` / `materialize`
    stages: tuple = ()  # `(current, total)` of `assign_stage` blocks
    mesh: Any = None  # the pipeline mesh of the innermost `with mesh:` (JAX's context mesh left unset)
    sow_sink: dict | None = None  # what `Module.sow` stores while `spx.jit` traces
    call_hooks: tuple = ()  # `hook(module, output)` after every module call (inspection)
    output_transforms: tuple = ()  # `fn(module, output) -> output` after every module call


_AMBIENT: contextvars.ContextVar[Ambient] = contextvars.ContextVar("spectrax_eager", default=Ambient())
_INDEX = {name: k for k, name in enumerate(Ambient._fields)}
_record = tuple.__new__  # `Ambient` from a tuple of all its fields (what `Ambient._make` does)

#: The record now (`ambient.current().policy`); one context-variable read.
current = _AMBIENT.get


def _set(field: str, value: Any) -> None:
    record = _AMBIENT.get()
    k = _INDEX[field]
    _AMBIENT.set(_record(Ambient, record[:k] + (value,) + record[k + 1 :]))


def replace(**fields: Any) -> None:
    """Set `fields` for the rest of this context (not tied to a block)."""
    for field, value in fields.items():
        _set(field, value)


class setting:
    """`with setting(field, value):` — `field` is `value` inside the block; afterwards it has its
    value from before the block (whatever the block did to the other fields)."""

    __slots__ = ("field", "value", "before")

    def __init__(self, field: str, value: Any):
        self.field, self.value = field, value

    def __enter__(self) -> None:
        self.before = getattr(_AMBIENT.get(), self.field)
        _set(self.field, self.value)

    def __exit__(self, *exc: Any) -> None:
        _set(self.field, self.before)


def push(field: str, entry: Any) -> None:
    """Append `entry` to the stack `field`."""
    _set(field, (*getattr(_AMBIENT.get(), field), entry))


def pop(field: str, entry: Any) -> None:
    """Remove the last occurrence of `entry` (by identity) from the stack `field`; a
    `ValueError` when it is not there (a block left in another thread than it was entered in)."""
    stack = getattr(_AMBIENT.get(), field)
    for k in range(len(stack) - 1, -1, -1):
        if stack[k] is entry:
            _set(field, stack[:k] + stack[k + 1 :])
            return
    raise ValueError(f"{entry!r} is not on the ambient {field!r} stack of this thread.")


class pushing:
    """`with pushing(field, entry):` — `entry` is on the stack `field` for the duration of the block."""

    __slots__ = ("field", "entry")

    def __init__(self, field: str, entry: Any):
        self.field, self.entry = field, entry

    def __enter__(self) -> None:
        push(self.field, self.entry)

    def __exit__(self, *exc: Any) -> None:
        pop(self.field, self.entry)
