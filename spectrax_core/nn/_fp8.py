"""FP8 linear layer with delayed scaling: e4m3 inputs and weights, e5m2 output gradients.

Each of the three tensors (input, weight, output gradient) has a per-tensor
scale computed from a rolling history of its absolute maxima: `scale =
fp8_max / (max(history) · 2**margin)` (1 while the history is all zero). A
tensor is quantised as `clip(t · scale, ±fp8_max)` cast to its fp8 dtype, the
product runs on the fp8 values with fp32 accumulation and is divided by both
scales. "Delayed": a step uses the scales of the histories recorded by the
steps before it.

The history is state that the backward pass must write (the output-gradient
maximum exists only there). `fp8_dot` is a `jax.custom_vjp` whose cotangent
for `amax_history` is the rolled history with this call's three maxima in slot
0, and zero for `scale`. After `jax.grad` (or a pipelined `sxvalue_and_grad`)
the meta leaves of the gradient tree therefore hold the next history;
`fp8_update` writes it over the params (never adds it) and recomputes the
scales. Gradients of a layer used `count` times in a step (microbatches of a
pipeline, a layer applied twice) add up, so `fp8_update(..., count=count)`
divides them back: the history rolls once and slot 0 is the mean of the
per-use maxima.
"""

from __future__ import annotations

import equinox as eqx
import jax
import jax.numpy as jnp
from jaxtyping import Array, Float, PRNGKeyArray, PyTree

from .._apply import register_apply
from .._checks import check_last_dim
from ._linear import Linear

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
#: Rows of `amax_history` and entries of `scale`.
INPUT, WEIGHT, GRAD = 0, 1, 2
_DTYPES = (E4M3, E4M3, E5M2)


def _fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def _check_history_len(history_len, where: str) -> None:
    if isinstance(history_len, bool) or not isinstance(history_len, int) or history_len < 1:
        raise ValueError(
            f"{where}: history_len must be an int >= 1 (the number of past steps whose amax sets the "
            f"scale; 16 is usual), received history_len={history_len!r}."
        )


class Fp8Linear(eqx.Module):
    """Parameters of an FP8 affine map `d_in → d_out` with its delayed-scaling state.

    `amax_history` is `(3, history_len)` (rows `INPUT`, `WEIGHT`, `GRAD`, slot 0
    the newest) and `scale` is `(3,)`; both are float32 state, not trained.
    `margin` (static) keeps `2**margin` of headroom below the fp8 maximum.
    """

    weight: Float[Array, "d_in d_out"]
    bias: Float[Array, " d_out"] | None
    amax_history: Float[Array, "3 history_len"]
    scale: Float[Array, "3"]
    d_in: int = eqx.field(static=True)
    d_out: int = eqx.field(static=True)
    axes: tuple[str | None, str | None] = eqx.field(static=True, default=("EMBED", "MLP"))
    margin: int = eqx.field(static=True, default=0)

    @classmethod
    def init(
        cls,
        key: PRNGKeyArray,
        d_in: int,
        d_out: int,
        *,
        use_bias: bool = True,
        dtype=jnp.float32,
        axes: tuple[str | None, str | None] = ("EMBED", "MLP"),
        history_len: int = 16,
        margin: int = 0,
    ) -> "Fp8Linear":
        """Lecun-normal weight, zero bias, an all-zero history and unit scales."""
        return cls.from_linear(
            Linear.init(key, d_in, d_out, use_bias=use_bias, dtype=dtype, axes=axes),
            history_len=history_len,
            margin=margin,
        )

    @classmethod
    def from_linear(cls, linear: Linear, *, history_len: int = 16, margin: int = 0) -> "Fp8Linear":
        """The FP8 layer holding `linear`'s weight and bias, with fresh scaling state."""
        if not isinstance(linear, Linear):
            raise TypeError(
                f"Fp8Linear.from_linear: expected a spectrax_core.nn.Linear, received {type(linear).__name__}."
            )
        _check_history_len(history_len, "Fp8Linear")
        if not jnp.issubdtype(linear.weight.dtype, jnp.floating) or linear.weight.ndim != 2:
            raise TypeError(
                f"Fp8Linear: the weight must be a floating (d_in, d_out) array, received "
                f"{linear.weight.dtype}{list(linear.weight.shape)}."
            )
        return cls(
            weight=linear.weight,
            bias=linear.bias,
            amax_history=jnp.zeros((3, history_len), jnp.float32),
            scale=jnp.ones((3,), jnp.float32),
            d_in=linear.d_in,
            d_out=linear.d_out,
            axes=tuple(linear.axes),
            margin=margin,
        )

    @property
    def history_len(self) -> int:
        return self.amax_history.shape[-1]

    def to_linear(self) -> Linear:
        """The plain `Linear` with the same weight and bias (scaling state dropped)."""
        return Linear(weight=self.weight, bias=self.bias, d_in=self.d_in, d_out=self.d_out, axes=self.axes)

    def logical_axes(self) -> dict[str, tuple]:
        """Weight and bias as `Linear`; the scaling state is replicated."""
        return {"weight": self.axes, "bias": (self.axes[1],), "amax_history": (None, None), "scale": (None,)}


def compute_scale(amax_history: Array, margin: int = 0) -> Array:
    """Per-row scale `fp8_max / (max(history) · 2**margin)`, 1 where the history is all zero."""
    fmax = jnp.asarray([_fp8_max(d) for d in _DTYPES], jnp.float32)
    amax = jnp.max(amax_history, axis=-1)
    safe = jnp.where(amax > 0, amax, 1.0)
    return jnp.where(amax > 0, fmax / (safe * 2.0**margin), 1.0).astype(jnp.float32)


