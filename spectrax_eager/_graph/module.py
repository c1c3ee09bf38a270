"""`Module`: a PyTorch-shaped container of Variables and sub-modules that is a JAX pytree.

A module's pytree leaves are its Variables' values (in depth-first order of
first visit); its treedef holds a `GraphDef`. Flattening is cached per module
as a `Plan` and rebuilt only when the global structure epoch moved.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import numpy as np

from .._errors import CyclicGraphError
from .._scope import ambient
from .._scope.policy import Policy, push_policy
from . import structure
from .hooks import HOOKS, call_with_hooks
from .methods import ModuleMethods
from .static import immutable
from .structure import GraphDef, VarInfo
from .variable import Variable, _new_like

_PRIVATE = "_spx_"
_ambient_now = ambient.current  # read once per module call


class Plan:
    """The cached flatten of one or more root modules: structure + the live Variable objects."""

    __slots__ = ("epoch", "graphdef", "vars", "infos", "roots", "modules", "masks")

    def __init__(self, graphdef, vars_, infos, roots, modules):
        self.epoch = structure.epoch
        self.graphdef: GraphDef = graphdef
        self.vars: list[Variable] = vars_
        self.infos: tuple[VarInfo, ...] = infos
        self.roots = roots
        self.modules: list[tuple[str, Module]] = modules
        self.masks: dict = {}


def _walk(roots: tuple) -> Plan:
    mod_index: dict[int, int] = {}
    var_index: dict[int, int] = {}
    vars_: list[Variable] = []
    infos: list[VarInfo] = []
    modules: list[tuple[str, Module]] = []
    active: set[int] = set()  # modules on the path being visited (a revisit of one is a cycle)

    def visit_var(var: Variable, path: str, owners: tuple) -> tuple:
        j = var_index.get(id(var))
        if j is not None:
            return ("RV", j)
        j = len(vars_)
        var_index[id(var)] = j
        vars_.append(var)
        meta = structure.freeze_metadata(var.metadata)
        infos.append(VarInfo(path, var.kind, type(var), meta, owners))
        return ("V", type(var), var.kind, meta)

    def visit(mod: Module, path: str, owners: tuple) -> tuple:
        i = mod_index.get(id(mod))
        if i is not None:
            if id(mod) in active:
                raise CyclicGraphError(
                    f"{path}: this {type(mod).__name__} is its own ancestor (at "
                    f"{modules[i][0] or 'the root'!r}); a module graph must not loop back. Keep the "
                    "back-reference outside the module (a function argument, or a weakref in a "
                    "`_spx_`-prefixed attribute)."
                )
            return ("RM", i)
        mod_index[id(mod)] = len(modules)
        modules.append((path, mod))
        active.add(id(mod))
        owners = owners + (type(mod),)
        entries = []
        for name, value in mod.__dict__.items():
            if name.startswith(_PRIVATE) and name != HOOKS:
                continue
            child_path = f"{path}.{name}" if path else name
            if isinstance(value, Module):
                entries.append((name, True, visit(value, child_path, owners)))
            elif isinstance(value, Variable):
                entries.append((name, True, visit_var(value, child_path, owners)))
            else:
                entries.append((name, False, structure.freeze_static(value, f"{type(mod).__name__}.{name}")))
        active.discard(id(mod))
        return ("M", type(mod), tuple(entries))

    specs = tuple(visit(r, "", ()) if isinstance(r, Module) else visit_var(r, "", ()) for r in roots)
    return Plan(GraphDef(specs, len(vars_)), vars_, tuple(infos), tuple(roots), modules)


def plan_of(module: Module) -> Plan:
    """The cached plan of one module (rebuilt after any structural change)."""
    plan = module.__dict__.get("_spx_plan")
    if plan is not None and plan.epoch == structure.epoch:
        return plan
    plan = _walk((module,))
    module.__dict__["_spx_plan"] = plan
    return plan


class _PlanCache:
    """Plans of root tuples walked together, by the roots' ids, for one structure epoch."""

    __slots__ = ("epoch", "plans")

    def __init__(self):
        self.epoch = -1
        self.plans: dict[tuple[int, ...], Plan] = {}


# A cache, not ambient state: emptied when the structure epoch moves or it holds over 256 plans.
_joint = _PlanCache()


def joint_plan(roots: tuple) -> Plan:
    """The plan of several roots walked together, so that shared Variables appear once."""
    if len(roots) == 1 and isinstance(roots[0], Module):
        return plan_of(roots[0])
    if _joint.epoch != structure.epoch or len(_joint.plans) > 256:
        _joint.plans.clear()
        _joint.epoch = structure.epoch
    key = tuple(map(id, roots))
    plan = _joint.plans.get(key)
    if plan is None:
        plan = _joint.plans[key] = _walk(roots)  # the plan holds the roots, so their ids stay unique
    return plan


def require_module(obj: Any, fn: str) -> Module:
    """`obj`, checked to be a Module (a `TypeError` naming `fn` otherwise)."""
    if not isinstance(obj, Module):
        raise TypeError(f"{fn}: expected an spx.Module, received {type(obj).__name__}.")
    return obj


def build(graphdef: GraphDef, values) -> tuple[list, list[Variable]]:
    """New root objects (and their Variables, in plan order) from a structure and values."""
    mods: list[Module] = []
    vars_: list[Variable] = []
    it = iter(values)

    def make(spec: tuple) -> Any:
        tag = spec[0]
        if tag == "V":
            var = _new_like(spec[1], next(it), spec[2], {k: structure.thaw(v) for k, v in spec[3]})
            vars_.append(var)
            return var
        if tag == "RV":
            return vars_[spec[1]]
        if tag == "RM":
            return mods[spec[1]]
        mod = object.__new__(spec[1])
        mods.append(mod)
        d = mod.__dict__
        for name, is_child, payload in spec[2]:
            d[name] = make(payload) if is_child else structure.thaw(payload)
        return mod

    roots = [make(spec) for spec in graphdef.specs]
    return roots, vars_


