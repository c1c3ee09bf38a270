"""Checkpoints through orbax-checkpoint: each rank's arrays written where they live, restored into any layout.

`CheckpointManager` wraps `orbax.checkpoint.CheckpointManager` (numbered
steps, `max_to_keep`, asynchronous saves, atomic commits); `save_checkpoint`
and `restore_checkpoint` are the one-call forms. A checkpoint holds three
items: `params` and `opt_state` (arrays under layout-independent names, see
`_checkpoint_layout`) and `meta` (JSON: every name's shape and dtype and the
checksum of its contents, see `_checkpoint_digest`, and the caller's
`extra`). Orbax writes each array shard from the device that holds it and
reads each straight onto the devices of the target sharding, so a checkpoint
written by a 4-rank pipeline restores into 2 or 8 ranks, another schedule, or
one device, with nothing converted offline.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from pathlib import Path
from typing import Any, NamedTuple

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from spectrax_core import sharding as core_sharding

from .._comm import Exchange
from .._trace.context import methods_outside_context_mesh, outside_context_mesh
from .digest import verify as _verify
from .hosts import PRIMARY, for_owners, read_held, uncommitted
from .layout import CheckpointError, save_arrays
from .orbax_io import load_orbax, open_manager, read_failure
from .save_watch import SaveWatch
from .target import staged_opt_target, tree_target

FORMAT = 1
ITEMS = ("params", "opt_state", "meta")


class Restored(NamedTuple):
    """What a restore returns: the step, the parameters, the optimizer state (or None) and `extra`."""

    step: int
    params: Any
    opt_state: Any
    extra: Any


@methods_outside_context_mesh
class CheckpointManager:
    """Numbered checkpoints in `directory`, saved and restored through orbax.

    Args:
      directory: where step folders (`<directory>/<step>`) are written.
      max_to_keep: keep only the newest this many steps (None: all).
      save_interval_steps: `save` writes a step that is a multiple of this, or
        any step while the directory holds none (orbax's rule: a run gets its
        first checkpoint at once); it never writes a step older than the
        latest. `save` returns whether it wrote; `force=True` writes any step.
      async_save: write in the background; `save` returns once the arrays are
        copied off the devices, so training may go on and change them. Call
        `wait_until_finished` (or `close`) before reading the files.
      create: create `directory` if missing (restoring never creates it).
      checksums: record a checksum of every array's contents when saving, and
        check the arrays read against it when restoring (a `CheckpointError`
        names the step and the array that differs). False skips both, for
        speed; a step saved without checksums is restored unchecked.

    A step becomes visible only when orbax has committed it. A save that fails
    (raising from `save`, or for an asynchronous one from `wait_until_finished`
    or `close`) removes its temporary folder before the error propagates; one
    whose process was killed leaves it, `all_steps`, `latest_step` and `restore`
    ignore it, and the next manager on the directory removes it.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        max_to_keep: int | None = None,
        save_interval_steps: int = 1,
        async_save: bool = True,
        create: bool = True,
        checksums: bool = True,
    ):
        self._ocp = ocp = load_orbax()
        self._steps_exchange = None  # multi-process: the committing process's step list, made on first use
        self.directory = Path(directory).absolute()
        if not create and not self.directory.is_dir():
            raise CheckpointError(
                f"restore: checkpoint directory {self.directory} does not exist; give the directory a "
                "run saved to (--checkpoint-dir / CheckpointManager(directory))."
            )
        self.checksums = checksums
        self._manager = open_manager(
            ocp, self.directory, ITEMS, max_to_keep, save_interval_steps, async_save, create
        )
        self._watch = SaveWatch(self.directory, self._manager)

    # -- steps ---------------------------------------------------------------------------
    def all_steps(self) -> list[int]:
        """The committed steps, oldest first.

        In a multi-process run every process calls it, in the same order (as it
        calls `save`, `restore` and `delete`): the committing process reads the
        directory and every process gets that list, so what a job decides from it
        (the step to resume, the later steps to delete) is the same everywhere,
        even while that process is committing or deleting a step.
        """
        steps = self._read_steps()
        if jax.process_count() == 1:
            return steps
        if self._steps_exchange is None:
            self._steps_exchange = Exchange("checkpoint_steps")
        return json.loads(self._steps_exchange.allgather(json.dumps(steps))[PRIMARY])

    def _read_steps(self) -> list[int]:
        """The committed steps this process reads in the directory now."""
        self._manager.reload()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        """The newest committed step, or None."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def delete(self, step: int) -> None:
        """Remove a committed step (e.g. the later steps of a run resumed from an earlier one)."""
        step = self._resolve(step, "delete")
        if step not in self._manager.all_steps():  # committed after this process last read the directory
            self._manager.reload()
        self._manager.delete(step)

    def wait_until_finished(self) -> None:
        """Block until every asynchronous save has been committed."""
        with self._watch.orbax_call():
            self._manager.wait_until_finished()

    def close(self) -> None:
        """Finish pending saves and release orbax's resources."""
        with self._watch.orbax_call():
            self._manager.close()

    def __enter__(self) -> CheckpointManager:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- saving --------------------------------------------------------------------------
    def save(self, step: int, *, params, opt_state=None, extra: Any = None, force: bool = False) -> bool:
        """Save `params` (any pytree of arrays), `opt_state` and JSON `extra` as `step`.

        `opt_state` is a `StagedOptState` (saved per parameter, so it restores
        into another pipeline layout) or any pytree of arrays (restored into the
        same structure). Every array is handed to orbax on the devices that hold
        it. Returns whether the step was saved (see `save_interval_steps`).
        """
        step = _check_save(step, extra)
        if step in self._manager.all_steps():
            raise CheckpointError(
                f"save: step {step} already exists in {self.directory}; delete it first "
                f"(manager.delete({step})) or save under another step."
            )
        arrays_p, arrays_o, desc = save_arrays(params, opt_state)
        both, sums = for_owners({"params": arrays_p, "opt_state": arrays_o}, self.checksums)
        arrays_p, arrays_o = both["params"], both["opt_state"]  # each written by its owner (see `hosts`)
        meta = {"format": FORMAT, **desc, "extra": extra, **({"checksums": sums} if self.checksums else {})}
        ocp = self._ocp
        items = {"params": ocp.args.PyTreeSave(arrays_p), "meta": ocp.args.JsonSave(meta)}
        if arrays_o:
            items["opt_state"] = ocp.args.PyTreeSave(arrays_o)
        self._watch.saving(step)
        with self._watch.orbax_call():
            return self._manager.save(step, args=ocp.args.Composite(**items), force=force)

    # -- restoring -----------------------------------------------------------------------
    def restore(
        self, step: int | None = None, *, like, shardings=None, optimizer=None, opt_like=None, host_bytes=None
    ) -> Restored:
        """Read `step` (default: the latest) into parameters shaped and placed like `like`.

        Waits first for this manager's saves in flight, so the latest step is the
        one saved last and a step just saved can be restored at once.

        Args:
          like: the target parameters: a pytree of arrays or `jax.ShapeDtypeStruct`s
            in the target layout (e.g. `mp.stage_blocks(model, n)` for n
            stages, the unstaged model for one device). Each leaf is read onto
            its own sharding (a leaf without one: the default device).
          shardings: optional shardings with the structure of `like`, used instead
            of its leaves' own (e.g. `owner_shardings(step, params, *batch)`).
          optimizer: a `StagedOptimizer`, to restore a saved `StagedOptState` for
            the target parameters (its groups follow their placement).
          opt_like: or a pytree shaped like a saved non-staged optimizer state.
          host_bytes: read in batches of at most `max(largest array, host_bytes)` bytes (None: 64 MiB).

        Returns `Restored(step, params, opt_state, extra)`. Raises
        `CheckpointError` naming the first leaf whose path, shape or dtype does
        not match, or listing the steps there are when `step` is missing, or
        naming the step and the array whose contents differ from the checksum
        recorded at save (see `checksums`).
        """
        step = self._resolve(step)
        ocp = self._ocp
        meta = self._read(step, meta=ocp.args.JsonRestore())["meta"]
        p_target, p_rebuild = tree_target(like, shardings)
        p_target.check(meta["params"], "params")
        targets = {"params": p_target}
        o_rebuild = None
        if optimizer is not None or opt_like is not None:
            o_target, o_rebuild = _opt_target(meta, like, shardings, optimizer, opt_like)
            o_target.check(meta["opt_state"], "opt_state")
            targets["opt_state"] = o_target
        wants = {i: t.want for i, t in targets.items()}
        got = read_held(self._ocp, functools.partial(self._read, step), wants, host_bytes)
        if self.checksums and "checksums" in meta:
            for item in targets:
                _verify(step, item, got[item], meta["checksums"][item])
        params = p_rebuild(p_target.finish(got["params"]))
        opt_state = o_rebuild(o_target.finish(got["opt_state"])) if o_rebuild is not None else None
        return Restored(step, params, opt_state, meta.get("extra"))

    def _read(self, step: int, **items) -> dict:
        """orbax's restore of `items`; a file it cannot read raises naming the step (and the array)."""
        try:
            return self._manager.restore(step, args=self._ocp.args.Composite(**items))
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"restore: step {step} in {self.directory} cannot be read ({read_failure(err)}): a file "
                f"of the step is damaged, truncated or missing. Restore another step (it holds "
                f"{self._read_steps()}), or copy the step again from where it was saved."
            ) from err

    def _resolve(self, step: int | None, where: str = "restore") -> int:
        step = None if step is None else _check_step(step, where)
        self._manager.wait_until_finished()  # this manager's saves in flight are steps it holds
        return _pick_step(self.directory, self.all_steps(), step, where)

    def __repr__(self) -> str:
        return f"CheckpointManager({str(self.directory)!r}, steps={self._read_steps()})"


