"""`PartitionAxis`: which mesh axes each kind of array axis is split over, written as named fields
(the form of `spectrax-lib`); `rules()` turns it into the core's `Rules`."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from spectrax_core.sharding import BATCH, EMBED, EXPERT, HEAD, KV_HEAD, LENGTH, MLP, VOCAB, Rules

MeshAxes = str | Sequence[str] | None

_DERIVED: Any = "derived"  # a field left to its default: computed from the role fields

#: Logical names beyond the core's tokens that `PartitionAxis` maps (see `spx.common_types`),
#: each with the field that says its mesh axes.
EXTRA_NAMES = {
    "QUERY_LENGTH": "query_sequence_axis",
    "KV_LENGTH": "key_sequence_axis",
    "HEAD_DIM": "attention_dim_axis",
    "KV_HEAD_DIM": "attention_kv_dim_axis",
    "EXPERT_GATE": "expert_gate_axis",
    "BIAS_HEAD_SEQ": "bias_head_sequence_axis",
    "BIAS_KV_SEQ": "bias_key_sequence_axis",
}


@dataclasses.dataclass(frozen=True)
class PartitionAxis:
    """Which mesh axes each kind of array axis is split over, per mode.

    The role fields name the mesh axes (`data_parallel_axis="dp"`, ...); each
    per-array field is a mesh axis name, a tuple of names, or None, and when
    not given follows the roles: batch over (data, fsdp), sequences over
    sequence, hidden states over fsdp (what `Rules.default()` does: the built-in
    layers annotate weights with `EMBED` and `MLP`), heads / MLP / vocabulary over
    tensor, experts over expert; head dims, expert gates and bias sequences
    unsplit; the `decode_*` fields follow their training fields except the
    sequences and hidden states, unsplit. `mlp_intermediate_axis` and
    `mlp_axis` are one field under two names. `rules()` gives the
    `spectrax_core.sharding.Rules` (the core's tokens and `EXTRA_NAMES`).
    """

    pipeline_parallel_axis: str = "pp"
    data_parallel_axis: str = "dp"
    fully_sharded_data_parallel_axis: str = "fsdp"
    tensor_parallel_axis: str = "tp"
    sequence_parallel_axis: str = "sp"
    expert_parallel_axis: str = "ep"
    batch_axis: MeshAxes = _DERIVED
    sequence_axis: MeshAxes = _DERIVED
    query_sequence_axis: MeshAxes = _DERIVED
    head_axis: MeshAxes = _DERIVED
    kv_head_axis: MeshAxes = _DERIVED
    key_sequence_axis: MeshAxes = _DERIVED
    hidden_state_axis: MeshAxes = _DERIVED
    mlp_intermediate_axis: MeshAxes = _DERIVED
    vocab_axis: MeshAxes = _DERIVED
    expert_axis: MeshAxes = _DERIVED
    expert_gate_axis: MeshAxes = None
    attention_dim_axis: MeshAxes = None
    attention_kv_dim_axis: MeshAxes = None
    bias_head_sequence_axis: MeshAxes = None
    bias_key_sequence_axis: MeshAxes = None
    decode_batch_axis: MeshAxes = _DERIVED
    decode_query_sequence_axis: MeshAxes = None
    decode_head_axis: MeshAxes = _DERIVED
    decode_kv_head_axis: MeshAxes = _DERIVED
    decode_key_sequence_axis: MeshAxes = None
    decode_attention_dim_axis: MeshAxes = None
    decode_attention_kv_dim_axis: MeshAxes = None
    mlp_axis: MeshAxes = _DERIVED
    decode_sequence_axis: MeshAxes = None
    decode_hidden_state_axis: MeshAxes = None

    def __post_init__(self):
        if self.mlp_axis is not _DERIVED and self.mlp_intermediate_axis is not _DERIVED:
            if self.mlp_axis != self.mlp_intermediate_axis:
                raise ValueError(
                    "PartitionAxis: mlp_axis and mlp_intermediate_axis name one field; give one of them."
                )
        mlp = self.mlp_axis if self.mlp_axis is not _DERIVED else self.mlp_intermediate_axis
        tp, sp = self.tensor_parallel_axis, self.sequence_parallel_axis
        derived = {
            "batch_axis": (self.data_parallel_axis, self.fully_sharded_data_parallel_axis),
            "sequence_axis": sp,
            "query_sequence_axis": sp,
            "key_sequence_axis": sp,
            "head_axis": tp,
            "kv_head_axis": tp,
            "hidden_state_axis": self.fully_sharded_data_parallel_axis,
            "vocab_axis": tp,
            "expert_axis": self.expert_parallel_axis,
        }
        for name, value in derived.items():
            if getattr(self, name) is _DERIVED:
                object.__setattr__(self, name, value)
        mlp = tp if mlp is _DERIVED else mlp
        object.__setattr__(self, "mlp_axis", mlp)
        object.__setattr__(self, "mlp_intermediate_axis", mlp)
        for name in ("batch_axis", "head_axis", "kv_head_axis"):
            if getattr(self, "decode_" + name) is _DERIVED:
                object.__setattr__(self, "decode_" + name, getattr(self, name))

    def rules(self) -> Rules:
        """The `Rules` these axes describe (train and decode tables)."""
        train = {
            BATCH: self.batch_axis,
            LENGTH: self.sequence_axis,
            EMBED: self.hidden_state_axis,
            HEAD: self.head_axis,
            KV_HEAD: self.kv_head_axis,
            MLP: self.mlp_axis,
            VOCAB: self.vocab_axis,
            EXPERT: self.expert_axis,
            **{name: getattr(self, field) for name, field in EXTRA_NAMES.items()},
        }
        decode = {
            **train,
            BATCH: self.decode_batch_axis,
            LENGTH: self.decode_sequence_axis,
            EMBED: self.decode_hidden_state_axis,
            HEAD: self.decode_head_axis,
            KV_HEAD: self.decode_kv_head_axis,
            "QUERY_LENGTH": self.decode_query_sequence_axis,
            "KV_LENGTH": self.decode_key_sequence_axis,
            "HEAD_DIM": self.decode_attention_dim_axis,
            "KV_HEAD_DIM": self.decode_attention_kv_dim_axis,
        }
        return Rules(train=train, decode=decode)