def _check_attr(owner: Module, name: str, value: Any) -> None:
    if isinstance(value, jax.Array | np.ndarray):
        raise TypeError(
            f"{type(owner).__name__}.{name}: raw arrays are not module attributes. Wrap it "
            f"(`self.{name} = spx.Parameter(x)` or `spx.Buffer(x)`), or write an existing "
            f"variable with `self.{name}.value = x`."
        )
    if isinstance(value, list | tuple | dict):
        items = value.values() if isinstance(value, dict) else value
        if any(isinstance(v, Module | Variable) for v in items):
            raise TypeError(
                f"{type(owner).__name__}.{name}: a plain {type(value).__name__} of modules/variables "
                "is not tracked. Use spx.nn.ModuleList(...) or spx.nn.ModuleDict({...})."
            )


class Module(ModuleMethods):
    """Base class of eager modules: define `__init__` and `forward` (or `__call__`).

    Modules are JAX pytrees whose leaves are their Variables' values, so
    `jax.jit`, `jax.grad` and `jax.tree.map` accept them. `training` is a
    static flag switched by `train()` / `eval()`.
    """

    training: bool

    def __new__(cls, *args: Any, **kwargs: Any):
        self = object.__new__(cls)
        self.__dict__["training"] = True
        return self

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        _register(cls)
        if "__call__" in cls.__dict__:
            cls.__call__ = _hooked(cls.__dict__["__call__"])

    def __setattr__(self, name: str, value: Any) -> None:
        _check_attr(self, name, value)
        if not isinstance(value, Module | Variable):
            fix = f"assign it to the attribute (`module.{name} = new`)"
            value = immutable(value, f"{type(self).__name__}.{name}", fix)
        object.__setattr__(self, name, value)
        structure.bump()

    def __delattr__(self, name: str) -> None:
        object.__delattr__(self, name)
        structure.bump()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(f"{type(self).__name__}: define `forward` (or `__call__`) to call this module.")

    def train(self, mode: bool = True) -> Module:
        """Set `training = mode` on this module and every sub-module; returns self."""
        for _, mod in plan_of(self).modules:
            mod.__dict__["training"] = bool(mode)
        structure.bump()
        return self

    def eval(self) -> Module:
        """Set `training = False` everywhere (dropout off); returns self."""
        return self.train(False)

    def _spx_plan_now(self) -> Plan:
        """The module's current plan (its variables and sub-modules in definition order)."""
        return plan_of(self)

    def __repr__(self) -> str:
        return _repr(self, set())


def _hooked(fn: Callable) -> Callable:
    """Wrap a `__call__` so output transforms (stage markers) and inspection hooks (spx.summary)
    see every module's output, run under the module's `policy` attribute when it is an `spx.Policy`."""

    @functools.wraps(fn)
    def call(self, *args: Any, **kwargs: Any) -> Any:
        hooks = self.__dict__.get(HOOKS)
        policy = self.__dict__.get("policy")  # an attribute `policy` that is no Policy is plain data
        if not isinstance(policy, Policy):
            out = (
                fn(self, *args, **kwargs) if hooks is None else call_with_hooks(fn, self, hooks, args, kwargs)
            )
        else:
            with push_policy(policy):
                out = (
                    fn(self, *args, **kwargs)
                    if hooks is None
                    else call_with_hooks(fn, self, hooks, args, kwargs)
                )
            out = policy.cast_output(out)
        now = _ambient_now()
        for transform in now.output_transforms:
            out = transform(self, out)
        for hook in now.call_hooks:
            hook(self, out)
        return out

    return call


def _base_call(self: Module, *args: Any, **kwargs: Any) -> Any:
    return self.forward(*args, **kwargs)


Module.__call__ = _hooked(_base_call)


def _repr(mod: Module, seen: set[int], indent: str = "") -> str:
    if id(mod) in seen:
        return f"<shared {type(mod).__name__}>"
    seen.add(id(mod))
    statics, children = [], []
    for name, value in mod.__dict__.items():
        if name.startswith(_PRIVATE) or name == "training":
            continue
        if isinstance(value, Module):
            children.append(f"{indent}  {name}={_repr(value, seen, indent + '  ')}")
        elif isinstance(value, Variable):
            children.append(f"{indent}  {name}={value!r}")
        elif not callable(value):
            statics.append(f"{name}={value!r}")
    head = f"{type(mod).__name__}({', '.join(statics)}"
    if not children:
        return head + ")"
    return head + ("\n" if not statics else ",\n") + ",\n".join(children) + f"\n{indent})"


def _flatten(mod: Module):
    plan = plan_of(mod)
    return [v._value for v in plan.vars], plan.graphdef


def _flatten_with_keys(mod: Module):
    plan = plan_of(mod)
    return [
        (jax.tree_util.GetAttrKey(i.path), v._value) for i, v in zip(plan.infos, plan.vars)
    ], plan.graphdef


def _unflatten(graphdef: GraphDef, values) -> Module:
    return build(graphdef, values)[0][0]


def _register(cls: type) -> None:
    jax.tree_util.register_pytree_with_keys(cls, _flatten_with_keys, _unflatten, _flatten)


_register(Module)
