"""Functional layers: each a typed params class with `init`, run by `spectrax_core.apply`."""

from ._attention import Attention, KVCache, dot_product_attention, rope
from ._batchnorm import BatchNorm, GroupNorm, InstanceNorm, group_norm
from ._block import Block
from ._conv import (
    Conv1d,
    Conv2d,
    Conv3d,
    ConvTranspose1d,
    ConvTranspose2d,
    ConvTranspose3d,
    conv,
    conv_transpose,
)
from ._dropout import Dropout
from ._einsum import Bilinear, DenseGeneral, Einsum
from ._embed import Embed, attend
from ._fp8 import GRAD, INPUT, WEIGHT, Fp8Linear, compute_scale, fp8_dot, fp8_meta_mask, fp8_update, quantize
from ._linear import Linear
from ._lora import LoRA, inject_lora, lora_mask, merge_lora
from ._mha import MultiHeadAttention
from ._mlp import ACTIVATIONS, MLP, GatedMLP
from ._norm import LayerNorm, RMSNorm
from ._pool import adaptive_avg_pool, avg_pool, max_pool
from ._recurrent import GRUCell, LSTMCell, SimpleRNNCell, rnn
from ._sdpa import scaled_dot_product_attention
from ._stack import BlockStack

__all__ = [
    "ACTIVATIONS",
    "Attention",
    "Block",
    "BlockStack",
    "Conv1d",
    "Conv2d",
    "Dropout",
    "Embed",
    "GatedMLP",
    "KVCache",
    "LayerNorm",
    "Linear",
    "MLP",
    "RMSNorm",
    "attend",
    "dot_product_attention",
    "rope",
    "LoRA",
    "inject_lora",
    "lora_mask",
    "merge_lora",
    "Fp8Linear",
    "GRAD",
    "INPUT",
    "WEIGHT",
    "compute_scale",
    "fp8_dot",
    "fp8_meta_mask",
    "fp8_update",
    "quantize",
    "BatchNorm",
    "Bilinear",
    "Conv3d",
    "ConvTranspose1d",
    "ConvTranspose2d",
    "ConvTranspose3d",
    "DenseGeneral",
    "Einsum",
    "GRUCell",
    "GroupNorm",
    "InstanceNorm",
    "LSTMCell",
    "MultiHeadAttention",
    "SimpleRNNCell",
    "adaptive_avg_pool",
    "avg_pool",
    "conv",
    "conv_transpose",
    "group_norm",
    "max_pool",
    "rnn",
    "scaled_dot_product_attention",
]
