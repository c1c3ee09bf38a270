"""Functional layers: each a typed params class with `init`, run by `spectrax_core.apply`."""

from ._attention import Attention, KVCache, dot_product_attention, rope
from ._block import Block
from ._conv import Conv1d, Conv2d
from ._dropout import Dropout
from ._embed import Embed, attend
from ._linear import Linear
from ._mlp import ACTIVATIONS, MLP, GatedMLP
from ._norm import LayerNorm, RMSNorm
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
]
