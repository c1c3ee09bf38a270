"""Inspection: parameter and byte counts, and a per-module summary table."""

from __future__ import annotations

from typing import Any

import jax

from . import _module
from ._lift import Split
from ._module import Module, _walk, plan_of
from ._rngs import Rngs, RngStream
from ._selector import mask


def _leaves(model: Module, select: Any) -> list:
    plan = plan_of(model)
    return [l for v, k in zip(plan.vars, mask(plan, select)) if k for l in jax.tree.leaves(v.value)]


def count_parameters(model: Module, select: Any = "parameters", *, collection: str | None = None) -> int:
    """Number of scalars in the selected variables (default: the `"parameters"` collection;
    `collection=` names one collection)."""
    return sum(int(l.size) for l in _leaves(model, select if collection is None else collection))


def count_bytes(model: Module, select: Any = "parameters", *, collection: str | None = None) -> int:
    """Bytes held by the selected variables (default: the `"parameters"` collection; `True`: all
    of them; `collection=` names one collection)."""
    chosen = select if collection is None else collection
    return sum(int(l.size) * l.dtype.itemsize for l in _leaves(model, chosen) if hasattr(l, "dtype"))


def summary(model: Module, *example_args: Any, **example_kwargs: Any) -> str:
    """A table of every sub-module called by `model(*example_args)`: path, class, output shape,
    and parameter count (its own subtree). Nothing is computed (`jax.eval_shape`)."""
    split = Split((model, *example_args), example_kwargs)
    static = split.static
    rows: list[tuple[str, str, str, int]] = []

    def pure(values, leaves):
        from ._lift import rebuild

        args, kwargs, roots, _ = rebuild(static, values, leaves)
        paths = {id(m): p for p, m in _walk((roots[0],)).modules}
        counts = {id(m): count_parameters(m) for _, m in _walk((roots[0],)).modules}

        def hook(mod, out):
            if isinstance(mod, Rngs | RngStream):  # key draws, not layers
                return
            shapes = ", ".join(
                f"{l.dtype}[{','.join(map(str, l.shape))}]"
                for l in jax.tree.leaves(out)
                if hasattr(l, "shape")
            )
            rows.append(
                (paths.get(id(mod), "?") or "(root)", type(mod).__name__, shapes, counts.get(id(mod), 0))
            )

        _module._call_hooks.append(hook)
        try:
            return args[0](*args[1:], **kwargs)
        finally:
            _module._call_hooks.remove(hook)

    jax.eval_shape(pure, split.values, split.leaves)
    rows.sort(key=lambda r: (r[0] != "(root)", r[0]))
    head = ("path", "module", "output", "params")
    table = [head] + [(p, c, s, f"{n:,}") for p, c, s, n in rows]
    widths = [max(len(r[i]) for r in table) for i in range(4)]
    line = "-+-".join("-" * w for w in widths)
    fmt = lambda r: " | ".join(x.ljust(w) for x, w in zip(r, widths))  # noqa: E731
    total = f"total: {count_parameters(model):,} parameters, {count_bytes(model, True):,} bytes"
    return "\n".join([fmt(head), line] + [fmt(r) for r in table[1:]] + [line, total])