def _pick_step(directory: Path, steps: list[int], step: int | None, where: str) -> int:
    """`step` (None: the latest) if committed among `steps`, else a `CheckpointError` saying why."""
    if not steps:
        raise CheckpointError(
            f"{where}: {directory} holds no committed checkpoint; save one first "
            "(an interrupted save is never read)."
        )
    if step is None:
        return steps[-1]
    if step not in steps and uncommitted(directory, step):
        raise CheckpointError(
            f"{where}: step {step} in {directory} was never committed (its save did not "
            f"complete in every process: {uncommitted(directory, step)[0].name}), so it is not "
            f"read; the committed steps are {steps}."
        )
    if step not in steps:
        raise CheckpointError(
            f"{where}: step {step} is not in {directory}; it holds steps {steps}. Give one "
            "of them, or step=None for the latest."
        )
    return step


def _opt_target(meta, like, shardings, optimizer, opt_like):
    """The restore target of a checkpoint's optimizer state: a StagedOptState rebuilt for the
    target placement, or a pytree shaped like `opt_like`."""
    kind = meta.get("opt_kind")
    if kind is None:
        raise CheckpointError(
            "restore: this checkpoint holds no optimizer state; drop optimizer= / opt_like= and "
            "initialise the optimizer afresh."
        )
    if optimizer is not None and opt_like is not None:
        raise CheckpointError("restore: give optimizer= (a StagedOptimizer) or opt_like=, not both.")
    if kind == "staged":
        if optimizer is None or not hasattr(optimizer, "tx"):
            raise CheckpointError(
                "restore: the checkpoint holds a StagedOptState; pass optimizer=<the StagedOptimizer> so "
                "that it is rebuilt for the target parameters' placement."
            )
        return staged_opt_target(optimizer, like, shardings)
    if opt_like is None:
        raise CheckpointError(
            "restore: the checkpoint holds an optimizer state pytree (not a StagedOptState); pass "
            "opt_like= shaped like it."
        )
    return tree_target(opt_like)


