"""Eager layers: stateful views of `spectrax_core.nn` (the math is always the core's)."""

from ._base import CoreLayer, from_core
from ._containers import ModuleDict, ModuleList, PipelineSequential, Sequential
from ._layers import (
    MLP,
    Attention,
    Block,
    Conv1d,
    Conv2d,
    Dropout,
    Embed,
    GatedMLP,
    LayerNorm,
    Linear,
    RMSNorm,
)

__all__ = [
    "Attention",
    "Block",
    "Conv1d",
    "Conv2d",
    "CoreLayer",
    "Dropout",
    "Embed",
    "GatedMLP",
    "LayerNorm",
    "Linear",
    "MLP",
    "ModuleDict",
    "ModuleList",
    "PipelineSequential",
    "RMSNorm",
    "Sequential",
    "from_core",
]
