"""`State`: a model's values as `{collection: {path: value}}`, an immutable mapping and a pytree;
`state_of` makes one from a plan."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import jax

from .hooks import required_positional
from .module import Plan
from .selector import as_selector, info_variable
from .structure import VarInfo
from .variable import Buffer, Parameter, Variable

_KIND_CLASS = {"parameters": Parameter, "buffers": Buffer}


class State(Mapping):
    """An immutable mapping `{collection: {path: value}}`, and a pytree over the values.

    Two States with the same variables (paths, classes, collections, metadata)
    have the same pytree structure, so `jax.tree.map(f, params, grads)` and
    optax work on them directly.
    A pipelined `spx.run`'s gradients know each entry's rank: `grads[r]` is rank `r`'s State.
    """

    __slots__ = ("_infos", "_values", "_ranks")

    def __init__(
        self,
        data: Mapping[str, Mapping[str, Any]] | tuple = (),
        values: list | None = None,
        ranks: tuple[int | None, ...] | None = None,
    ):
        """`State({collection: {path: value}})`; (`State(infos, values, ranks)` is the internal
        form, `ranks` the pipeline rank of each entry, or None)."""
        self._ranks = None if ranks is None else tuple(ranks)
        if values is not None:
            self._infos = tuple(data)
            self._values = list(values)
            return
        if not isinstance(data, Mapping | tuple) or (isinstance(data, tuple) and data):
            raise TypeError(
                "State: expected a mapping {collection: {path: value}}, e.g. "
                f"State({{'parameters': {{'fc.weight': w}}}}); received {type(data).__name__}."
            )
        infos, vals = [], []
        for kind, entries in dict(data).items():
            if not isinstance(kind, str) or not isinstance(entries, Mapping):
                raise TypeError(
                    f"State: each entry must be collection name -> {{path: value}}; received {kind!r}: "
                    f"{type(entries).__name__}."
                )
            for path, value in entries.items():
                infos.append(_new_info(kind, path))
                vals.append(value)
        _check_unique(infos, "State")
        self._infos = tuple(infos)
        self._values = vals

    @classmethod
    def from_flat(cls, flat: Mapping[tuple[str, str], Any]) -> State:
        """The State of `{(collection, path): value}` (the inverse of `flatten()`)."""
        infos, vals = [], []
        for key, value in dict(flat).items():
            if not (isinstance(key, tuple) and len(key) == 2 and all(isinstance(k, str) for k in key)):
                raise TypeError(f"State.from_flat: keys must be (collection, path) pairs; received {key!r}.")
            infos.append(_new_info(*key))
            vals.append(value)
        _check_unique(infos, "State.from_flat")
        return cls(tuple(infos), vals)

    def __getitem__(self, collection: str | int) -> dict[str, Any] | State:
        """`state[collection]`: `{path: value}`; `state[rank]` (an int): that pipeline rank's State."""
        if isinstance(collection, int) and not isinstance(collection, bool):
            return _rank_part(self, collection)
        out = {i.path: v for i, v in zip(self._infos, self._values) if i.kind == collection}
        if not out:
            raise KeyError(f"State has no collection {collection!r}; it has {sorted(self)}.")
        return out

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys(i.kind for i in self._infos))

    def __len__(self) -> int:
        return len(set(i.kind for i in self._infos))

    def flat(self) -> dict[tuple[str, str], Any]:
        """`{(collection, path): value}`."""
        return {(i.kind, i.path): v for i, v in zip(self._infos, self._values)}

    def flatten(self) -> dict[tuple[str, str], Any]:
        """`{(collection, path): value}` in variable order; `State.from_flat` rebuilds a State."""
        return self.flat()

    def paths(self, collection: str | None = None) -> tuple[tuple[str, str], ...]:
        """`(collection, path)` of every entry (of one collection when given), in variable order."""
        return tuple((i.kind, i.path) for i in self._infos if collection is None or i.kind == collection)

    def items(self) -> list[tuple[str, str, Any]]:
        """`(collection, path, value)` of every entry, in variable order."""
        return [(i.kind, i.path, v) for i, v in zip(self._infos, self._values)]

    def collections(self) -> set[str]:
        """The collection names present."""
        return {i.kind for i in self._infos}

    def get(self, collection: str, path: str, default: Any = None) -> Any:
        """The value at `(collection, path)`, or `default`."""
        for i, v in zip(self._infos, self._values):
            if i.kind == collection and i.path == path:
                return v
        return default

    def map(
        self, fn: Callable[..., Any], *collections: str, with_path: bool | None = None, copy: bool = True
    ) -> State:
        """A State of the same entries holding `fn(value)`, or `fn(path, value)` when `with_path`
        (by default: when `fn` takes two required arguments). Given collections, only their
        entries are mapped; the others are kept as they are. (`copy` is accepted for code
        written for the seed library: a State never changes in place, so every method
        returns a new one.)"""
        if with_path is None:
            with_path = required_positional(fn) == 2
        values = [
            (fn(i.path, v) if with_path else fn(v)) if not collections or i.kind in collections else v
            for i, v in zip(self._infos, self._values)
        ]
        return State(self._infos, values)

    def set(self, *where: Any, copy: bool = True) -> State:
        """A copy with one entry holding a new value: `set(collection, path, value)` (adds the
        entry when absent), or `set(path, value)` with a dotted path or a `(collection, path)` pair."""
        if len(where) == 3:
            path, value = (where[0], where[1]), where[2]
        elif len(where) == 2:
            path, value = where
        else:
            raise TypeError("State.set: call set(collection, path, value) or set(path, value).")
        j = self._find(path, allow_new=isinstance(path, tuple))
        if j is None:
            kind, p = path
            return State((*self._infos, _new_info(kind, p)), [*self._values, value])
        values = list(self._values)
        values[j] = value
        return State(self._infos, values)

    def merge(self, other: State, *, copy: bool = True) -> State:
        """`overlay(other)`: `other`'s entries replace or join this State's."""
        return self.overlay(other)

    def copy(self) -> State:
        """A State of the same entries (values are shared; arrays are immutable)."""
        return State(self._infos, list(self._values))

    def overlay(self, other: State) -> State:
        """A copy where `other`'s entries replace this State's (same path) or are appended."""
        if not isinstance(other, State):
            raise TypeError(f"State.overlay: expected an spx.State, received {type(other).__name__}.")
        index = {i.path: j for j, i in enumerate(self._infos)}
        infos, values = list(self._infos), list(self._values)
        for info, value in zip(other._infos, other._values):
            j = index.get(info.path)
            if j is None:
                index[info.path] = len(infos)
                infos.append(info)
                values.append(value)
            elif infos[j].kind != info.kind:
                raise ValueError(
                    f"State.overlay: {info.path!r} is in collection {infos[j].kind!r} here but "
                    f"{info.kind!r} in other; a path names one variable of one collection."
                )
            else:
                values[j] = value
        return State(tuple(infos), values)

    def _find(self, path: str | tuple[str, str], allow_new: bool = False) -> int | None:
        if isinstance(path, tuple) and len(path) == 2:
            kind, p = path
            hit = [j for j, i in enumerate(self._infos) if i.path == p and i.kind == kind]
        elif isinstance(path, str):
            hit = [j for j, i in enumerate(self._infos) if i.path == path]
        else:
            raise TypeError(f"State: a path is a dotted str or a (collection, path) pair; received {path!r}.")
        if hit:
            return hit[0]
        if allow_new:
            return None
        raise KeyError(
            f"State has no entry {path!r}; its paths are {list(self.paths())[:8]}"
            f"{'...' if len(self._infos) > 8 else ''}. Pass (collection, path) to add one."
        )

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """A plain nested dict `{collection: {path: value}}`."""
        return {k: self[k] for k in self}

    raw = to_dict

    def filter(self, *selectors: Any, copy: bool = True) -> State:
        """The sub-State of the entries any of `selectors` matches (collection names, globs, ...)."""
        sel = as_selector(list(selectors) if len(selectors) != 1 else selectors[0])
        keep = [(i, v) for i, v in zip(self._infos, self._values) if sel.match(i, info_variable(i, v))]
        return State(tuple(i for i, _ in keep), [v for _, v in keep])

    def exclude(self, *selectors: Any, copy: bool = True) -> State:
        """The sub-State of the entries none of `selectors` matches."""
        sel = as_selector(list(selectors))
        keep = [(i, v) for i, v in zip(self._infos, self._values) if not sel.match(i, info_variable(i, v))]
        return State(tuple(i for i, _ in keep), [v for _, v in keep])

    def __repr__(self) -> str:
        lines = [f"  {i.kind}/{i.path}: {_short(v)}" for i, v in zip(self._infos, self._values)]
        return "State(\n" + "\n".join(lines) + "\n)" if lines else "State()"