def _check_save(step, extra) -> int:
    """`save`'s step, checked, after checking that `extra` is JSON."""
    try:
        json.dumps(extra)
    except (TypeError, ValueError) as err:
        raise CheckpointError(
            f"save: extra must be JSON-serializable (numbers, strings, lists, dicts), got "
            f"{type(extra).__name__}: {err}. Save arrays as params or opt_state instead."
        ) from err
    return _check_step(step)


def _check_step(step, where: str = "save") -> int:
    """`step` as an int: any integer type (int, a NumPy integer, a 0-d integer array), not a bool."""
    is_bool = isinstance(step, (bool, np.bool_)) or getattr(step, "dtype", None) == np.bool_
    try:
        value = None if is_bool else operator.index(step)
    except TypeError:
        value = None
    if value is None or value < 0:
        raise CheckpointError(
            f"{where}: step must be a non-negative int (any integer type: int, np.int64, a 0-d integer "
            f"array), got {step!r}."
        )
    return value


@outside_context_mesh
def save_checkpoint(
    directory: str | os.PathLike,
    step: int,
    *,
    params,
    opt_state=None,
    extra: Any = None,
    checksums: bool = True,
) -> Path:
    """Save one step synchronously (see `CheckpointManager.save`); returns the step's folder."""
    with CheckpointManager(directory, async_save=False, checksums=checksums) as manager:
        manager.save(step, params=params, opt_state=opt_state, extra=extra, force=True)
    return manager.directory / str(step)


