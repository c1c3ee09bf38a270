"""Pre-norm transformer block: `x + attn(norm1(x))`, then `x + mlp(norm2(x))`."""

from __future__ import annotations

from typing import Unpack

import equinox as eqx
import jax
from jaxtyping import Array, PRNGKeyArray

from ._composite import Composite
from .._apply import apply, register_apply
from .._checks import check_last_dim
from ._attention import Attention, KVCache
from ._mlp import MLP, GatedMLP
from ._norm import LayerNorm, RMSNorm
from ._options import ParamOptions, with_options
from ._validate import check_ndim

_NORMS = {"layer": LayerNorm, "rms": RMSNorm}


class Block(Composite):
    """Parameters of one pre-norm transformer block.

    The defaults are the classic block (LayerNorm, GELU MLP, no RoPE);
    `norm="rms", gated=True, rope=True` gives a LLaMA-style block.
    """

    norm1: LayerNorm | RMSNorm
    attn: Attention
    norm2: LayerNorm | RMSNorm
    mlp: MLP | GatedMLP
    d_model: int = eqx.field(static=True)

    @with_options
    def init(
        cls,
        key: PRNGKeyArray,
        d_model: int,
        n_heads: int,
        d_ff: int,
        *,
        n_kv_heads: int | None = None,
        head_dim: int | None = None,
        causal: bool = True,
        rope: bool = False,
        rope_theta: float = 10000.0,
        norm: str = "layer",
        eps: float | None = None,
        gated: bool = False,
        activation: str | None = None,
        use_bias: bool = False,
        **options: Unpack[ParamOptions],
    ) -> "Block":
        """Build the block's layers. `norm` is "layer" or "rms"; `gated` picks `GatedMLP`
        over `MLP`; `activation`/`eps` default to the chosen layer's own default. `w_init` /
        `b_init` initialise every projection; `compute_dtype` goes to every layer."""
        if norm not in _NORMS:
            raise ValueError(f"Block: norm must be one of {sorted(_NORMS)}, received {norm!r}.")
        k_attn, k_mlp = jax.random.split(key)
        norm_cls = _NORMS[norm]
        norm_kw = {"dtype": options["dtype"], "compute_dtype": options["compute_dtype"]}
        if eps is not None:
            norm_kw["eps"] = eps
        attn_kw = {
            "n_kv_heads": n_kv_heads,
            "head_dim": head_dim,
            "rope_theta": rope_theta,
            "use_bias": use_bias,
        }
        mlp_cls = GatedMLP if gated else MLP
        mlp_kw = {"use_bias": use_bias, **options}
        if activation is not None:
            mlp_kw["activation"] = activation
        return cls(
            norm1=norm_cls.init(None, d_model, **norm_kw),
            attn=Attention.init(k_attn, d_model, n_heads, causal=causal, rope=rope, **attn_kw, **options),
            norm2=norm_cls.init(None, d_model, **norm_kw),
            mlp=mlp_cls.init(k_mlp, d_model, d_ff, **mlp_kw),
            d_model=d_model,
        )

    def init_cache(self, batch: int, max_len: int, *, dtype=None) -> KVCache:
        """An empty `KVCache` for this block's attention."""
        return self.attn.init_cache(batch, max_len, dtype=dtype)


@register_apply(Block)
def apply_block(
    params: Block,
    x: Array,
    *,
    mask: Array | None = None,
    cache: KVCache | None = None,
    positions: Array | None = None,
) -> Array | tuple[Array, KVCache]:
    """Run the block on `x` of shape `(batch, length, d_model)`.

    `mask`, `cache` and `positions` go to the attention (see `apply_attention`); with a cache
    the result is `(y, new_cache)`. Each sub-layer checks its own typed math.
    """
    check_ndim("Block", x, 3, "(batch, length, d_model)")
    check_last_dim("Block", x, params.d_model)
    h = apply(params.norm1, x)
    if cache is None:
        x = x + apply(params.attn, h, mask=mask, positions=positions)
    else:
        attn_out, cache = apply(params.attn, h, mask=mask, cache=cache, positions=positions)
        x = x + attn_out
    x = x + apply(params.mlp, apply(params.norm2, x))
    return x if cache is None else (x, cache)
