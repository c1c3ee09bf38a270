"""LoRA: a trainable low-rank update around a frozen `Linear`, `y = x W + b + (alpha/r)·(x A) B`.

`A` is `(d_in, rank)`, `B` is `(rank, d_out)` and starts at zero, so a wrapped
layer computes exactly what its base computes until `B` is trained. The base
stays a plain `Linear`; `lora_mask` marks the `A`/`B` leaves so that training
only them is a pytree partition (`equinox.partition(params, lora_mask(params))`).

Layers that read their projections as `Linear` params (Attention, MLP) do not
dispatch on the projection's type; run them on `merge_lora(params)`, which
folds each update into its weight as a differentiable function of `A` and `B`
(`x (W + s·A B) = x W + s·(x A) B`), so gradients still reach `A` and `B`.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._apply import apply, register_apply
from .._checks import check_last_dim
from ._linear import Linear


def _check_rank(rank, d_in: int, d_out: int, where: str) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or not 1 <= rank <= min(d_in, d_out):
        raise ValueError(
            f"{where}: rank must be an int with 1 <= rank <= min(d_in, d_out) = {min(d_in, d_out)} "
            f"(d_in={d_in}, d_out={d_out}); received rank={rank!r}. A typical rank is 4 to 64."
        )


class LoRA(eqx.Module):
    """Parameters of a LoRA-wrapped `Linear`: the frozen `base` and the trainable `a`, `b`.

    `alpha` and `rank` are static; the update is scaled by `alpha / rank`.
    """

    base: Linear
    a: Float[Array, "d_in rank"]
    b: Float[Array, "rank d_out"]
    rank: int = eqx.field(static=True)
    alpha: float = eqx.field(static=True)

    @classmethod
    def init(cls, key: PRNGKeyArray, base: Linear, *, rank: int, alpha: float | None = None) -> "LoRA":
        """Wrap `base` with a rank-`rank` update: Lecun-normal `a`, zero `b`; `alpha` defaults to `rank`."""
        if not isinstance(base, Linear):
            raise TypeError(
                f"LoRA.init: base must be a spectrax_core.nn.Linear, received {type(base).__name__}; "
                "wrap the Linear projections inside a larger layer with inject_lora(params, key, ...)."
            )
        if base.weight.ndim != 2:
            raise ValueError(
                f"LoRA.init: base weight has shape {tuple(base.weight.shape)} (stacked layers); "
                "LoRA wraps one (d_in, d_out) weight. Wrap the layers before stacking them."
            )
        _check_rank(rank, base.d_in, base.d_out, "LoRA.init")
        alpha = float(rank if alpha is None else alpha)
        if not alpha > 0:
            raise ValueError(f"LoRA.init: alpha must be a positive number, received alpha={alpha!r}.")
        dtype = base.weight.dtype
        a = jax.nn.initializers.lecun_normal()(key, (base.d_in, rank), dtype)
        return cls(base=base, a=a, b=jnp.zeros((rank, base.d_out), dtype), rank=rank, alpha=alpha)

    @property
    def scale(self) -> float:
        """`alpha / rank`, the factor of the low-rank update."""
        return self.alpha / self.rank

    @property
    def d_in(self) -> int:
        return self.base.d_in

    @property
    def d_out(self) -> int:
        return self.base.d_out

    def logical_axes(self) -> dict[str, tuple]:
        """`a` shares the base's input axis, `b` its output axis; the rank axis is replicated."""
        return {"a": (self.base.axes[0], None), "b": (None, self.base.axes[1])}

    def merged(self) -> Linear:
        """The base `Linear` with weight `W + (alpha/r)·a b` (differentiable in `a` and `b`)."""
        delta = (self.a @ self.b) * self.scale
        return eqx.tree_at(
            lambda l: l.weight, self.base, self.base.weight + delta.astype(self.base.weight.dtype)
        )


@register_apply(LoRA)
def apply_lora(params: LoRA, x: Array) -> Array:
    """`base(x) + (alpha/r)·(x a) b` for `x` of shape `(..., d_in)`; the update never forms `a b`."""
    check_last_dim("LoRA", x, params.d_in)
    return apply(params.base, x) + ((x @ params.a) @ params.b) * params.scale


def _is_lora(x) -> bool:
    return isinstance(x, LoRA)


def _path_name(path) -> str:
    parts = []
    for k in path:
        for attr in ("name", "key", "idx"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
    return ".".join(parts)


def inject_lora(
    params: PyTree,
    key: PRNGKeyArray,
    *,
    rank: int,
    alpha: float | None = None,
    where=None,
) -> PyTree:
    """Wrap every `Linear` of `params` for which `where(path, linear)` is true (default: all) in `LoRA`.

    `path` is the dotted field path (`"attn.q"`, `"blocks.0.mlp.up"`). Each wrapped
    layer draws its `a` from `fold_in(key, i)`, `i` its position among the matches.
    """
    flat, treedef = jax.tree_util.tree_flatten_with_path(params, is_leaf=lambda x: isinstance(x, Linear))
    out, hits = [], 0
    for path, leaf in flat:
        if isinstance(leaf, Linear) and (where is None or where(_path_name(path), leaf)):
            leaf = LoRA.init(jax.random.fold_in(key, hits), leaf, rank=rank, alpha=alpha)
            hits += 1
        out.append(leaf)
    if hits == 0:
        raise ValueError(
            f"inject_lora: no Linear in params of type {type(params).__name__} matched `where`; "
            "it accepts any pytree holding spectrax_core.nn.Linear params (a layer, block or model)."
        )
    return jax.tree_util.tree_unflatten(treedef, out)


def merge_lora(params: PyTree) -> PyTree:
    """`params` with every `LoRA` replaced by its merged `Linear` (see `LoRA.merged`)."""
    if not any(_is_lora(x) for x in jax.tree.leaves(params, is_leaf=_is_lora)):
        raise ValueError(
            f"merge_lora: params of type {type(params).__name__} hold no LoRA layers (already merged?); "
            "pass the params returned by LoRA.init or inject_lora."
        )
    return jax.tree.map(lambda x: x.merged() if _is_lora(x) else x, params, is_leaf=_is_lora)


def lora_mask(params: PyTree) -> PyTree:
    """A pytree of bools with the structure of `params`: True exactly at the `a`/`b` leaves of `LoRA` layers.

    `equinox.partition(params, lora_mask(params))` splits the trainable LoRA
    leaves from the frozen rest; `equinox.combine` puts them back together.
    """

    def mark(x):
        if _is_lora(x):
            return eqx.tree_at(
                lambda l: (l.base, l.a, l.b), x, (jax.tree.map(lambda _: False, x.base), True, True)
            )
        return jax.tree.map(lambda _: False, x)

    return jax.tree.map(mark, params, is_leaf=_is_lora)
