"""spectrax_eager: the PyTorch-shaped stateful facade (`import spectrax_eager as spx`).

A thin layer over `spectrax_core`: modules hold Variables, the math is the
core's functions, and transforms turn calls on modules into pure JAX.
"""

from . import contrib, functional, hooks, init, inspect, nn, sharding
from ._assign import assign_stage
from ._autodiff import grad, jvp, value_and_grad, vjp
from ._checkpoint import restore_checkpoint, save_checkpoint
from ._control import cond, eval_shape, fori_loop, remat, remat_scan, scan, switch, vmap, while_loop
from ._errors import (
    CyclicGraphError,
    IllegalMutationError,
    SelectorError,
    StaticEditError,
    StructureChangeError,
)
from ._graph import GraphDef
from ._inspect import count_bytes, count_parameters, summary
from ._jit import jit
from ._module import Module
from ._optimizer import MultiOptimizer, Optimizer, OptState
from ._reexports import *  # noqa: F401,F403  (pipeline names from spectrax_core / spectrax_mpmd)
from ._reexports import MPMD_NAMES as _MPMD_NAMES
from ._reexports import __all__ as _pipeline_names
from ._rngs import RngCount, RngKey, Rngs, RngStream, current_rngs, seed
from ._run import run, sxcall
from ._selector import (
    Everything,
    Nothing,
    Selector,
    all_of,
    any_of,
    as_selector,
    not_,
    of_type,
    path_contains,
    path_endswith,
    path_startswith,
    select,
)
from ._state import (
    State,
    bind,
    clone,
    export,
    find,
    freeze,
    iter_modules,
    iter_variables,
    live_variables,
    partition_state,
    pop,
    tree_state,
    unfreeze,
    update,
)
from ._variable import Buffer, Parameter, Variable


def __getattr__(name: str):
    if name in _MPMD_NAMES:
        import spectrax_mpmd

        return getattr(spectrax_mpmd, name)
    raise AttributeError(f"module 'spectrax_eager' has no attribute {name!r}")


__all__ = [
    "contrib",
    "restore_checkpoint",
    "save_checkpoint",
    "CyclicGraphError",
    "Everything",
    "MultiOptimizer",
    "Nothing",
    "SelectorError",
    "StaticEditError",
    "all_of",
    "any_of",
    "current_rngs",
    "find",
    "hooks",
    "inspect",
    "iter_modules",
    "live_variables",
    "not_",
    "pop",
    "seed",
    "sharding",
    "Buffer",
    "GraphDef",
    "IllegalMutationError",
    "Module",
    "OptState",
    "Optimizer",
    "Parameter",
    "RngCount",
    "RngKey",
    "RngStream",
    "Rngs",
    "Selector",
    "State",
    "StructureChangeError",
    "Variable",
    "as_selector",
    "assign_stage",
    "bind",
    "clone",
    "cond",
    "count_bytes",
    "count_parameters",
    "eval_shape",
    "export",
    "fori_loop",
    "freeze",
    "grad",
    "iter_variables",
    "jit",
    "jvp",
    "nn",
    "functional",
    "init",
    "of_type",
    "partition_state",
    "path_contains",
    "path_endswith",
    "path_startswith",
    "remat",
    "remat_scan",
    "run",
    "scan",
    "select",
    "summary",
    "switch",
    "sxcall",
    "tree_state",
    "unfreeze",
    "update",
    "value_and_grad",
    "vjp",
    "vmap",
    "while_loop",
    *_pipeline_names,
    *_MPMD_NAMES,
]
