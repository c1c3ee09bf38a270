"""`spx.inspect`: what a model holds and what a call costs.

`tabulate` (modules in definition order with output shapes, parameter counts
and bytes), `display` (the module tree), `hlo_cost` (XLA's cost analysis of a
compiled call), and the counters `count_parameters`, `count_bytes`, `summary` (also `spx.` names).
"""

from __future__ import annotations

from typing import Any, Callable

import jax

from .._compat.paths import keep_names
from .._graph.export import tree_state
from .._graph.module import Module, _walk, plan_of
from .._graph.rngs import Rngs, RngStream
from .._graph.selector import mask
from .._scope import ambient
from .._transforms.lift import Split, rebuild


def _shapes(out: Any) -> str:
    return ", ".join(
        f"{l.dtype}[{','.join(map(str, l.shape))}]" for l in jax.tree.leaves(out) if hasattr(l, "shape")
    )


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]], total: str) -> str:
    table = [head, *rows]
    widths = [max(len(r[i]) for r in table) for i in range(len(head))]
    line = "-+-".join("-" * w for w in widths)
    fmt = lambda r: " | ".join(x.ljust(w) for x, w in zip(r, widths))  # noqa: E731
    return "\n".join([fmt(head), line, *map(fmt, rows), line, total])


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
        args, kwargs, roots, _ = rebuild(static, values, leaves)
        paths = {id(m): p for p, m in _walk((roots[0],)).modules}
        counts = {id(m): count_parameters(m) for _, m in _walk((roots[0],)).modules}

        def hook(mod, out):
            if isinstance(mod, Rngs | RngStream):  # key draws, not layers
                return
            rows.append(
                (
                    paths.get(id(mod), "?") or "(root)",
                    type(mod).__name__,
                    _shapes(out),
                    counts.get(id(mod), 0),
                )
            )

        with ambient.pushing("call_hooks", hook):
            return args[0](*args[1:], **kwargs)

    jax.eval_shape(pure, split.values, split.leaves)
    rows.sort(key=lambda r: (r[0] != "(root)", r[0]))
    total = f"total: {count_parameters(model):,} parameters, {count_bytes(model, True):,} bytes"
    return _table(("path", "module", "output", "params"), [(p, c, s, f"{n:,}") for p, c, s, n in rows], total)


def tabulate(model: Module, *inputs: Any, **kwargs: Any) -> str:
    """A table of `model` and its sub-modules in definition order: path, class, the output
    shape of their first call in `model(*inputs, **kwargs)` ("-" when not called), and the
    parameters and bytes they hold (their whole subtree). Nothing is computed (`jax.eval_shape`)."""
    if not isinstance(model, Module):
        raise TypeError(f"tabulate: expected an spx.Module, received {type(model).__name__}.")
    split = Split((model, *inputs), kwargs)
    static = split.static
    outputs: list[dict[int, str]] = [{}]

    def pure(values, leaves):
        args, kw, roots, _ = rebuild(static, values, leaves)
        index = {id(m): j for j, (_, m) in enumerate(_walk((roots[0],)).modules)}
        seen = outputs[0]

        def hook(mod, out):
            j = index.get(id(mod))
            if j is not None and j not in seen:
                seen[j] = _shapes(out)

        with ambient.pushing("call_hooks", hook):
            return args[0](*args[1:], **kw)

    jax.eval_shape(pure, split.values, split.leaves)
    rows = []
    for j, (path, mod) in enumerate(plan_of(model).modules):
        if isinstance(mod, Rngs | RngStream):  # key streams, not layers
            continue
        rows.append(
            (
                path or "(root)",
                type(mod).__name__,
                outputs[0].get(j, "-"),
                f"{count_parameters(mod):,}",
                f"{count_bytes(mod, True):,}",
            )
        )
    total = f"total: {count_parameters(model):,} parameters, {count_bytes(model, True):,} bytes"
    return _table(("path", "module", "output", "params", "bytes"), rows, total)


def display(model: Module) -> None:
    """Print the module tree (classes, static attributes, Variables with their shapes) and totals."""
    if not isinstance(model, Module):
        raise TypeError(f"display: expected an spx.Module, received {type(model).__name__}.")
    print(repr(model))
    print(f"total: {count_parameters(model):,} parameters, {count_bytes(model, True):,} bytes")


def hlo_cost(fn: Callable, *args: Any, **kwargs: Any) -> dict[str, float]:
    """XLA's cost analysis of `fn(*args, **kwargs)` compiled (modules may be arguments;
    `hlo_cost(model, x)` costs the call `model(x)`).

    Returns `{"flops", "bytes_accessed", "transcendentals"}` (0.0 where the backend
    reports nothing) plus every other figure the backend reports, under its own name.
    """
    if isinstance(fn, Module):  # a module's own call: its values are arguments, not constants
        fn, args = _call_module, (fn, *args)
    if not callable(fn):
        raise TypeError(f"hlo_cost: expected a function or a module, received {type(fn).__name__}.")
    split = Split(args, kwargs)
    static = split.static

    def pure(values, leaves):
        call_args, call_kwargs, _, _ = rebuild(static, values, leaves)
        return fn(*call_args, **call_kwargs)

    analysis = jax.jit(pure).lower(split.values, split.leaves).compile().cost_analysis()
    if isinstance(analysis, list | tuple):
        analysis = analysis[0] if analysis else {}
    raw = {str(k): float(v) for k, v in dict(analysis or {}).items()}
    out = {
        "flops": raw.get("flops", 0.0),
        "bytes_accessed": raw.get("bytes accessed", 0.0),
        "transcendentals": raw.get("transcendentals", 0.0),
    }
    return {
        **out,
        **{k: v for k, v in raw.items() if k not in ("flops", "bytes accessed", "transcendentals")},
    }


def _call_module(module: Module, *args: Any, **kwargs: Any) -> Any:
    return module(*args, **kwargs)


def format_parameters(n: int) -> str:
    """`n` in short form: `999`, `1.2K`, `12.3M`, `4.5B`."""
    for size, suffix in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.1f}{suffix}"
    return str(n)


def repr_module(module: Module) -> str:
    """The module tree as `repr` prints it: classes, static attributes, Variables with shapes."""
    if not isinstance(module, Module):
        raise TypeError(f"repr_module: expected an spx.Module, received {type(module).__name__}.")
    return repr(module)


__all__ = [
    "count_bytes",
    "count_parameters",
    "display",
    "format_parameters",
    "hlo_cost",
    "repr_module",
    "summary",
    "tabulate",
    "tree_state",
]

# `spectrax-lib`'s module paths `spectrax.inspect.display`, ... hold these names too; each submodule
# named like one of this module's functions (or `repr`) is loaded now, the name kept as it was.
keep_names(__name__, ("display", "repr", "summary", "tabulate"))
