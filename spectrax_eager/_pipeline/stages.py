"""Where an eager model's pipeline stages begin and end, found through its own `forward`, and
`assign_stage`, which stamps the Variables built in a block with their stage.

A `StagePlan` names the modules to watch (by path), the stage each belongs
to, the order the forward calls them, and which calls' outputs pass through a
stage marker. Three ways to get one:

* a `PipelineSequential`: each child is one stage;
* a `blocks` `ModuleList`: consecutive groups of blocks (even, or `stage_sizes`);
* `assign_stage(total=, current=)`: variables created under it carry their
  stage; the watched modules are the largest ones whose variables all share a
  stage, and a probe of the forward (`jax.eval_shape`, no compile) finds the
  last call of each stage.

While the forward runs, the output of each marked call passes through
`sxstage_iter`; the calls must then match the plan exactly, so a split can
never drop, repeat or reorder a layer.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import jax

from .._graph.module import Module, plan_of
from .._scope import ambient
from ..nn._containers import ModuleList, PipelineSequential


@contextlib.contextmanager
def assign_stage(*, total: int, current: int):
    """Stamp every Variable created inside with pipeline stage `current` of `total`.

    `spx.run` on an MPMD mesh then cuts the model where its forward moves from
    one stage's modules to the next; `total` must equal ranks x virtual stages.
    """
    if not (isinstance(total, int) and isinstance(current, int) and 0 <= current < total):
        raise ValueError(
            f"assign_stage: need integers 0 <= current < total, received current={current!r}, total={total!r}."
        )
    with ambient.pushing("stages", (current, total)):
        yield


@dataclass(frozen=True)
class StagePlan:
    paths: tuple[str, ...]  # watched modules, relative to the model
    sequence: tuple[int, ...]  # the watched modules' indices in the order the forward calls them
    marks: frozenset  # call ordinals (positions in `sequence`) whose output ends a stage


def _error(message: str) -> Exception:
    import spectrax_mpmd as mp

    return mp.StageSplitError(f"spx.run: {message}")


def _resolve(model: Module, path: str) -> Module:
    return functools.reduce(getattr, path.split("."), model) if path else model


def _ends(stage_of_call: Sequence[int]) -> frozenset:
    """The last call of every stage but the final one."""
    last = {s: k for k, s in enumerate(stage_of_call)}
    final = max(last)
    return frozenset(k for s, k in last.items() if s != final)


def _ordered(paths: Sequence[str], stages: Sequence[int]) -> StagePlan:
    return StagePlan(tuple(paths), tuple(range(len(paths))), _ends(stages))


def _stamped_modules(model: Module) -> tuple[list[str], list[int], int] | None:
    """The largest modules whose variables all share one `assign_stage` stamp, with those stages."""
    plan = plan_of(model)
    stamped = [(info.path, dict(info.metadata)) for info in plan.infos]
    if not any("stage" in meta for _, meta in stamped):
        return None
    totals = {meta.get("stages") for _, meta in stamped if "stages" in meta}
    stages_under: dict[str, set] = {}
    for path, meta in stamped:
        parts = path.split(".")
        for k in range(len(parts)):
            stages_under.setdefault(".".join(parts[:k]), set()).add(meta.get("stage"))
    module_paths = [p for p, _ in plan.modules]
    chosen = []
    for path in module_paths:
        parent = path.rsplit(".", 1)[0] if "." in path else ""
        mine = stages_under.get(path, set())
        if path and len(mine) == 1 and None not in mine and len(stages_under.get(parent, set())) > 1:
            chosen.append(path)
    return chosen, [next(iter(stages_under[p])) for p in chosen], max(totals) if totals else 0


def stage_plan(model: Module, n_stages: int, sizes: Sequence[int] | None, inputs: Any) -> StagePlan:
    """How `model`'s forward is cut into `n_stages` stages (see the module docstring)."""
    import spectrax_mpmd as mp

    if isinstance(model, PipelineSequential):
        if sizes is not None or len(model) != n_stages:
            raise _error(
                f"the PipelineSequential has {len(model)} stages and is used as given, but the mesh and "
                f"schedule need {n_stages} (pipeline ranks x virtual stages); regroup its children or "
                "change the mesh / schedule (stage_sizes does not apply to it)."
            )
        return _ordered([str(k) for k in range(n_stages)], range(n_stages))
    stamped = _stamped_modules(model)
    if stamped is not None:
        paths, stages, total = stamped
        if total != n_stages or sorted(set(stages)) != list(range(n_stages)):
            raise _error(
                f"the model's variables were created under assign_stage(total={total}) and use stages "
                f"{sorted(set(stages))}, but the mesh and schedule need stages 0..{n_stages - 1}."
            )
        sequence = probe(model, paths, inputs)
        order = [stages[j] for j in sequence]
        if sorted(set(order)) != list(range(n_stages)) or order != sorted(order):
            raise _error(
                f"the forward calls the stage-stamped modules in stage order {order}; it must go through "
                f"stages 0..{n_stages - 1} in order (a stage's modules may run several times, but the "
                "forward may not return to an earlier stage)."
            )
        return StagePlan(tuple(paths), tuple(sequence), _ends(order))
    blocks = model.__dict__.get("blocks")
    if not isinstance(blocks, ModuleList):
        raise _error(
            f"{type(model).__name__} cannot be cut into pipeline stages: it is neither a "
            "PipelineSequential nor holds a `blocks` ModuleList, and no variable was created under "
            "spx.assign_stage. Keep the repeated layers in `self.blocks = spx.nn.ModuleList([...])`, "
            "wrap the stages in spx.nn.PipelineSequential, build each stage under "
            "spx.assign_stage(total=, current=), or mark boundaries yourself with spx.sxstage_iter."
        )
    group = mp.stage_sizes(len(blocks), n_stages, sizes)
    stages = [s for s, size in enumerate(group) for _ in range(size)]
    return _ordered([f"blocks.{k}" for k in range(len(blocks))], stages)


