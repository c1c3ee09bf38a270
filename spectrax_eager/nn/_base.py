"""`CoreLayer`: an eager layer that is a stateful view of one `spectrax_core` params class.

The eager layer holds one `Parameter` per array field of the core params (with
the core's logical axes as `axes` metadata), an eager sub-layer per nested
core params, and the static fields as plain attributes. `core_params()`
rebuilds the core params object from the current values (trace-time work
under `jit`), and `forward` calls `spectrax_core.apply` on it: the math is
always the core's.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any, ClassVar, TypedDict

import jax
import jax.numpy as jnp

import spectrax_core as sc

from .._graph.module import Module
from .._graph.rngs import current_rngs
from .._graph.variable import Buffer, Parameter, Variable, set_value
from .._scope.policy import current_policy
from .._sharding.rules import annotation_axes
from .._sharding.specs import place_by_axes

# A registry, not ambient state: the eager layer class of each core params class, filled as the
# classes are defined (process-wide, like JAX's pytree registry).
_EAGER_OF: dict[type, type] = {}


class CoreLayer(Module):
    """Base of eager layers mirroring a core params class (`core_cls`)."""

    core_cls: ClassVar[type]
    #: Variable class of each array field (default `Parameter`), e.g. running statistics.
    variable_types: ClassVar[dict[str, type]] = {}

    #: The keywords a layer's `**options` takes (see `spell_out_options`).
    option_names: ClassVar[frozenset] = frozenset()

    def __init_subclass__(cls, **kwargs: Any):
        super().__init_subclass__(**kwargs)
        if "core_cls" in cls.__dict__:
            _EAGER_OF.setdefault(cls.core_cls, cls)
        if "__init__" in cls.__dict__:
            spell_out_options(cls)

    def _build(self, *args: Any, options: Mapping, constant: bool = False, **core_kwargs: Any) -> None:
        """Adopt `core_cls.init(key, *args, **core_kwargs)` with the dtype and initializer keywords
        of the layer's `options`. `constant`: the layer's default values are constants, so a key
        (and `rngs`) is needed only when an initializer is given."""
        where = type(self).__name__
        unknown = sorted(set(options) - (self.option_names or set(LayerOptions.__annotations__)))
        if unknown:
            raise TypeError(f"{where}() got an unexpected keyword argument {unknown[0]!r}")
        o = {**OPTION_DEFAULTS, **options}
        if constant:
            key = init_key(o["rngs"], where, o["w_init"], o["b_init"])
        else:
            key = key_from(o["rngs"], where)
        kw = dtype_kwargs(o["dtype"], o["param_dtype"], o["w_init"], o["b_init"])
        if self.option_names and "b_init" not in self.option_names:
            del kw["b_init"]
        self._adopt(self.core_cls.init(key, *args, **core_kwargs, **kw))

    def _adopt(self, params: Any) -> None:
        """Take the arrays, sub-params and static fields of a core params object.

        Under a mesh (`with mesh:` / `jax.set_mesh`) each array is placed by its
        logical axes and the rules in force (`spx.sharding.apply_logical_sharding`).
        """
        axes = params.logical_axes() if hasattr(params, "logical_axes") else {}
        for f in dataclasses.fields(params):
            value = getattr(params, f.name)
            if isinstance(value, jax.Array):
                meta = {"axes": tuple(axes[f.name])} if f.name in axes else {}
                if meta:
                    value = place_by_axes(value, meta["axes"])
                setattr(self, f.name, self.variable_types.get(f.name, Parameter)(value, **meta))
            elif type(value) in _EAGER_OF:
                setattr(self, f.name, from_core(value))
            else:
                setattr(self, f.name, value)

    def core_params(self) -> Any:
        """The core params object holding this layer's current values."""
        kw = {}
        for f in _fields(self.core_cls):
            value = self.__dict__[f.name]
            if isinstance(value, Variable):
                value = value.value
            elif isinstance(value, CoreLayer):
                value = value.core_params()
            kw[f.name] = value
        return self.core_cls(**kw)

    def forward(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        policy = current_policy()
        if policy is not None and policy.compute_dtype is not None:
            cast = policy.cast_param
            return sc.apply(cast(self.core_params()), cast(x), *cast(args), **cast(kwargs))
        return sc.apply(self.core_params(), x, *args, **kwargs)


_FIELDS: dict[type, tuple] = {}  # a cache: the init fields of each core params class


def _fields(cls: type) -> tuple:
    out = _FIELDS.get(cls)
    if out is None:
        out = _FIELDS[cls] = tuple(f for f in dataclasses.fields(cls) if f.init)
    return out


def from_core(params: Any) -> CoreLayer:
    """The eager layer holding a copy of core `params` (same values, same structure)."""
    cls = _EAGER_OF.get(type(params))
    if cls is None:
        raise TypeError(f"from_core: no eager layer mirrors {type(params).__name__}.")
    layer = cls.__new__(cls)
    layer._adopt(params)
    return layer


def sharding_axes(where: str, sharding: Any, ndim: int, init: Any = None) -> tuple | None:
    """The logical names of `sharding=` (one name or None per weight axis, an `spx.Sharding`,
    or `Replicated`), else those of an initializer wrapped by `spx.sharding.with_partitioning`.
    Names are metadata: they are resolved when the weight is placed, not here."""
    if sharding is None:
        sharding = getattr(init, "sharding", None)
    return annotation_axes(where, sharding, ndim)


def dtype_kwargs(dtype: Any, param_dtype: Any, w_init: Any = None, b_init: Any = None) -> dict:
    """Core `init` keywords from the eager ones: `dtype` computes, `param_dtype` stores."""
    return {"dtype": param_dtype, "compute_dtype": dtype, "w_init": w_init, "b_init": b_init}


#: Default storage dtype of eager layers' parameters.
PARAM_DTYPE = jnp.float32


class WeightOptions(TypedDict, total=False):
    """The keywords of every eager layer that makes a weight: `dtype` (compute dtype; None = as
    given), `param_dtype` (storage dtype, float32), `w_init` (an initializer from `spx.init` or
    `jax.nn.initializers`) and `rngs` (init keys; None = the innermost `with spx.seed(...)`)."""

    dtype: Any
    param_dtype: Any
    w_init: Any
    rngs: Any


class LayerOptions(WeightOptions, total=False):
    """`WeightOptions` and `b_init`, the bias's initializer."""

    b_init: Any


OPTION_DEFAULTS = {"dtype": None, "param_dtype": PARAM_DTYPE, "w_init": None, "b_init": None, "rngs": None}


def split_options(kwargs: Mapping) -> tuple[dict, dict]:
    """`(the LayerOptions among kwargs, the others)`: for layers passing other keywords on to the core."""
    options = {k: v for k, v in kwargs.items() if k in LayerOptions.__annotations__}
    return options, {k: v for k, v in kwargs.items() if k not in options}


def spell_out_options(cls: type) -> None:
    """Give `cls.__init__` a signature naming each keyword of its `**options: Unpack[...]` (with
    its default), as if written out, and record them in `cls.option_names`."""
    init = cls.__dict__["__init__"]
    sig = inspect.signature(init)
    var = next((p for p in sig.parameters.values() if p.kind is p.VAR_KEYWORD), None)
    hint = var.annotation if var is not None else None
    if not (isinstance(hint, str) and hint.startswith("Unpack[")):
        return
    options = init.__globals__[hint.removeprefix("Unpack[").removesuffix("]")]
    names = [n for n in options.__annotations__ if n not in sig.parameters]
    kept = [p for p in sig.parameters.values() if p is not var]
    spelled = [
        inspect.Parameter(n, inspect.Parameter.KEYWORD_ONLY, default=OPTION_DEFAULTS[n]) for n in names
    ]
    init.__signature__ = sig.replace(parameters=kept + spelled)
    cls.option_names = frozenset(options.__annotations__)


def init_key(rngs: Any, where: str, w_init: Any = None, b_init: Any = None) -> jax.Array | None:
    """A key for layers whose default initial values are constants: drawn only when an
    initializer was given (then `rngs` is required), else None."""
    return key_from(rngs, where) if w_init is not None or b_init is not None else None


def key_from(rngs: Any, where: str) -> jax.Array:
    """A fresh init key from `rngs` (an `spx.Rngs`), else from the innermost `with spx.seed(...)`
    block; a clear error when neither is there."""
    if rngs is None:
        rngs = current_rngs()
    if rngs is None:
        raise TypeError(
            f"{where}: pass rngs=spx.Rngs(seed), or build the layer inside `with spx.seed(seed):`, "
            "to initialise the parameters."
        )
    return rngs.params()


def also_named(**aliases: str):
    """Class decorator: each `alias="ours"` makes `alias` a constructor keyword meaning `ours` and a
    read-only attribute reading `ours` (the names code written for the seed library uses, e.g.
    `Linear(in_features=...)` and `linear.in_features` for `d_in`). `alias=("keyword", "attribute")`
    names the two separately; an attribute of None adds the keyword only."""
    attrs = {a: o[1] if isinstance(o, tuple) else o for a, o in aliases.items()}
    aliases = {a: o[0] if isinstance(o, tuple) else o for a, o in aliases.items()}

    def decorate(cls: type) -> type:
        init = cls.__init__
        sig = inspect.signature(init)

        @functools.wraps(init)
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            for alias, ours in aliases.items():
                if alias in kwargs and ours in sig.parameters:
                    if ours in kwargs:
                        raise TypeError(f"{cls.__name__}: give {ours}= or {alias}=, not both.")
                    kwargs[ours] = kwargs.pop(alias)
            init(self, *args, **kwargs)

        extra = [
            inspect.Parameter(alias, inspect.Parameter.KEYWORD_ONLY, default=None)
            for alias, ours in aliases.items()
            if ours in sig.parameters and alias not in sig.parameters
        ]
        params = list(sig.parameters.values())
        tail = [p for p in params if p.kind is inspect.Parameter.VAR_KEYWORD]
        __init__.__signature__ = sig.replace(parameters=[p for p in params if p not in tail] + extra + tail)
        cls.__init__ = __init__
        for alias, ours in attrs.items():
            if ours is not None and alias not in cls.__dict__:
                setattr(cls, alias, property(lambda self, _o=ours: getattr(self, _o), doc=f"`{ours}`."))
        return cls

    return decorate


def annotate(layer: Module, where: str, **fields: Any) -> None:
    """Store `*_sharding=` annotations on `layer`'s arrays: `field=names` (a dotted path to a
    Variable, `__` for `.` in the keyword) sets its `axes` metadata and places it under the
    mesh in force. None leaves a field as built; a field the layer does not have is skipped
    (no bias when `use_bias=False`)."""
    for field, sharding in fields.items():
        if sharding is None:
            continue
        var = layer
        for part in field.split("__"):
            var = getattr(var, part, None)
        if not isinstance(var, Variable):
            continue
        axes = annotation_axes(f"{where}: {field.replace('__', '.')}", sharding, var.ndim)
        var.set_metadata(axes=axes)
        set_value(var, place_by_axes(var.value, axes))


def fix_constant(layer: Module, *fields: str) -> None:
    """Hold the named arrays of `layer` as `Buffer`s (same value and metadata): kept at their
    initial value, not trained (a norm without an elementwise affine, or without a bias)."""
    for field in fields:
        var = layer.__dict__[field]
        setattr(layer, field, Buffer(var.value, **var.metadata))
