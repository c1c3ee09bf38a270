"""Typed names of a plan's buffers, cells and outputs.

Every buffer slot of a plan is named by one of these keys while the plan is
built (`Plan.slot_names` keeps them); measurements classify buffers by their
key's type. Keys of different types never compare equal. Cell kinds, input
kinds and output names are string enums: each equals (and hashes as) its text,
the form tables and measurements print.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple


class CellKind(StrEnum):
    """What a cell computes for one stage and microbatch."""

    FORWARD = "F"
    BACKWARD = "B"  # the whole backward
    INPUT_GRAD = "I"  # the backward's input-gradient half
    WEIGHT_GRAD = "W"  # the backward's weight-gradient half
    LOSS = "FB"  # the loss stage's forward and backward in one program


class InputKind(StrEnum):
    """How an argument leaf enters a plan."""

    PARAM = "param"  # differentiated
    FIXED = "fixed"  # broadcast
    BATCH = "batch"  # split into microbatches
    AFTER = "input"  # read only after the backward (an optimizer state's leaf)


class Output(StrEnum):
    """The names of a plan's output slots (`Plan.output_slots`)."""

    LOSS = "loss"  # the loss, summed over microbatches
    AUX = "aux"  # output -> stacked auxiliary results
    GRADS = "grads"  # parameter leaf -> its gradient
    RESULTS = "results"  # the function's results (a whole step's plan)
    REPLICATED = "replicated"  # results placed on every rank


class Input(NamedTuple):
    """An argument leaf of kind `kind` placed on a rank."""

    kind: InputKind
    leaf: int
    rank: int


@dataclass(frozen=True)
class MicrobatchIndex:
    """The int32 index of microbatch `microbatch`, placed on `rank` (a constant)."""

    rank: int
    microbatch: int


@dataclass(frozen=True)
class GradAccumulator:
    """Stage `stage`'s gradient accumulator of parameter leaf `leaf`."""

    stage: int
    leaf: int


@dataclass(frozen=True)
class LossAccumulator:
    """The loss summed over the microbatches loss stage `stage` runs (on its rank)."""

    stage: int


@dataclass(frozen=True)
class ZeroGrad:
    """The zero gradient of a parameter leaf that no stage reads."""

    leaf: int


@dataclass(frozen=True)
class StageOutput:
    """Stage `stage`'s edge output `output` for one microbatch, on the producing rank."""

    stage: int
    output: int
    microbatch: int


@dataclass(frozen=True)
class Result:
    """The function's output `output` (not the loss) for one microbatch."""

    output: int
    microbatch: int


@dataclass(frozen=True)
class Residual:
    """Residual `k` a stage's forward saves for its backward, per microbatch."""

    stage: int
    microbatch: int
    k: int


@dataclass(frozen=True)
class Stash:
    """Value `k` a stage's I cell stashes for its W cell, per microbatch."""

    stage: int
    microbatch: int
    k: int


@dataclass(frozen=True)
class Offloaded:
    """A saved value kept in host memory until its reader: residual `k` (`kind="residuals"`) or
    stash value `k` (`kind="stash"`) of stage `stage`, per microbatch."""

    kind: str
    stage: int
    microbatch: int
    k: int


@dataclass(frozen=True)
class Activation:
    """The value edge `edge` carries, received on its consumer's rank."""

    edge: int
    microbatch: int


@dataclass(frozen=True)
class InputCotangent:
    """The cotangent of edge `edge`'s value, made by its consumer's backward."""

    edge: int
    microbatch: int


@dataclass(frozen=True)
class Cotangent:
    """The cotangent of edge `edge`'s value, received on its producer's rank."""

    edge: int
    microbatch: int
