"""Eager normalisation layers with batch or per-example statistics: BatchNorm1d/2d,
GroupNorm, InstanceNorm (channels-last inputs).

BatchNorm keeps its running statistics in `BatchStat` variables (collection
`"batch_stats"`). In `train()` mode a call normalises with the batch's
statistics and writes the updated running ones, so a jitted training step
needs `spx.jit(mutable="batch_stats")` (with whatever else it updates); in
`eval()` mode it uses the running statistics and writes nothing.
"""

from __future__ import annotations

from typing import Any

import jax

import spectrax_core as sc

from .._graph.rngs import Rngs
from .._graph.variable import Variable
from ._base import PARAM_DTYPE, CoreLayer, also_named, annotate, dtype_kwargs, init_key


class BatchStat(Variable):
    """Running statistics of a normalisation layer: collection `"batch_stats"`, not trained."""

    __slots__ = ()
    default_kind = "batch_stats"


class _BatchNorm(CoreLayer):
    core_cls = sc.nn.BatchNorm
    variable_types = {"mean": BatchStat, "var": BatchStat}
    ranks: tuple[int, ...] = ()  # accepted input ranks; () = any (`from_core` of a core BatchNorm)

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float = 0.1,
        affine: bool = True,
        *,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        rngs: Rngs | None = None,
        sharding: Any = None,
        bias_sharding: Any = None,
        stats_sharding: Any = None,
    ):
        where = type(self).__name__
        self._adopt(
            sc.nn.BatchNorm.init(
                init_key(rngs, where, w_init, b_init),
                num_features,
                eps=eps,
                momentum=momentum,
                affine=affine,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )
        annotate(self, where, scale=sharding, bias=bias_sharding, mean=stats_sharding, var=stats_sharding)

    def forward(self, x: jax.Array, *, use_running_average: bool | None = None) -> jax.Array:
        """Normalise `x`; `use_running_average` overrides the mode (default: `not self.training`)."""
        if self.ranks and x.ndim not in self.ranks:
            raise ValueError(
                f"{type(self).__name__}: expected an input of rank {' or '.join(map(str, self.ranks))} "
                f"(channels last), received shape {tuple(x.shape)}."
            )
        running = (not self.training) if use_running_average is None else use_running_average
        if running:
            return sc.apply(self.core_params(), x)
        y, updated = sc.apply(self.core_params(), x, training=True)
        self.mean.value = updated.mean
        self.var.value = updated.var
        return y


class BatchNorm1d(_BatchNorm):
    """Batch normalisation of `(batch, channels)` or `(batch, length, channels)`."""

    ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    """Batch normalisation of `(batch, height, width, channels)`."""

    ranks = (4,)


class GroupNorm(CoreLayer):
    """Group normalisation: `num_channels` (last axis) in `num_groups` groups, per example."""

    core_cls = sc.nn.GroupNorm

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        *,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        rngs: Rngs | None = None,
        sharding: Any = None,
        bias_sharding: Any = None,
    ):
        self._adopt(
            sc.nn.GroupNorm.init(
                init_key(rngs, "GroupNorm", w_init, b_init),
                num_groups,
                num_channels,
                eps=eps,
                affine=affine,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )
        annotate(self, "GroupNorm", scale=sharding, bias=bias_sharding)


@also_named(num_channels="num_features")
class InstanceNorm(CoreLayer):
    """Instance normalisation: each channel of each example over the spatial axes
    (`(batch, *spatial, channels)`); not affine by default, as PyTorch."""

    core_cls = sc.nn.InstanceNorm

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        affine: bool = False,
        *,
        dtype: Any = None,
        param_dtype: Any = PARAM_DTYPE,
        w_init: Any = None,
        b_init: Any = None,
        rngs: Rngs | None = None,
        sharding: Any = None,
        bias_sharding: Any = None,
    ):
        self._adopt(
            sc.nn.InstanceNorm.init(
                init_key(rngs, "InstanceNorm", w_init, b_init),
                num_features,
                eps=eps,
                affine=affine,
                **dtype_kwargs(dtype, param_dtype, w_init, b_init),
            )
        )
        annotate(self, "InstanceNorm", scale=sharding, bias=bias_sharding)
