"""Eager normalisation layers with batch or per-example statistics: BatchNorm1d/2d,
GroupNorm, InstanceNorm (channels-last inputs).

BatchNorm keeps its running statistics in `BatchStat` variables (collection
`"batch_stats"`). In `train()` mode a call normalises with the batch's
statistics and writes the updated running ones, so a jitted training step
needs `spx.jit(mutable="batch_stats")` (with whatever else it updates); in
`eval()` mode it uses the running statistics and writes nothing.
"""

from __future__ import annotations

from typing import Any, Unpack

import jax

import spectrax_core as sc

from .._graph.variable import Variable
from ._base import CoreLayer, LayerOptions, also_named, annotate


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
        sharding: Any = None,
        bias_sharding: Any = None,
        stats_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        where = type(self).__name__
        self._build(num_features, eps=eps, momentum=momentum, affine=affine, options=options, constant=True)
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
        sharding: Any = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        self._build(num_groups, num_channels, eps=eps, affine=affine, options=options, constant=True)
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
        sharding: Any = None,
        bias_sharding: Any = None,
        **options: Unpack[LayerOptions],
    ):
        self._build(num_features, eps=eps, affine=affine, options=options, constant=True)
        annotate(self, "InstanceNorm", scale=sharding, bias=bias_sharding)
