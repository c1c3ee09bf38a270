"""What each stage keeps for its backward, and where: recompute (`remat=`) and offload (`offload=`).

Both arguments are given for the whole pipeline or per model stage (the stages
the function's markers cut, `0 ... n_stages - 1`), and normalised here once into
one value per stage:

* `remat`: `False` (keep the forward's residuals), `True` (keep only the stage's
  inputs and recompute its forward in the backward), or the name of a JAX
  checkpoint policy (`jax.checkpoint_policies`, e.g. `"dots_saveable"`): keep what
  the policy saves, recompute the rest.
* `offload`: `False`, `True` (every saved residual and I->W stash value), a
  fraction in `(0, 1]` (that share of each kind's bytes), `"residuals"` or
  `"stash"` (that kind only), or an `Offload(residuals=, stash=)`. Offloaded
  values live in host memory (`pinned_host`) from the cell that makes them to
  the cell that reads them.

`offloaded` is the one rule that picks which values a fraction moves: the plan
builder and the memory model both call it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import jax
import numpy as np

from ..errors import MpmdError

HOST = "pinned_host"


@dataclass(frozen=True)
class Offload:
    """Per stage, the share of its saved residuals' bytes and of its I->W stash's bytes that live
    in host memory between the cell that makes them and the cell that reads them (0: none,
    1: all; a share in between moves the largest values first, see `offloaded`)."""

    residuals: float = 0.0
    stash: float = 0.0

    def __post_init__(self):
        for name in ("residuals", "stash"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
                raise MpmdError(
                    f"Offload: {name} must be a share of bytes between 0 and 1, received {value!r}; "
                    "pass 1.0 to offload all of them, 0.0 for none."
                )

    def __bool__(self) -> bool:
        return bool(self.residuals or self.stash)


NO_OFFLOAD = Offload()


def saved_bytes(value) -> int:
    """A saved value's bytes as `offloaded` counts them (any array or spec with shape and dtype): its
    whole size, whatever its sharding; a typed PRNG key counts 0 and is never moved."""
    if jax.dtypes.issubdtype(value.dtype, jax.dtypes.extended):
        return 0
    return math.prod(value.shape) * np.dtype(value.dtype).itemsize


def offloaded(sizes: Sequence[int], share: float) -> tuple[int, ...]:
    """Which of a stage's values (`sizes`: bytes of each, in order) a `share` of their bytes moves
    to host memory: the largest first (ties: the earlier), until at least `share` of the total is
    moved; returned in increasing position. `share=1` moves all, `0` none."""
    total = sum(sizes)
    if share <= 0 or total == 0:
        return ()
    chosen, moved = [], 0
    for k in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        if moved >= share * total:
            break
        chosen.append(k)
        moved += sizes[k]
    return tuple(sorted(chosen))


def _per_stage(name: str, value, n_stages: int, one, default) -> tuple:
    """`value` for the whole pipeline, or a sequence (one per stage) or mapping (stage -> value),
    as one normalised value per stage."""
    if isinstance(value, Mapping):
        bad = [k for k in value if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < n_stages]
        if bad:
            raise MpmdError(
                f"{name}: a mapping's keys must be model stages 0..{n_stages - 1}, received {bad}; the "
                f"function's markers cut it into {n_stages} stages."
            )
        return tuple(one(value.get(s, default)) for s in range(n_stages))
    if isinstance(value, (list, tuple)):
        if len(value) != n_stages:
            raise MpmdError(
                f"{name}: a sequence gives one value per model stage, so it needs {n_stages} entries (the "
                f"function's markers cut it into {n_stages} stages); received {len(value)}. Pass "
                f"{n_stages} values, a mapping {{stage: value}}, or one value for every stage."
            )
        return tuple(one(v) for v in value)
    return (one(value),) * n_stages


def _remat_value(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        policy = getattr(jax.checkpoint_policies, value, None)
        if policy is None or not callable(policy) or not _is_policy(value):
            names = sorted(n for n in vars(jax.checkpoint_policies) if _is_policy(n))
            raise MpmdError(
                f"remat: {value!r} is not a JAX checkpoint policy that takes no arguments; use one of "
                f"{names}, or True (recompute everything) / False (keep the residuals)."
            )
        return value
    raise MpmdError(
        f"remat: each value must be True, False or the name of a JAX checkpoint policy (e.g. "
        f"'dots_saveable'), received {value!r}."
    )


def _is_policy(name: str) -> bool:
    return not name.startswith(("_", "save_")) and name not in ("offload_dot_with_no_batch_dims",)


def stage_remat(remat, n_stages: int) -> tuple:
    """One recompute setting per model stage (`True`, `False` or a policy name), checked."""
    return _per_stage("remat", remat, n_stages, _remat_value, False)


def _offload_value(value) -> Offload:
    if value is None or value is False:
        return NO_OFFLOAD
    if value is True:
        return Offload(1.0, 1.0)
    if isinstance(value, Offload):
        return value
    if value == "residuals":
        return Offload(residuals=1.0)
    if value == "stash":
        return Offload(stash=1.0)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1:
        return Offload(float(value), float(value))
    raise MpmdError(
        f"offload: each value must be True, False, a share of bytes in [0, 1], 'residuals', 'stash' or "
        f"an Offload(residuals=, stash=), received {value!r}."
    )


def stage_offload(offload, n_stages: int) -> tuple[Offload, ...]:
    """One `Offload` per model stage, checked."""
    return _per_stage("offload", offload, n_stages, _offload_value, False)


def stage_policies(remat, offload, n_stages: int | None) -> dict:
    """`{"remat": ..., "offload": ...}`, one checked value per model stage (the `PlanArgs` fields);
    with `n_stages` None (not known yet) only the values are checked, and nothing is returned."""
    if n_stages is None:
        for given, check in ((remat, _remat_value), (offload, _offload_value)):
            if isinstance(given, Mapping):
                given = list(given.values())
            for value in given if isinstance(given, (list, tuple)) else [given]:
                check(value)
        return {}
    return {"remat": stage_remat(remat, n_stages), "offload": stage_offload(offload, n_stages)}
