"""`StepSettings`: what one pipelined step is asked to do, checked once.

Every public entry point (`run`, `runner`, `Runner`, `sxcall`, `sxvalue_and_grad`, `sxgrad`,
`sxvalue_and_grad_and_apply`, `sxjit`, `treduce`, `balance`, `advise`, and the eager
facade's `spx.run` and `spx.sxcall`) builds one on its first line from the keywords it was called with;
everything below it takes the record whole. The record owns each argument's check and
default, so a setting means the same at every layer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

from jax.sharding import Mesh

from spectrax_core.schedules import GPipe, Schedule

from ._buckets import check_length_buckets
from ._mesh import MpmdMesh, as_mpmd_mesh
from ._trace.policy import stage_policies
from .errors import MpmdError

MODES = ("train", "forward")
REDUCTIONS = (None, "mean", "sum")


def _positions(value) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)


@dataclasses.dataclass(frozen=True, eq=False)
class StepSettings:
    """The settings of one pipelined step (see `sxvalue_and_grad` and `run` for each meaning).

    `name` is the entry point the user called (errors name it). `mesh` is as given: an `MpmdMesh`
    or a `jax.sharding.Mesh`, with a pipeline axis (`pipelined`; `pipeline_mesh` is it as an
    `MpmdMesh`) or without (a plain SPMD step).
    `schedule` is None only where `sxstage_region`s name their own; `microbatches` is the
    schedule's. `microbatch_weight_fn` has the signature of the function the step
    differentiates (`run` and `Runner` take it as `w(inputs, targets)`; see `Runner`).
    `argnums` is as the caller wrote it (an int gives one gradient tree); `positions` is it as
    a tuple. `length_buckets` (a `LengthBuckets`) runs each microbatch at its rows' length
    bucket. `stage_sizes` is block counts, `"auto"` or None; `memory_budget` bounds the
    bytes per device `stage_sizes="auto"` and `advise` may plan for; `tx` is the optax update of
    a whole training step.
    """

    name: str
    mesh: Any = None
    schedule: Schedule | None = None
    microbatches: int = 1
    mode: str = "train"
    has_aux: bool = False
    remat: Any = False
    offload: Any = False
    rules: Any = None
    region_ranks: Mapping | None = None
    reduce: str | None = None
    microbatch_weight_fn: Callable | None = None
    argnums: int | tuple[int, ...] = 0
    batch_argnums: tuple[int, ...] | None = None
    static_argnums: tuple[int, ...] = ()
    memory_budget: int | None = None
    tx: Any = None
    stage_sizes: tuple[int, ...] | str | None = None
    length_buckets: Any = None

    @classmethod
    def of(cls, name: str, given: Mapping[str, Any], **more) -> StepSettings:
        """The settings among `given` (an entry point's arguments: its `locals()` on its first
        line; other names are left out) and `more` (settings only: the keywords an entry point
        passes on to the step), checked."""
        fields = {f.name for f in dataclasses.fields(cls)} - {"name"}
        unknown = sorted(set(more) - fields)
        if unknown:
            raise TypeError(
                f"{name}: unexpected keyword argument(s) {unknown}; the step takes {sorted(fields)}."
            )
        return cls(name, **{k: v for k, v in given.items() if k in fields}, **more)

    def __post_init__(self):
        if self.mode not in MODES:
            raise MpmdError(f"{self.name}: mode must be 'train' or 'forward', got {self.mode!r}.")
        if self.schedule is not None and not isinstance(self.schedule, Schedule):
            raise MpmdError(
                f"{self.name}: schedule must be a schedule object (e.g. Std1F1B(microbatches=8)), "
                f"got {self.schedule!r}."
            )
        if self.schedule is not None:
            if self.microbatches not in (1, self.schedule.microbatches):
                raise MpmdError(
                    f"{self.name}: microbatches={self.microbatches} but the schedule has "
                    f"microbatches={self.schedule.microbatches}; give one of them."
                )
            object.__setattr__(self, "microbatches", self.schedule.microbatches)
        self._check_loss_settings()
        stage_policies(self.remat, self.offload, None)  # bad values fail now
        object.__setattr__(self, "static_argnums", _positions(self.static_argnums))
        if self.batch_argnums is not None:
            object.__setattr__(self, "batch_argnums", _positions(self.batch_argnums))
        self._check_stage_sizes()
        if self.length_buckets is not None:
            check_length_buckets(self)
        if self.tx is not None and not (hasattr(self.tx, "init") and hasattr(self.tx, "update")):
            raise MpmdError(
                f"{self.name}: tx must be an optax.GradientTransformation (with init and update), got "
                f"{type(self.tx).__name__}."
            )
        if self.tx is not None and self.mode != "train":
            raise MpmdError(f"{self.name}: an optimizer (tx=) updates a training step; use mode='train'.")

    def _check_loss_settings(self) -> None:
        if self.reduce not in REDUCTIONS:
            raise MpmdError(
                f"{self.name}: reduce must be None (the whole batch's loss, proven exact or refused), "
                f"'mean' (the mean of the microbatch losses) or 'sum' (their sum), got {self.reduce!r}."
            )
        weight = self.microbatch_weight_fn
        if weight is not None and not callable(weight):
            raise MpmdError(
                f"{self.name}: microbatch_weight_fn must be a function with the loss function's signature "
                f"returning one microbatch's weight, got {type(weight).__name__}."
            )
        if weight is not None and self.reduce is not None:
            raise MpmdError(
                f"{self.name}: microbatch_weight_fn gives the weighted mean sum(w_i * loss_i) / sum(w_i); "
                f"it does not combine with reduce={self.reduce!r}. Drop one of them."
            )

    def _check_stage_sizes(self) -> None:
        sizes = self.stage_sizes
        if isinstance(sizes, str):
            if sizes != "auto":
                raise MpmdError(
                    f"{self.name}: stage_sizes must be block counts, None or 'auto', got {sizes!r}."
                )
        elif sizes is not None:
            object.__setattr__(self, "stage_sizes", tuple(sizes))

    # --- what the settings say ------------------------------------------------------------
    @property
    def positions(self) -> tuple[int, ...]:
        """The differentiated argument positions."""
        return _positions(self.argnums)

    @property
    def pipelined(self) -> bool:
        """Whether the mesh has a pipeline axis (else the step is one SPMD program)."""
        if isinstance(self.mesh, MpmdMesh):
            return self.mesh.is_mpmd
        if isinstance(self.mesh, Mesh):
            return "pp" in self.mesh.axis_names
        raise MpmdError(
            f"{self.name}: mesh must be an MpmdMesh or a jax.sharding.Mesh, got {type(self.mesh).__name__}."
        )

    @property
    def pipeline_mesh(self) -> MpmdMesh:
        """The mesh, which must have a pipeline axis."""
        mesh = self.mesh if isinstance(self.mesh, MpmdMesh | None) else as_mpmd_mesh(self.mesh)
        if mesh is None or not mesh.is_mpmd:
            raise MpmdError(
                f"{self.name}: the mesh has no pipeline axis; build it with "
                "create_mesh(..., mpmd_axis='pp') (or pass a jax Mesh with a 'pp' axis)."
            )
        return mesh

    @property
    def microbatched(self) -> bool:
        """Whether the batch is split into microbatches: always for a training step; a forward
        (`sxjit`) only with `batch_argnums`."""
        return self.mode == "train" or self.batch_argnums is not None

    def model_stages(self) -> int:
        """How many stages the model is cut into: the schedule's model stages on the mesh's ranks
        (ranks x virtual stages, n for DualPipe, which runs each twice); 1 without a pipeline."""
        if not self.pipelined:
            return 1
        n = self.pipeline_mesh.mpmd_dim
        return n if self.schedule is None else self.schedule.num_model_stages(n)

    def schedule_error(self) -> MpmdError | None:
        """The error the schedule's table gives on all the mesh's ranks (raised at the first call
        unless the function has regions, whose schedules are checked on their own ranks)."""
        n = self.pipeline_mesh.mpmd_dim
        if self.schedule is None:
            return None
        try:
            self.schedule.validate(n)
        except ValueError as err:
            return MpmdError(
                f"{self.name}: schedule {self.schedule!r} is not valid for {n} pipeline ranks: {err}"
            )
        return None

    def with_schedule(self) -> StepSettings:
        """These settings with the default schedule set: `GPipe` at `microbatches`."""
        if self.schedule is not None:
            return self
        return dataclasses.replace(self, schedule=GPipe(microbatches=self.microbatches))

    def runner_step(self) -> StepSettings:
        """The settings of the step a `Runner` differentiates, `loss(params, extra, inputs,
        targets)`: inputs and targets split into microbatches, and the weight `w(inputs,
        targets)` of `run` read from them."""
        weight = self.microbatch_weight_fn
        return self.replace(
            batch_argnums=(2, 3),
            microbatch_weight_fn=None
            if weight is None
            else lambda _p, _e, inputs, targets: weight(inputs, targets),
        )

    def replace(self, **changes) -> StepSettings:
        """These settings with `changes`, checked again (a new schedule brings its microbatches)."""
        if changes.get("schedule") is not None:
            changes.setdefault("microbatches", changes["schedule"].microbatches)
        return dataclasses.replace(self, **changes)

    def keywords(self) -> dict[str, Any]:
        """The step's settings that differ from `sxvalue_and_grad`'s defaults, as its keywords."""
        names = (
            "has_aux", "remat", "offload", "rules", "region_ranks", "reduce", "microbatch_weight_fn",
            "argnums", "batch_argnums", "static_argnums",
        )  # fmt: skip
        defaults = StepSettings("defaults")
        return {k: getattr(self, k) for k in names if getattr(self, k) != getattr(defaults, k)}
