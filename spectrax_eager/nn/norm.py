"""`spectrax_eager.nn.norm`: `spectrax-lib`'s module path `spectrax.nn.norm`, holding layers
(`spx.nn`'s)."""

from ._layers import LayerNorm, RMSNorm
from ._norms import BatchNorm1d, BatchNorm2d, GroupNorm, InstanceNorm

__all__ = ["BatchNorm1d", "BatchNorm2d", "GroupNorm", "InstanceNorm", "LayerNorm", "RMSNorm"]
