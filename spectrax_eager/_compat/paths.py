"""The module paths of `spectrax-lib` kept here (`spectrax_eager.core.graph`, ...): each module
holds the names this project builds, and refuses the others of that path with an error naming
what to use (`not_built`). `keep_names` loads a package's submodules that share a name with one
of the package's own attributes (`functional.conv`, the module and the function) or a builtin
(`inspect.repr`)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable
from typing import Any

#: What to use instead of the names of `spectrax-lib`'s modules whose names are not built here,
#: by topic (`not_kept`).
INSTEAD = {
    "core": (
        "spectrax-lib's core internals are not kept; a model's structure and values are read with "
        "spx.export, spx.iter_variables and spx.tree_state, and the core's public names are spx's"
    ),
    "variable hooks": (
        "variable hooks are not built; forward hooks are spx.hooks.register_forward_hook and "
        "register_forward_pre_hook"
    ),
    "logging": (
        "metric logging is not part of this project; log the values a training step returns with a "
        "logger of your own"
    ),
    "mpmd internals": (
        "spectrax-lib's MPMD compiler internals are not kept; pipelines compile through sxjit, "
        "sxvalue_and_grad, sxcall and spx.run (spectrax_mpmd.treduce reduces over microbatches), "
        "and loops inside a stage are jax.lax loops"
    ),
    "stage markers": (
        "stage boundaries are marked with spx.sxstage_iter, and spx.run cuts a `blocks` ModuleList,"
        " a PipelineSequential or assign_stage blocks into stages"
    ),
    "fusion": (
        "which forward and backward run fused is the schedule's table (KimiK2, DualPipeV); "
        "spectrax_core.schedules holds the actions and the simulator"
    ),
    "spmd pipelines": (
        "pipelines here run one program per rank (MPMD): spx.run on a mesh with a pipeline axis, or sxjit"
    ),
    "stage types": (
        "stages are cut by spx.run (a `blocks` ModuleList, a PipelineSequential, assign_stage), and"
        " a mesh from spx.create_mesh(..., mpmd_axis=...) is its own MPMD view"
    ),
    "checkpoints": (
        "checkpoints are written by spx.save_checkpoint and read by spx.restore_checkpoint, and by "
        "spectrax_mpmd.CheckpointManager for pipelined training"
    ),
    "transform internals": (
        "spectrax-lib's transform internals are not kept; spx.jit, spx.grad, spx.vmap, spx.scan, "
        "... take modules as arguments directly"
    ),
}


def not_kept(module: str, topic: str) -> Callable[[str], Any]:
    """`not_built(module, INSTEAD[topic])`: the `__getattr__` of a module path whose names not built
    here are refused with the topic's advice."""
    return not_built(module, INSTEAD[topic])


def not_built(module: str, use: str) -> Callable[[str], Any]:
    """A module `__getattr__` for `module`: a public name it lacks raises `ImportError` (what
    `from module import name` raises) saying `use`; a private one, `AttributeError`."""

    def __getattr__(name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        raise ImportError(f"cannot import name {name!r} from {module!r}: {use}.", name=module)

    return __getattr__


def keep_names(package: str, submodules: Iterable[str]) -> None:
    """Load the `submodules` of `package` now and keep the package's namespace as it was (its own
    attribute of such a name, or none, so that a builtin such as `repr` stays in reach): loading a
    submodule binds it on its package, so one loaded later would replace them."""
    namespace = vars(sys.modules[package])
    for name in submodules:
        had, own = name in namespace, namespace.get(name)
        importlib.import_module(f"{package}.{name}")
        if had:
            namespace[name] = own
        else:
            del namespace[name]