def quantize(x: Array, scale: Array, dtype) -> Array:
    """`clip(x · scale, ±fp8_max)` cast to the fp8 `dtype` (saturating, never inf)."""
    fmax = _fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -fmax, fmax).astype(dtype)


def _dot(a: Array, b: Array, contract: tuple[int, int]) -> Array:
    """2-d product of fp8 operands contracting axes `contract`, fp32 accumulation (native fp8 where available)."""
    dims = (((contract[0],), (contract[1],)), ((), ()))
    return jax.lax.dot_general(a, b, dims, preferred_element_type=jnp.float32)


def _amax(x: Array) -> Array:
    return jnp.max(jnp.abs(x)).astype(jnp.float32)


@jax.custom_vjp
def fp8_dot(x: Array, w: Array, amax_history: Array, scale: Array) -> Array:
    """`x @ w` of float32 `x` `(..., d_in)` and `w` `(d_in, d_out)`, both quantised to e4m3 by
    `scale[INPUT]`, `scale[WEIGHT]`; float32 result.

    Differentiating it quantises the output gradient to e5m2 by `scale[GRAD]`
    and returns, as the cotangent of `amax_history`, the next history (see the
    module docstring); the cotangent of `scale` is zero.
    """
    xq, wq = quantize(x, scale[INPUT], E4M3), quantize(w, scale[WEIGHT], E4M3)
    return _matmul(xq, wq) / (scale[INPUT] * scale[WEIGHT])


def _matmul(xq: Array, wq: Array) -> Array:
    lead = xq.shape[:-1]
    return _dot(xq.reshape(-1, xq.shape[-1]), wq, (1, 0)).reshape(*lead, wq.shape[-1])


def _fp8_dot_fwd(x, w, amax_history, scale):
    xq, wq = quantize(x, scale[INPUT], E4M3), quantize(w, scale[WEIGHT], E4M3)
    y = _matmul(xq, wq) / (scale[INPUT] * scale[WEIGHT])
    return y, (xq, wq, _amax(x), _amax(w), amax_history, scale)


def _fp8_dot_bwd(res, g):
    xq, wq, ax, aw, amax_history, scale = res
    gq = quantize(g, scale[GRAD], E5M2)
    g2 = gq.reshape(-1, gq.shape[-1])
    x2 = xq.reshape(-1, xq.shape[-1])
    dx = _dot(g2, wq, (1, 1)) / (scale[GRAD] * scale[WEIGHT])
    dw = _dot(x2, g2, (0, 0)) / (scale[INPUT] * scale[GRAD])
    observed = jnp.stack([ax, aw, _amax(g)])
    new_history = jnp.roll(amax_history, 1, axis=-1).at[:, 0].set(observed)
    return dx.reshape(xq.shape), dw, new_history, jnp.zeros_like(scale)


fp8_dot.defvjp(_fp8_dot_fwd, _fp8_dot_bwd)


@register_apply(Fp8Linear)
def apply_fp8_linear(params: Fp8Linear, x: Array) -> Array:
    """`x @ weight + bias` through `fp8_dot`; the result has the dtype of `x`."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(
            f"Fp8Linear: the input x must be floating to be scaled to e4m3, received dtype {x.dtype} "
            f"with shape {tuple(x.shape)}; embed integer tokens first or cast with `.astype(jnp.float32)`."
        )
    check_last_dim("Fp8Linear", x, params.d_in)
    w = params.weight.astype(jnp.float32)
    y = fp8_dot(x.astype(jnp.float32), w, params.amax_history, params.scale).astype(x.dtype)
    if params.bias is not None:
        y = y + params.bias.astype(x.dtype)
    return y


def _is_fp8(x) -> bool:
    return isinstance(x, Fp8Linear)


def fp8_update(params: PyTree, grads: PyTree, *, count: int = 1) -> PyTree:
    """`params` with each `Fp8Linear`'s history overwritten by its gradient (divided by `count`) and
    its scales recomputed from the new history.

    `grads` has the structure of `params` (what `jax.grad` or
    `sxvalue_and_grad` returns for them); `count` is how many times each layer
    ran in the step (the number of microbatches of a pipelined step).
    """
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ValueError(
            f"fp8_update: count must be an int >= 1 (uses of each layer in the step, e.g. the number "
            f"of microbatches), received count={count!r}."
        )
    if not any(_is_fp8(x) for x in jax.tree.leaves(params, is_leaf=_is_fp8)):
        raise ValueError(
            f"fp8_update: params of type {type(params).__name__} hold no Fp8Linear layers; "
            "convert Linear layers with Fp8Linear.from_linear first."
        )

    def one(p, g):
        if not _is_fp8(p):
            return p
        history = (g.amax_history / count).astype(jnp.float32)
        return eqx.tree_at(
            lambda l: (l.amax_history, l.scale), p, (history, compute_scale(history, p.margin))
        )

    return jax.tree.map(one, params, grads, is_leaf=_is_fp8)


def fp8_meta_mask(params: PyTree) -> PyTree:
    """Bools with the structure of `params`: True at the `amax_history`/`scale` leaves of `Fp8Linear` layers.

    Partition the gradients with it so the optimizer never sees the scaling state.
    """

    def mark(x):
        if _is_fp8(x):
            flags = jax.tree.map(lambda _: False, x)
            return eqx.tree_at(lambda l: (l.amax_history, l.scale), flags, (True, True))
        return jax.tree.map(lambda _: False, x)

    return jax.tree.map(mark, params, is_leaf=_is_fp8)
