"""Eager LoRA: `wrap_lora`, `inject_lora`, `merge_lora` over `spectrax_core.nn.LoRA`.

The low-rank factors are `LoRAParam` variables (collection `"lora"`), so
`spx.grad(..., wrt="lora")` and `spx.Optimizer(model, tx, wrt="lora")` train
them alone while the base `Linear`'s parameters stay frozen.
"""

from __future__ import annotations

import fnmatch
from typing import Any, Callable

import jax

import spectrax_core as sc

from .._graph.module import Module, plan_of
from .._graph.rngs import Rngs
from .._graph.variable import Variable
from ._base import CoreLayer, from_core, key_from
from ._layers import Linear


class LoRAParam(Variable):
    """A trainable LoRA factor: collection `"lora"`."""

    __slots__ = ()
    default_kind = "lora"


LoraParameter = LoRAParam


class LoRALinear(CoreLayer):
    """A frozen `base` Linear plus `(alpha/rank)·(x a) b`; build it with `wrap_lora` or `inject_lora`.

    Called as a module it runs `spectrax_core.nn.LoRA`. Inside a layer that reads
    its projections as core `Linear` params (Attention, MLP), it presents itself
    as the merged Linear `W + (alpha/rank)·a b`, computed from the live factors,
    so gradients still reach `a` and `b`.
    """

    core_cls = sc.nn.LoRA

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        rank: int,
        alpha: float | None = None,
        use_bias: bool = True,
        w_init: Any = None,
        b_init: Any = None,
        rngs: Rngs | None = None,
        a_init: Any = None,
        lora_b_init: Any = None,
        dtype: Any = None,
    ):
        """A new `Linear(in_features, out_features)` (`w_init`, `b_init`) with rank-`rank` factors
        (`a_init`, `lora_b_init`, stored in `dtype`): `wrap_lora` of it."""
        base = Linear(in_features, out_features, use_bias=use_bias, w_init=w_init, b_init=b_init, rngs=rngs)
        self._wrap(base, rank, alpha, rngs, "LoRALinear", a_init, lora_b_init, dtype)

    def _wrap(
        self,
        base: Linear,
        rank: int,
        alpha: float | None,
        rngs: Rngs | None,
        where: str = "",
        a_init: Any = None,
        b_init: Any = None,
        dtype: Any = None,
    ) -> None:
        """Wrap `base`; `a_init` / `b_init` replace the factors' initializers (Lecun-normal `a`,
        zero `b`: the wrapped layer starts as `base`), `dtype` their storage dtype."""
        where = where or type(self).__name__
        if type(base) is not Linear or getattr(base, "d_in", None) is None:
            raise TypeError(f"{where}: received {type(base).__name__}; {_accepts('wrap_lora')}.")
        self.base = base
        core = sc.nn.LoRA.init(key_from(rngs, where), base.core_params(), rank=rank, alpha=alpha)
        if a_init is not None or b_init is not None or dtype is not None:
            dtype = core.a.dtype if dtype is None else dtype
            ka, kb = jax.random.split(key_from(rngs, where)) if a_init or b_init else (None, None)
            a = core.a.astype(dtype) if a_init is None else a_init(ka, core.a.shape, dtype)
            b = core.b.astype(dtype) if b_init is None else b_init(kb, core.b.shape, dtype)
            core = sc.nn.LoRA(base=core.base, a=a, b=b, rank=core.rank, alpha=core.alpha)
        self._factors(core)

    def _adopt(self, params: sc.nn.LoRA) -> None:
        self.base = from_core(params.base)
        self._factors(params)

    def _factors(self, params: sc.nn.LoRA) -> None:
        axes = params.logical_axes()
        self.a = LoRAParam(params.a, axes=axes["a"])
        self.b = LoRAParam(params.b, axes=axes["b"])
        self.rank, self.alpha = params.rank, params.alpha

    base_module = property(lambda self: self.base, doc="`base`, the wrapped Linear.")
    lora_a = property(lambda self: self.a, doc="`a`, the `(d_in, rank)` factor.")
    lora_b = property(lambda self: self.b, doc="`b`, the `(rank, d_out)` factor.")

    def lora_params(self) -> sc.nn.LoRA:
        """The core `LoRA` params holding the current values."""
        return sc.nn.LoRA(
            base=self.base.core_params(), a=self.a.value, b=self.b.value, rank=self.rank, alpha=self.alpha
        )

    def core_params(self) -> sc.nn.Linear:
        """The merged core `Linear` (what a parent core layer reads; differentiable in `a`, `b`)."""
        return self.lora_params().merged()

    def forward(self, x: jax.Array) -> jax.Array:
        return sc.apply(self.lora_params(), x)


def _accepts(where: str) -> str:
    return (
        f"{where} accepts an initialised spx.nn.Linear (d_in known: call a lazy Linear once first); "
        "for a larger model use spx.nn.inject_lora(model, where=..., rank=..., rngs=...)"
    )


