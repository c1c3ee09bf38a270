"""`spx.common_types`: names for annotating arrays' axes, and the types they are written with.

The tensor names are logical names: `spx.PartitionAxis` (and so `PartitionManager`)
maps each of them to mesh axes (`BATCH`, `EMBED`, ... are also the names
`Rules.default()` maps; the others, `QUERY_LENGTH`, `HEAD_DIM`, ..., are mapped
by a `PartitionAxis`' fields and are unsharded elsewhere). The parallelism
names are the mesh axes' own names, which stand for themselves in an
annotation. Modes are the `mode=` values of `spx.sharding.logical_axis_rules`.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax

from spectrax_core.sharding import BATCH, EMBED, EXPERT, HEAD, KV_HEAD, LENGTH, MLP, VOCAB

from ._compat.paths import not_built
from ._sharding.specs import (
    AttnKVSharding,
    AttnQSharding,
    ColumnWise,
    ExpertActivations,
    ExpertColumnWise,
    ExpertRowWise,
    HiddenStateSharding,
    Replicated,
    RowWise,
)

Array = jax.Array
PRNGKey = jax.Array
DType = jax.typing.DTypeLike
Shape = Sequence[int]
Mesh = jax.sharding.Mesh
AxisNames = tuple[str, ...]
AxisIdxes = tuple[int, ...]
AxisType = tuple[str, ...] | str | None

#: An axis left unsharded.
EMPTY = None
MLP_INTERMEDIATE = MLP
QUERY_LENGTH = "QUERY_LENGTH"
KV_LENGTH = "KV_LENGTH"
HEAD_DIM = "HEAD_DIM"
KV_HEAD_DIM = "KV_HEAD_DIM"
EXPERT_GATE = "EXPERT_GATE"
BIAS_HEAD_SEQ = "BIAS_HEAD_SEQ"
BIAS_KV_SEQ = "BIAS_KV_SEQ"

PIPELINE_PARALLEL = PP = "pp"
DATA_PARALLEL = DP = "dp"
FULLY_SHARDED_DATA_PARALLEL = FSDP = "fsdp"
TENSOR_PARALLEL = TP = "tp"
EXPERT_PARALLEL = EP = "ep"
SEQUENCE_PARALLEL = SP = "sp"

MODE_TRAIN = "train"
MODE_DECODE = "decode"

__getattr__ = not_built(
    __name__,
    "the modes here are MODE_TRAIN and MODE_DECODE, and the sharding presets those of spx.sharding "
    "(ColumnWise, RowWise, HiddenStateSharding, ...)",
)

__all__ = [
    "Array",
    "AttnKVSharding",
    "AttnQSharding",
    "AxisIdxes",
    "AxisNames",
    "AxisType",
    "BATCH",
    "BIAS_HEAD_SEQ",
    "BIAS_KV_SEQ",
    "ColumnWise",
    "DATA_PARALLEL",
    "DP",
    "DType",
    "EMBED",
    "EMPTY",
    "EP",
    "EXPERT",
    "EXPERT_GATE",
    "EXPERT_PARALLEL",
    "ExpertActivations",
    "ExpertColumnWise",
    "ExpertRowWise",
    "FSDP",
    "FULLY_SHARDED_DATA_PARALLEL",
    "HEAD",
    "HEAD_DIM",
    "HiddenStateSharding",
    "KV_HEAD",
    "KV_HEAD_DIM",
    "KV_LENGTH",
    "LENGTH",
    "MLP_INTERMEDIATE",
    "MODE_DECODE",
    "MODE_TRAIN",
    "Mesh",
    "PIPELINE_PARALLEL",
    "PP",
    "PRNGKey",
    "QUERY_LENGTH",
    "Replicated",
    "RowWise",
    "SEQUENCE_PARALLEL",
    "SP",
    "Shape",
    "TENSOR_PARALLEL",
    "TP",
    "VOCAB",
]
