"""`LengthBuckets`: a batch whose rows have their own lengths, run as microbatches padded only to
their length bucket.

A training step (`sxvalue_and_grad`, `sxgrad`, `sxvalue_and_grad_and_apply`, `run`, `runner`,
`Runner`, the eager `spx.run`) takes the batch as a JAX user already holds it: every row padded to
the batch's longest (the padded length) and an integer array with each row's length (an argument,
or a leaf inside one). At each call the rows are
sorted by length (longest first) and cut into the schedule's microbatches, each the same number of
rows; a microbatch is cut along the sequence axis to the smallest bucket that holds its longest
row. Every (stage, cell kind, bucket) is one compiled program, and the schedule runs the
microbatches of different lengths in one pipelined step (`spectrax_mpmd._plan.buckets`), in the
order its simulation with each cell's own cost (`CellCost`) says finishes first.

The loss and gradients are those of the function on the padded batch, provided a row's values past
its length change nothing the loss reads (a causal model, a loss masked by the lengths): the
contract of padding itself.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from spectrax_core.schedules import StageCost, simulate

from .errors import MpmdError

ORDERS = ("auto", "longest_first", "shortest_first")
KINDS = "FBIW"


@dataclass(frozen=True)
class LengthBuckets:
    """Run a step's microbatches at their own length (see the module docstring).

    `lengths`: where each row's length is (integers `[rows]`, a batch leaf): the position or
    parameter name of the argument holding it, or a path into an argument, `(argument, key, ...)`
    (`("targets", "lengths")`: the `"lengths"` entry of the argument `targets`).
    `sizes`: the bucket lengths, ascending (default: powers of two; the padded length is always a
    bucket). `axis`: the sequence axis of the padded batch leaves; a batch leaf is cut along it
    when its size there is the padded length (the largest among the batch leaves). `order`: which
    microbatch the schedule runs first: `"longest_first"`, `"shortest_first"`, or `"auto"` (the
    one the schedule's simulation with each microbatch's cost proportional to its length finishes
    first); the loss and gradients do not depend on it beyond float rounding.
    """

    lengths: int | str | tuple
    sizes: tuple[int, ...] | None = None
    axis: int = 1
    order: str = "auto"

    def __post_init__(self):
        where = self.lengths if isinstance(self.lengths, tuple) else (self.lengths,)
        argument = where[0] if where else None
        if (
            isinstance(argument, bool)
            or not isinstance(argument, int | str)
            or (isinstance(argument, int) and argument < 0)
        ):
            raise MpmdError(
                f"LengthBuckets: lengths must say where each row's length is: the position (an int >= 0) "
                f"or name of its argument, or a path (argument, key, ...), got {self.lengths!r}."
            )
        if self.sizes is not None:
            sizes = tuple(int(s) for s in self.sizes)
            if not sizes or any(s < 1 for s in sizes) or list(sizes) != sorted(set(sizes)):
                raise MpmdError(
                    f"LengthBuckets: sizes must be bucket lengths >= 1 in ascending order without "
                    f"repeats, e.g. (64, 128, 512), got {self.sizes!r}."
                )
            object.__setattr__(self, "sizes", sizes)
        if isinstance(self.axis, bool) or not isinstance(self.axis, int) or self.axis < 1:
            raise MpmdError(
                f"LengthBuckets: axis must be the sequence axis of the batch leaves (>= 1; axis 0 is "
                f"the rows), got {self.axis!r}."
            )
        if self.order not in ORDERS:
            raise MpmdError(f"LengthBuckets: order must be one of {ORDERS}, got {self.order!r}.")

    def path(self, name: str, names: list[str]) -> tuple:
        """Where the lengths are in a call of a function whose positional parameters are `names`,
        as `(position, key, ...)`."""
        argument, *keys = self.lengths if isinstance(self.lengths, tuple) else (self.lengths,)
        if isinstance(argument, str):
            if argument not in names:
                raise MpmdError(
                    f"{name}: LengthBuckets(lengths={self.lengths!r}) names the argument {argument!r}, but "
                    f"the function's positional parameters are {names}; name one of them "
                    "(or give its position)."
                )
            argument = names.index(argument)
        return (argument, *keys)

    def bucket(self, length: int, padded: int) -> int:
        """The length a microbatch whose longest row is `length` is padded to."""
        if self.sizes is None:
            size = 1 << max(int(length) - 1, 0).bit_length()
        else:
            size = next((s for s in self.sizes if s >= length), padded)
        return min(size, padded)


def key_path(path) -> tuple:
    """A JAX key path (`jax.tree_util.tree_flatten_with_path`) as the keys it indexes with."""
    return tuple(getattr(e, "idx", getattr(e, "key", getattr(e, "name", e))) for e in path)


def check_length_buckets(settings) -> None:
    """Refuse `settings` (a `StepSettings`) whose `length_buckets` the step cannot run."""
    name, buckets = settings.name, settings.length_buckets
    if not isinstance(buckets, LengthBuckets):
        raise MpmdError(
            f"{name}: length_buckets must be a LengthBuckets (e.g. LengthBuckets(lengths=2)), "
            f"got {type(buckets).__name__}."
        )
    if settings.mode != "train" or settings.reduce == "mean" or settings.microbatch_weight_fn is not None:
        raise MpmdError(
            f"{name}: length_buckets runs a training step whose loss is the whole batch's (proven "
            "exact, or reduce='sum'); microbatches of different lengths have no common mean or "
            "weight. Drop reduce='mean' / microbatch_weight_fn, or length_buckets."
        )
    if (settings.schedule is None and settings.microbatches == 1) or settings.has_aux:
        raise MpmdError(
            f"{name}: length_buckets needs microbatches (schedule=, or microbatches= where the entry "
            "point takes it) and a function without aux outputs (has_aux=False): a microbatch's "
            "outputs other than the loss change shape with its length."
        )
    if settings.mesh is not None and not settings.pipelined:
        raise MpmdError(
            f"{name}: length_buckets runs a pipelined step's microbatches at their own lengths, and "
            "this mesh has no pipeline axis (one SPMD program of one shape); drop length_buckets, or "
            "use a mesh with mpmd_axis='pp'."
        )
    if settings.stage_sizes == "auto":
        raise MpmdError(
            f"{name}: stage_sizes='auto' balances the stages on one profiled shape; with length_buckets "
            "give the block counts (e.g. the `balance.sizes` of a run on the padded batch)."
        )


@dataclass(frozen=True)
class MicrobatchRows:
    """Which rows of the padded batch each microbatch holds (in schedule order), and its length."""

    rows: tuple
    lengths: tuple[int, ...]

    @property
    def buckets(self) -> tuple[int, ...]:
        """The distinct microbatch lengths, longest first."""
        return tuple(sorted(set(self.lengths), reverse=True))

    def reversed(self) -> MicrobatchRows:
        """The same microbatches in the opposite order."""
        return MicrobatchRows(self.rows[::-1], self.lengths[::-1])


def split_rows(buckets: LengthBuckets, lengths, padded: int, microbatches: int, name: str) -> MicrobatchRows:
    """The rows of each of `microbatches` microbatches, sorted by `lengths` longest first, each
    microbatch at its bucket; `padded` is the padded length."""
    if not hasattr(lengths, "__array__"):  # a jax.ShapeDtypeStruct (e.g. given to `prepare`)
        raise MpmdError(
            f"{name}: with length_buckets the plan depends on each row's length, so the lengths "
            f"(LengthBuckets(lengths={buckets.lengths})) must be an array of values, got "
            f"{type(lengths).__name__}; pass the batch's real lengths (the other arguments may stay "
            "jax.ShapeDtypeStruct)."
        )
    lengths = np.asarray(lengths)
    if lengths.ndim != 1 or not np.issubdtype(lengths.dtype, np.integer):
        raise MpmdError(
            f"{name}: LengthBuckets(lengths={buckets.lengths}) names the argument with each row's length, "
            f"which must be integers [rows]; got {lengths.dtype}{list(lengths.shape)}."
        )
    if lengths.size and (lengths.min() < 0 or lengths.max() > padded):
        raise MpmdError(
            f"{name}: every row length must be between 0 and the padded length {padded}; got lengths "
            f"from {lengths.min()} to {lengths.max()}. Pad the batch to its longest row."
        )
    order = np.argsort(-lengths, kind="stable")
    rows = np.split(order, microbatches)
    return MicrobatchRows(
        tuple(rows), tuple(buckets.bucket(int(lengths[r].max(initial=0)), padded) for r in rows)
    )


@dataclass(frozen=True)
class CellCost(StageCost):
    """A `StageCost` whose cells each take their own seconds: `cells[(kind, stage, microbatch)]`
    (0 for a cell that does not run: the loss stage's B, fused into its F)."""

    cells: Mapping = field(default_factory=dict)

    def of(self, cell) -> float:
        return float(sum(self.cells.get((a.kind, a.stage, a.microbatch), 0.0) for a in cell.parts))

    @classmethod
    def of_cells(cls, cells: Mapping, stages: int) -> CellCost:
        zeros = (0.0,) * stages
        return cls(zeros, zeros, zeros, zeros, 0.0, dict(cells))


def scaled_unit_cost(schedule, n: int, lengths) -> CellCost:
    """Each cell of `schedule` on `n` ranks at its kind's unit cost (F = I = W = 1, B = 2) times its
    microbatch's length over the longest."""
    stages, top = schedule.num_stages(n), max(lengths)
    unit = {"F": 1.0, "B": 2.0, "I": 1.0, "W": 1.0}
    cells = {
        (k, s, i): unit[k] * length / top
        for k in KINDS
        for s in range(stages)
        for i, length in enumerate(lengths)
    }
    return CellCost.of_cells(cells, stages)


def simulated_step(schedule, n: int, lengths) -> float:
    """The simulated step of `schedule` on `n` ranks with microbatch `i` at `lengths[i]`
    (`scaled_unit_cost`), in unit-cost time."""
    return simulate(schedule, n, scaled_unit_cost(schedule, n, lengths)).makespan


def in_order(buckets: LengthBuckets, rows: MicrobatchRows, schedule, n: int) -> MicrobatchRows:
    """`rows` (sorted longest first) in the order `buckets.order` says: for `"auto"` the order whose
    step simulated on `n` ranks is shorter (`simulated_step`; longest first on a tie). The rows
    are the same either way; the loss and gradients are sums over the microbatches, so the order
    changes them by float rounding only."""
    if buckets.order == "auto":
        lengths = rows.lengths
        first = simulated_step(schedule, n, lengths) <= simulated_step(schedule, n, lengths[::-1])
    else:
        first = buckets.order == "longest_first"
    return rows if first else rows.reversed()