def _new_info(kind: str, path: str) -> VarInfo:
    """The entry description of a value given by collection and path (not taken from a model)."""
    cls = _KIND_CLASS.get(kind, Variable)
    return VarInfo(path, kind, cls, (), ())


def _check_unique(infos: list[VarInfo], where: str) -> None:
    seen: dict[str, str] = {}
    for i in infos:
        if i.path in seen:
            raise ValueError(
                f"{where}: path {i.path!r} appears in collections {seen[i.path]!r} and {i.kind!r}; "
                "a path names one variable, so it belongs to one collection."
            )
        seen[i.path] = i.kind


def _rank_part(state: State, rank: int) -> State:
    """`state[rank]`: the State of the entries on pipeline rank `rank`, in `_seed_order`."""
    if state._ranks is None:
        raise KeyError(
            f"State[{rank}]: an int reads one pipeline rank's entries of the gradients a pipelined "
            "spx.run / spx.sxcall returned; this State has no pipeline ranks (it was made otherwise, "
            f"e.g. by jax.tree.map or a State method); index it by collection, one of {sorted(state)}."
        )
    picked = sorted(
        (k for k, r in enumerate(state._ranks) if r == rank), key=lambda k: _seed_order(state._infos[k])
    )
    if not picked:
        held = sorted({r for r in state._ranks if r is not None})
        raise KeyError(
            f"State[{rank}]: no entry lies on pipeline rank {rank}; the entries lie on ranks {held}."
        )
    return State(
        tuple(state._infos[k] for k in picked), [state._values[k] for k in picked], (rank,) * len(picked)
    )


def _seed_order(info: VarInfo) -> tuple:
    """`spectrax-lib`'s State order: by collection, then path component by component, names
    before numbers and numbers by value."""
    return tuple((c.isdigit(), int(c) if c.isdigit() else c) for c in (info.kind, *info.path.split(".")))


def _short(value: Any) -> str:
    if hasattr(value, "shape") and hasattr(value, "dtype"):
        return f"{value.dtype}[{','.join(map(str, value.shape))}]"
    return repr(value)


jax.tree_util.register_pytree_with_keys(
    State,
    lambda s: (
        [(jax.tree_util.GetAttrKey(f"{i.kind}/{i.path}"), v) for i, v in zip(s._infos, s._values)],
        s._infos,
    ),
    lambda infos, values: State(infos, list(values)),
    lambda s: (s._values, s._infos),
)


def state_of(plan: Plan, selected: tuple[bool, ...] | None = None, values: list | None = None) -> State:
    """The State of a single-root plan (optionally only the `selected` variables / given values)."""
    vals = [v._value for v in plan.vars] if values is None else values
    if selected is None:
        return State(plan.infos, vals)
    return State(
        tuple(i for i, s in zip(plan.infos, selected) if s), [v for v, s in zip(vals, selected) if s]
    )
