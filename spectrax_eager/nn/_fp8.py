"""Eager FP8: `Fp8Linear` (state in collection `"fp8_meta"`), `to_fp8`, `fp8_update`.

A training step differentiates the parameters and the `"fp8_meta"` state
together; the meta "gradients" are the next amax histories (see
`spectrax_core.nn._fp8`). `fp8_update(model, grads)` writes them over the
state, recomputes the scales and returns the remaining gradients for the
optimizer; under `spx.jit` let the step write `"fp8_meta"` (`mutable=`).
"""

from __future__ import annotations

from typing import Any, Callable

import equinox as eqx
import jax.numpy as jnp

import spectrax_core as sc

from .._graph.module import Module, plan_of
from .._graph.rngs import Rngs
from .._graph.selector import as_selector
from .._graph.state import State
from .._graph.variable import Variable
from ._base import CoreLayer, also_named, annotate, dtype_kwargs, key_from, sharding_axes
from ._layers import Linear
from ._lora import module_matcher, replace_modules

META = "fp8_meta"


class Fp8Meta(Variable):
    """FP8 scaling state (amax history, scales): collection `"fp8_meta"`, overwritten, never optimised."""

    __slots__ = ()
    default_kind = META


@also_named(in_features="d_in", out_features="d_out", amax_history_length=("history_len", None))
class Fp8Linear(CoreLayer):
    """`y = x @ weight + bias` with e4m3 operands and e5m2 output gradients (delayed scaling).

    `amax_history` `(3, history_len)` and `scale` `(3,)` are `Fp8Meta` variables.
    """

    core_cls = sc.nn.Fp8Linear

    def __init__(
        self,
        d_in: int,
        d_out: int,
        *,
        use_bias: bool = True,
        dtype=jnp.float32,
        axes: tuple = ("EMBED", "MLP"),
        history_len: int = 16,
        margin: int = 0,
        rngs: Rngs | None = None,
        w_init: Any = None,
        b_init: Any = None,
        param_dtype: Any = None,
        sharding: Any = None,
        bias_sharding: Any = None,
    ):
        """`dtype` (or `param_dtype`, which wins) is the stored dtype; `sharding` replaces `axes`."""
        axes = sharding_axes("Fp8Linear", sharding, 2, w_init) or axes
        linear = sc.nn.Linear.init(
            key_from(rngs, "Fp8Linear"),
            d_in,
            d_out,
            use_bias=use_bias,
            axes=axes,
            **dtype_kwargs(None, dtype if param_dtype is None else param_dtype, w_init, b_init),
        )
        self._adopt(sc.nn.Fp8Linear.from_linear(linear, history_len=history_len, margin=margin))
        annotate(self, "Fp8Linear", bias=bias_sharding)

    @classmethod
    def from_linear(cls, linear: Module, *, history_len: int = 16, margin: int = 0) -> "Fp8Linear":
        """The FP8 layer holding `linear`'s weight and bias values, with fresh scaling state."""
        if type(linear) is not Linear or getattr(linear, "d_in", None) is None:
            raise TypeError(
                f"Fp8Linear.from_linear: received {type(linear).__name__}; it accepts an initialised "
                "spx.nn.Linear (call a lazy Linear once first)."
            )
        layer = cls.__new__(cls)
        layer._adopt(
            sc.nn.Fp8Linear.from_linear(linear.core_params(), history_len=history_len, margin=margin)
        )
        return layer

    def _adopt(self, params: sc.nn.Fp8Linear) -> None:
        super()._adopt(params)  # weight and bias as Parameters; the state moves to "fp8_meta" below
        axes = params.logical_axes()
        self.amax_history = Fp8Meta(params.amax_history, axes=axes["amax_history"])
        self.scale = Fp8Meta(params.scale, axes=axes["scale"])


def to_fp8(
    model: Module, where: str | Callable | None = None, *, history_len: int = 16, margin: int = 0
) -> list[str]:
    """Swap every `Linear` of `model` whose path matches `where` (default: all) for an `Fp8Linear`, in place.

    `where` is a glob over dotted module paths (`"blocks.*.fc"`) or `fn(path,
    module) -> bool`. The projections of a core layer (the `q` of an `Attention`)
    are read by that layer's own matmuls and stay as they are; naming one in
    `where` is an error. Returns the swapped paths.
    """
    match = module_matcher(where)
    inner = set()
    for path, mod in plan_of(model).modules:
        if not isinstance(mod, CoreLayer):
            continue
        for name, child in mod.__dict__.items():
            child_path = f"{path}.{name}" if path else name
            if type(child) is Linear:
                inner.add(id(child))
                if where is not None and match(child_path, child):
                    raise ValueError(
                        f"to_fp8: {child_path!r} is a projection inside the {type(mod).__name__} at "
                        f"{path or 'the root'!r}, which does its own matmuls; `where` may only select "
                        "Linear layers called as modules."
                    )
    return replace_modules(
        model,
        Linear,
        where,
        lambda lin: Fp8Linear.from_linear(lin, history_len=history_len, margin=margin),
        "to_fp8",
        skip=frozenset(inner),
    )


def fp8_update(model: Module, grads: State, *, count: int = 1) -> State:
    """Write the next FP8 state from `grads` into `model`; return `grads` without its `"fp8_meta"` entries.

    `grads` is the `State` of `spx.grad(..., wrt=("parameters", "fp8_meta"))` (or any
    `wrt` that includes `"fp8_meta"`); `count` is how many times each FP8 layer ran
    in the step (the number of microbatches of a pipelined step).
    """
    if not isinstance(grads, State):
        raise TypeError(
            f"fp8_update: grads must be the spx.State from spx.grad, received {type(grads).__name__}."
        )
    flat = grads.flat()
    layers = [(p, m) for p, m in plan_of(model).modules if isinstance(m, Fp8Linear)]
    if not layers:
        raise ValueError(
            f"fp8_update: {type(model).__name__} holds no Fp8Linear layers; convert some with to_fp8."
        )
    for path, layer in layers:
        key = (META, f"{path}.amax_history" if path else "amax_history")
        if key not in flat:
            raise ValueError(
                f"fp8_update: grads hold no {key[1]!r} in collection {META!r}; differentiate with "
                f"wrt=('parameters', {META!r}) so that the step returns the next amax histories."
            )
        core = layer.core_params()
        new = sc.nn.fp8_update(core, eqx.tree_at(lambda l: l.amax_history, core, flat[key]), count=count)
        layer.amax_history.value = new.amax_history
        layer.scale.value = new.scale
    return grads.filter(~as_selector(META))
