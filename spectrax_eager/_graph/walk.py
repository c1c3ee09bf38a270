"""Walking a model: its variables and sub-modules (by selector or class), finding one, freezing
and unfreezing, removing variables (`pop`), and reporting variables shared by accident."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from . import structure
from .module import Module, Plan, plan_of, require_module
from .selector import mask
from .state import State, state_of
from .variable import Variable


def iter_variables(model: Module, select: Any = None) -> Iterator[tuple[str, Variable]]:
    """Yield `(path, variable)` for each variable `select` matches (None: every one), in plan order."""
    plan = plan_of(require_module(model, "iter_variables"))
    for info, var, keep in zip(plan.infos, plan.vars, mask(plan, True if select is None else select)):
        if keep:
            yield info.path, var


def freeze(model: Module, selector: Any = True) -> Module:
    """Mark the selected variables `trainable=False`: `grad` and `Optimizer` then skip them."""
    for _, var in list(iter_variables(model, selector)):
        var.metadata["trainable"] = False
    structure.bump()
    return model


def unfreeze(model: Module, selector: Any = True) -> Module:
    """Undo `freeze` for the selected variables."""
    for _, var in list(iter_variables(model, selector)):
        var.metadata.pop("trainable", None)
    structure.bump()
    return model


def trainable(plan: Plan, wrt: Any) -> tuple[bool, ...]:
    """`wrt`'s mask minus frozen variables (cached)."""
    key = ("trainable", wrt if not isinstance(wrt, list) else tuple(wrt))
    try:
        hit = plan.masks.get(key)
    except TypeError:
        key, hit = None, None
    if hit is not None:
        return hit
    sel = mask(plan, wrt)
    out = tuple(s and v.metadata.get("trainable", True) is not False for s, v in zip(sel, plan.vars))
    if key is not None:
        plan.masks[key] = out
    return out


def iter_modules(
    model: Module, *, with_path: bool = True, skip_root: bool = False, select: Any = None
) -> Iterator[tuple[str, Module]] | Iterator[Module]:
    """Yield `(path, module)` (or the module alone, `with_path=False`) for `model` (path `""`,
    unless `skip_root`) and every sub-module, in definition order. `select`: a Module subclass
    (or tuple of them) or a predicate `fn(path, module)` keeps only those modules.

    A module reachable along several paths is yielded once, at its first path.
    """
    keep = _module_filter(select, "iter_modules")
    for path, module in plan_of(require_module(model, "iter_modules")).modules:
        if (skip_root and path == "") or not keep(path, module):
            continue
        yield (path, module) if with_path else module


def _module_filter(what: Any, where: str) -> Callable[[str, Module], bool]:
    if what is None:
        return lambda p, m: True
    if _is_module_types(what):
        return lambda p, m: isinstance(m, what)
    if callable(what) and not isinstance(what, type):
        return what
    raise TypeError(
        f"{where}: select a Module subclass (or a tuple of them) or a predicate fn(path, module); "
        f"received {what!r}."
    )


def _is_module_types(what: Any) -> bool:
    types = what if isinstance(what, tuple) else (what,)
    return bool(types) and all(isinstance(t, type) and issubclass(t, Module) for t in types)


def find(model: Module, select: Any = None) -> tuple[str, Module | Variable] | None:
    """The first `(path, target)` that `select` picks, or None.

    A Module subclass (or tuple of them) looks for a module; any other selector
    (a collection name, a Variable subclass, a glob, `spx.select()...` with
    `| & - ~`, a predicate `fn(path, variable)`) looks for a variable. Modules
    and variables come in definition order. `spx.iter_modules(model, select=...)`
    and `spx.iter_variables(model, select=...)` give every match.
    """
    require_module(model, "find")
    if select is None:
        raise TypeError(
            "find: give what to look for, e.g. spx.find(model, nn.Linear) or spx.find(model, 'lora')."
        )
    found = iter_modules(model, select=select) if _is_module_types(select) else iter_variables(model, select)
    return next(iter(found), None)


def live_variables(model: Module, select: Any = True) -> list[tuple[str, Variable]]:
    """`[(path, variable)]` of the variables of `model` that `select` matches (a shared one once,
    under its first path), in plan order."""
    return list(iter_variables(model, select))


def pop(model: Module, select: Any) -> State:
    """Remove the variables `select` matches from `model`; return their State.

    The usual use is collecting what `Module.sow` stored:
    `inter = spx.pop(model, "intermediates")` after a forward pass.
    """
    plan = plan_of(require_module(model, "pop"))
    keep = mask(plan, select)
    chosen = {id(var) for var, k in zip(plan.vars, keep) if k}
    out = state_of(plan, keep)
    for _, mod in plan.modules:
        for name, value in list(mod.__dict__.items()):
            if isinstance(value, Variable) and id(value) in chosen:
                del mod.__dict__[name]
    if chosen:
        structure.bump()
    return out


def check_unintentional_sharing(model: Module) -> list[tuple[str, str]]:
    """`(alias path, first path)` for every variable reachable along more than one path whose
    metadata has no `tie_group` entry (deliberate ties, such as a shared embedding, set one)."""
    first: dict[int, str] = {}
    out: list[tuple[str, str]] = []

    def visit(module: Module, prefix: str, seen: frozenset) -> None:
        for name, value in module.__dict__.items():
            path = f"{prefix}{name}"
            if name.startswith("_spx_"):
                continue
            if isinstance(value, Variable):
                if id(value) in first:
                    if "tie_group" not in value.metadata:
                        out.append((path, first[id(value)]))
                else:
                    first[id(value)] = path
            elif isinstance(value, Module) and id(value) not in seen:
                visit(value, path + ".", seen | {id(value)})

    plan_of(require_module(model, "check_unintentional_sharing"))  # refuses a cyclic graph first
    visit(model, "", frozenset({id(model)}))
    return out
