"""Containers: Sequential, ModuleList, ModuleDict, PipelineSequential, ParameterList,
StackedModuleList.

Children are stored as attributes named `"0"`, `"1"`, ... (or the dict keys),
so they are ordinary graph nodes with readable paths (`blocks.3.attn.q.weight`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

import jax
import jax.numpy as jnp

from .._graph.export import bind, export, update
from .._graph.module import Module
from .._graph.state import State
from .._graph.variable import Parameter, Variable
from .._graph.walk import iter_variables


class _Numbered(Module):
    """Children stored as attributes `"0"`, `"1"`, ...: `len`, iteration and `[i]` as for a list;
    each subclass's `append` checks (or wraps) what it takes."""

    def __init__(self, items: Iterable[Any] = ()):
        for item in items:
            self.append(item)

    def __len__(self) -> int:
        return sum(1 for k in self.__dict__ if k.isdigit())

    def __getitem__(self, i: int | slice) -> Any:
        n = len(self)
        if isinstance(i, slice):
            return [self.__dict__[str(j)] for j in range(n)[i]]
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} out of range for length {n}.")
        return self.__dict__[str(i % n)]

    def __iter__(self) -> Iterator[Any]:
        d = self.__dict__
        return (d[str(j)] for j in range(len(self)))


class ModuleList(_Numbered):
    """An indexable, appendable list of modules; `len`, iteration and `[i]` as for a list."""

    def append(self, module: Module) -> None:
        """Add `module` at the end (a structural change)."""
        if not isinstance(module, Module):
            raise TypeError(
                f"{type(self).__name__}.append: expected an spx.Module, received {type(module).__name__}."
            )
        setattr(self, str(len(self)), module)

    def __setitem__(self, i: int, module: Module) -> None:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} out of range for length {n}.")
        setattr(self, str(i % n), module)


class Sequential(ModuleList):
    """Calls its layers in order: `Sequential(a, b, c)(x) == c(b(a(x)))`."""

    def __init__(self, *layers: Module):
        super().__init__(layers)

    def forward(self, x: Any) -> Any:
        for layer in self:
            x = layer(x)
        return x


class PipelineSequential(ModuleList):
    """Pipeline stages run in order; eagerly (and under `spx.jit`) it behaves like `Sequential`.

    `stages` lists the stage modules; the MPMD runtime runs each on its own rank.
    """

    def __init__(self, *stages: Module):
        super().__init__(stages)

    @property
    def stages(self) -> list[Module]:
        return list(self)

    def forward(self, x: Any) -> Any:
        for stage in self:
            x = stage(x)
        return x


class ModuleDict(Module):
    """A string-keyed mapping of modules; `[key]`, `keys()`, `items()`, iteration as a dict."""

    def __init__(self, items: Mapping[str, Module] | None = None):
        for k, m in (items or {}).items():
            self[k] = m

    def __setitem__(self, key: str, module: Module) -> None:
        if not isinstance(key, str) or not key.isidentifier():
            raise ValueError(
                f"ModuleDict: keys must be identifier strings (they become paths), received {key!r}."
            )
        if not isinstance(module, Module):
            raise TypeError(f"ModuleDict[{key!r}]: expected an spx.Module, received {type(module).__name__}.")
        setattr(self, key, module)

    def __getitem__(self, key: str) -> Module:
        value = self.__dict__.get(key)
        if not isinstance(value, Module):
            raise KeyError(key)
        return value

    def keys(self) -> list[str]:
        return [k for k, v in self.__dict__.items() if isinstance(v, Module)]

    def items(self) -> list[tuple[str, Module]]:
        return [(k, self.__dict__[k]) for k in self.keys()]

    def values(self) -> list[Module]:
        return [self.__dict__[k] for k in self.keys()]

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())

    def __len__(self) -> int:
        return len(self.keys())