def call(model: Module, inputs: Any) -> Any:
    """`model(inputs)`, `model(*inputs)` for a tuple or `model(**inputs)` for a dict."""
    import spectrax_mpmd as mp

    return mp.call_with(lambda m, *args, **kwargs: m(*args, **kwargs), model, inputs)


@contextlib.contextmanager
def _watching(watched: Sequence[Module], marks: frozenset):
    """While active, calls of `watched` modules are recorded; marked calls' outputs get a stage marker."""
    import spectrax_mpmd as mp

    calls: list[int] = []

    def transform(module: Any, out: Any) -> Any:
        for j, target in enumerate(watched):
            if target is module:
                calls.append(j)
                return mp.sxstage_iter(out) if len(calls) - 1 in marks else out
        return out

    with ambient.pushing("output_transforms", transform):
        yield calls


def probe(model: Module, paths: Sequence[str], inputs: Any) -> list[int]:
    """The order in which `model`'s forward calls the modules at `paths` (abstract run, no compile)."""
    watched = [_resolve(model, p) for p in paths]
    with _watching(watched, frozenset()) as calls:
        jax.eval_shape(lambda x: call(model, x), inputs)
    return calls


def run_marked(model: Module, plan: StagePlan, inputs: Any) -> Any:
    """`model(inputs)` with stage markers per `plan`, checking the calls match it."""
    with _watching([_resolve(model, p) for p in plan.paths], plan.marks) as calls:
        out = call(model, inputs)
    if tuple(calls) != plan.sequence:
        raise _error(
            f"{type(model).__name__}.forward called its stage modules in the order {calls}, but the "
            f"split expects {list(plan.sequence)}: each block must run exactly once, in list order "
            "(stage-stamped modules in stage order), so that no layer is dropped or run twice."
        )
    return out
