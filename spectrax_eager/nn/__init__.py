"""Eager layers: stateful views of `spectrax_core.nn` (the math is always the core's)."""

from ._base import CoreLayer, from_core
from ._containers import ModuleDict, ModuleList, PipelineSequential, Sequential
from ._fp8 import Fp8Linear, Fp8Meta, fp8_update, to_fp8
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
from ._lora import LoRALinear, LoRAParam, inject_lora, merge_lora, wrap_lora

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
    "Fp8Linear",
    "Fp8Meta",
    "LoRALinear",
    "LoRAParam",
    "fp8_update",
    "inject_lora",
    "merge_lora",
    "to_fp8",
    "wrap_lora",
]