class LoRA(LoRALinear):
    """The adapter `wrap_lora` / `inject_lora` put in place of a `Linear`: `LoRA(d_in, rank, d_out)`
    builds one around a new Linear, `LoRA(..., base_module=linear)` around an existing one."""

    def __init__(
        self,
        d_in: int,
        rank: int,
        d_out: int,
        *,
        base_module: Linear | None = None,
        alpha: float | None = None,
        rngs: Rngs | None = None,
        a_init: Any = None,
        b_init: Any = None,
        dtype: Any = None,
    ):
        if base_module is None:
            base_module = Linear(d_in, d_out, rngs=rngs)
        elif (base_module.d_in, base_module.d_out) != (d_in, d_out):
            raise ValueError(
                f"LoRA: base_module is {base_module.d_in} -> {base_module.d_out}, not {d_in} -> {d_out}."
            )
        self._wrap(base_module, rank, alpha, rngs, "LoRA", a_init, b_init, dtype)


def wrap_lora(
    base: Module,
    rank: int,
    *,
    alpha: float | None = None,
    rngs: Rngs | None = None,
    a_init: Any = None,
    b_init: Any = None,
    dtype: Any = None,
) -> LoRA:
    """A `LoRA` adapter around `base` (its parameters are shared, not copied) with rank-`rank` factors.

    `b` starts at zero (unless `b_init` says otherwise), so the wrapped layer computes exactly
    what `base` does. `alpha` defaults to `rank` (scale 1).
    """
    layer = LoRA.__new__(LoRA)
    layer._wrap(base, rank, alpha, rngs, "wrap_lora", a_init, b_init, dtype)
    return layer


def module_matcher(where: str | Callable | None) -> Callable[[str, Module], bool]:
    if where is None:
        return lambda path, module: True
    if isinstance(where, str):
        return lambda path, module: fnmatch.fnmatchcase(path, where)
    if callable(where):
        return where
    raise TypeError(
        f"where must be None (every Linear), a glob over the module path ('blocks.*.attn.q') or "
        f"fn(path, module) -> bool; received {where!r}."
    )


def replace_modules(
    model: Module,
    cls: type | tuple[type, ...],
    where: str | Callable | None,
    make: Callable[[Module], Module],
    fn: str,
    skip: frozenset = frozenset(),
) -> list[str]:
    """Replace each `cls` child (exactly of that class, or of one of a tuple of classes) of `model`
    whose dotted path `where` matches by `make(child)`.

    Every replacement is built before any is installed, so a failing one leaves
    `model` unchanged. Children whose id is in `skip` are left alone. Returns the paths.
    """
    match = module_matcher(where)
    classes = cls if isinstance(cls, tuple) else (cls,)
    cls = classes[0]
    found = []
    for parent_path, parent in plan_of(model).modules:
        for name, child in parent.__dict__.items():
            path = f"{parent_path}.{name}" if parent_path else name
            if type(child) in classes and id(child) not in skip and match(path, child):
                found.append((parent, name, path, child))
    if not found:
        raise ValueError(
            f"{fn}: no {cls.__name__} in {type(model).__name__} matched where={where!r}; "
            f"it accepts a model holding spx.nn.{cls.__name__} layers, selected by a glob over their "
            f"paths or fn(path, module) -> bool. Its module paths: "
            f"{[p for p, _ in plan_of(model).modules if p][:8]}."
        )
    new = [make(child) for _, _, _, child in found]
    for (parent, name, _, _), module in zip(found, new):
        setattr(parent, name, module)
    return [path for _, _, path, _ in found]


def inject_lora(
    model: Module,
    *,
    rank: int,
    alpha: float | None = None,
    where: str | Callable | None = None,
    rngs: Rngs | None = None,
) -> list[str]:
    """Wrap every `Linear` of `model` whose path matches `where` (default: all) with `wrap_lora`, in place.

    `where` is a glob over dotted module paths (`"*.attn.q"`) or
    `fn(path, module) -> bool`. Returns the wrapped paths.
    """
    if isinstance(model, Linear):
        raise TypeError("inject_lora: received a Linear itself; wrap it with spx.nn.wrap_lora(linear, ...).")
    key_from(rngs, "inject_lora")
    return replace_modules(
        model, Linear, where, lambda lin: wrap_lora(lin, rank=rank, alpha=alpha, rngs=rngs), "inject_lora"
    )


def merge_lora(module: Module) -> Module:
    """Fold each LoRA update into its base weight: `W ← W + (alpha/rank)·a b`.

    Given a `LoRALinear`, returns the merged `Linear`; given a model, replaces
    its `LoRALinear` layers in place and returns the model.
    """
    if isinstance(module, LoRALinear):
        return from_core(module.core_params())
    if not isinstance(module, Module):
        raise TypeError(f"merge_lora: expected an spx.Module, received {type(module).__name__}.")
    if not any(isinstance(m, LoRALinear) for _, m in plan_of(module).modules):
        raise ValueError(
            f"merge_lora: {type(module).__name__} holds no LoRA layers (already merged?); it accepts a "
            "LoRALinear or a model returned by wrap_lora / inject_lora."
        )
    replace_modules(module, (LoRALinear, LoRA), None, merge_lora, "merge_lora")
    return module