class ParameterList(_Numbered):
    """An indexable, appendable list of Parameters (arrays are wrapped); paths `"0"`, `"1"`, ..."""

    def append(self, value: Any) -> None:
        """Add `value` (an array or a Variable) at the end (a structural change)."""
        if not isinstance(value, Variable):
            if not isinstance(value, jax.Array):
                raise TypeError(
                    f"ParameterList.append: expected an array or an spx.Variable, received {type(value).__name__}."
                )
            value = Parameter(value)
        setattr(self, str(len(self)), value)


class StackedModuleList(Module):
    """Identical modules stored as one module whose variables have a leading layer axis, run in
    order by `lax.scan`: `StackedModuleList([Block(...) for _ in range(n)])(x)` equals calling the
    blocks one after another, and compiles one block body however deep the stack is.

    The first module becomes the stacked one (its variables take the stacked values);
    the others are only read. Every module must have the same structure. A variable that is the same object in
    every module (a shared `spx.Rngs` stream) is kept once and carried through the
    scan, so its writes (drawn dropout keys) persist; every other variable is stacked
    (its `axes` metadata gains a leading None) and is read-only inside the call.
    `stack[i]` is a copy of layer `i`, for inspection.
    """

    def __init__(self, items: Iterable[Module] = ()):
        modules = list(items)
        if not modules or not all(isinstance(m, Module) for m in modules):
            raise TypeError("StackedModuleList: expected a non-empty list of spx.Module instances.")
        graphdef = export(modules[0])[0]
        for i, m in enumerate(modules[1:], start=1):
            if export(m)[0] != graphdef:
                raise ValueError(
                    f"StackedModuleList: module {i} ({type(m).__name__}) differs in structure from module 0 "
                    f"({type(modules[0]).__name__}); stacked modules must be built identically."
                )
        per_module = [list(iter_variables(m)) for m in modules]
        stacked = []
        for j, (path, var) in enumerate(per_module[0]):
            same = [vs[j][1] is var for vs in per_module]
            if all(same):
                continue
            if any(same[1:]):
                raise ValueError(
                    f"StackedModuleList: variable {path!r} is shared by some modules but not all; share it "
                    "with every module (or none)."
                )
            var.value = jnp.stack([vs[j][1].value for vs in per_module])
            if "axes" in var.metadata:
                var.set_metadata(axes=(None, *var.metadata["axes"]))
            stacked.append(path)
        self.layers = modules[0]
        self.length = len(modules)
        self.stacked_paths = tuple(stacked)

    def __len__(self) -> int:
        return self.length

    def _split(self) -> tuple[Any, State, State]:
        graphdef, state = export(self.layers)
        flat = state.flatten()
        paths = set(self.stacked_paths)
        stacked = State.from_flat({k: v for k, v in flat.items() if k[1] in paths})
        rest = State.from_flat({k: v for k, v in flat.items() if k[1] not in paths})
        return graphdef, stacked, rest

    def __getitem__(self, i: int) -> Module:
        if not -self.length <= i < self.length:
            raise IndexError(f"StackedModuleList index {i} out of range for length {self.length}.")
        graphdef, stacked, rest = self._split()
        return bind(graphdef, stacked.map(lambda a: a[i]), rest)

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        """`x` through every layer in order; other arguments go to each layer unchanged."""
        graphdef, stacked, rest = self._split()
        written: set = set()  # shared variables the layer body writes (found while tracing it)

        def body(carry: tuple[Any, State], layer_state: State) -> tuple[tuple[Any, State], None]:
            h, shared = carry
            layer = bind(graphdef, layer_state, shared)
            h = layer(h, *args, **kwargs)
            after = export(layer)[1].flatten()
            for key, value in layer_state.flatten().items():
                if after[key] is not value:
                    raise ValueError(
                        f"StackedModuleList: a layer wrote the stacked variable {key[0]}/{key[1]}; "
                        "stacked variables are read-only inside the scan (keep running state in a "
                        "ModuleList instead)."
                    )
            before = shared.flatten()
            written.update(k for k, v in before.items() if after[k] is not v)
            return (h, State.from_flat({k: after[k] for k in before})), None

        (y, rest), _ = jax.lax.scan(body, (x, rest), stacked)
        if written:
            update(self.layers, State.from_flat({k: v for k, v in rest.flatten().items() if k in written}))
        return y