@outside_context_mesh
def restore_checkpoint(
    directory: str | os.PathLike,
    step: int | None = None,
    *,
    like,
    shardings=None,
    optimizer=None,
    opt_like=None,
    checksums: bool = True,
    host_bytes: int | None = None,
) -> Restored:
    """Restore one step (default: the latest); see `CheckpointManager.restore`. `checksums=False`
    reads the arrays without checking them against the checksums their save recorded."""
    with CheckpointManager(directory, create=False, checksums=checksums) as manager:
        return manager.restore(
            step,
            like=like,
            shardings=shardings,
            optimizer=optimizer,
            opt_like=opt_like,
            host_bytes=host_bytes,
        )


@outside_context_mesh
def owner_shardings(step, params, *args):
    """Where a training step keeps each parameter leaf: the sharding its gradient comes back with.

    `step` is an `mp.runner(...)` step (called as `step(params, *args)`) or an
    `mp.sxvalue_and_grad` function (`step(params, *args)`, parameters first).
    The leaves of `params` may be arrays or `jax.ShapeDtypeStruct`s. On a
    pipeline mesh this builds (and compiles) the step's plan for these
    arguments, which the first real call then reuses; without a pipeline axis
    it is the mesh-wide placement the step gives parameters. Pass the result as
    `shardings=` to `restore` so each leaf is read straight onto its owner.
    """
    inner = getattr(step, "runner", None)
    if getattr(inner, "mode", "train") != "train":
        raise CheckpointError(
            "owner_shardings: step is a forward (inference) step; parameters are owned by the ranks of a "
            "training step: pass an mp.runner(..., mode='train') step or an mp.sxvalue_and_grad function."
        )
    if inner is not None and not inner.mpmd:
        mesh = inner.mesh
        if inner.rules is None:
            return jax.tree.map(lambda _: NamedSharding(mesh, PartitionSpec()), params)
        specs = core_sharding.param_specs(params, inner.rules, mesh=mesh)
        return jax.tree.map(lambda s: NamedSharding(mesh, s), specs)
    fn, call = (inner.step, (params, None, *args)) if inner is not None else (step, (params, *args))
    if not hasattr(fn, "plan_for"):
        raise CheckpointError(
            f"owner_shardings: step must be an mp.runner(...) step or an mp.sxvalue_and_grad function, "
            f"got {type(step).__name__}."
        )
    plan = fn.plan_for(*call)
    leaves, treedef = jax.tree.flatten(params)
    owned = plan.grad_shardings(len(leaves))
    fallback = NamedSharding(fn.mesh.submesh(0), PartitionSpec())
    return treedef.unflatten([owned.get(a, fallback) for a in range(len(leaves))])
