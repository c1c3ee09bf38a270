"""Containers: Sequential, ModuleList, ModuleDict, PipelineSequential.

Children are stored as attributes named `"0"`, `"1"`, ... (or the dict keys),
so they are ordinary graph nodes with readable paths (`blocks.3.attn.q.weight`).
"""

from __future__ import annotations

from typing import Any, Iterable, Iterator, Mapping

from .._module import Module


class ModuleList(Module):
    """An indexable, appendable list of modules; `len`, iteration and `[i]` as for a list."""

    def __init__(self, modules: Iterable[Module] = ()):
        for m in modules:
            self.append(m)

    def append(self, module: Module) -> None:
        """Add `module` at the end (a structural change)."""
        if not isinstance(module, Module):
            raise TypeError(
                f"{type(self).__name__}.append: expected an spx.Module, received {type(module).__name__}."
            )
        setattr(self, str(len(self)), module)

    def __len__(self) -> int:
        return sum(1 for k in self.__dict__ if k.isdigit())

    def __getitem__(self, i: int | slice) -> Any:
        n = len(self)
        if isinstance(i, slice):
            return [self.__dict__[str(j)] for j in range(n)[i]]
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} out of range for length {n}.")
        return self.__dict__[str(i % n)]

    def __setitem__(self, i: int, module: Module) -> None:
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"{type(self).__name__} index {i} out of range for length {n}.")
        setattr(self, str(i % n), module)

    def __iter__(self) -> Iterator[Module]:
        d = self.__dict__
        return (d[str(j)] for j in range(len(self)))


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

    def __init__(self, modules: Mapping[str, Module] | None = None):
        for k, m in (modules or {}).items():
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
