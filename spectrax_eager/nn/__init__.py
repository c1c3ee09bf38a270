"""Eager layers: stateful views of `spectrax_core.nn` (the math is always the core's)."""

from ._activations import GELU, Identity, ReLU, Sigmoid, SiLU, Tanh
from ._attention import CausalSelfAttention, MLPBlock, MultiheadAttention
from ._base import CoreLayer, from_core
from ._containers import (
    ModuleDict,
    ModuleList,
    ParameterList,
    PipelineSequential,
    Sequential,
    StackedModuleList,
)
from ._conv import Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d
from ._fp8 import Fp8Linear, Fp8Meta, fp8_update, to_fp8
from ._general import Bilinear, DenseGeneral, Einsum
from ._layers import (
    MLP,
    Attention,
    Block,
    Dropout,
    Embed,
    GatedMLP,
    LayerNorm,
    Linear,
    RMSNorm,
)
from ._lora import LoRALinear, LoRAParam, inject_lora, merge_lora, wrap_lora
from ._norms import BatchNorm1d, BatchNorm2d, BatchStat, GroupNorm, InstanceNorm
from ._pooling import (
    AdaptiveAvgPool1d,
    AdaptiveAvgPool2d,
    AvgPool1d,
    AvgPool2d,
    AvgPool3d,
    MaxPool1d,
    MaxPool2d,
    MaxPool3d,
)
from ._recurrent import RNN, GRUCell, LSTMCell, SimpleRNNCell

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
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "AvgPool3d",
    "BatchNorm1d",
    "BatchNorm2d",
    "BatchStat",
    "Bilinear",
    "CausalSelfAttention",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "DenseGeneral",
    "Einsum",
    "GELU",
    "GRUCell",
    "GroupNorm",
    "Identity",
    "InstanceNorm",
    "LSTMCell",
    "MLPBlock",
    "MaxPool1d",
    "MaxPool2d",
    "MaxPool3d",
    "MultiheadAttention",
    "ParameterList",
    "RNN",
    "ReLU",
    "SiLU",
    "Sigmoid",
    "SimpleRNNCell",
    "StackedModuleList",
    "Tanh",
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
