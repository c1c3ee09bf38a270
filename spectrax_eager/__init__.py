"""spectrax_eager: the PyTorch-shaped stateful facade (`import spectrax_eager as spx`).

A thin layer over `spectrax_core`: modules hold Variables, the math is the
core's functions, and transforms turn calls on modules into pure JAX.
"""

from . import common_types, context, contrib, functional, hooks, init, inspect, nn, runtime, sharding, typing
from ._assign import assign_stage
from ._autodiff import grad, jvp, value_and_grad, vjp
from ._checkpoint import restore_checkpoint, save_checkpoint
from ._control import (
    StateAxes,
    associative_scan,
    cond,
    eval_shape,
    fori_loop,
    remat,
    remat_scan,
    scan,
    switch,
    vmap,
    while_loop,
)
from ._deferred import DeferredBuffer, DeferredParameter
from ._errors import (
    CyclicGraphError,
    IllegalMutationError,
    LazyInitUnderTransformError,
    SelectorError,
    SpecTraxError,
    StaticEditError,
    StructureChangeError,
)
from ._graph import GraphDef
from ._inspect import count_bytes, count_parameters, summary
from ._jit import jit
from ._lazy import lazy_init
from ._markers import Opaque, Static
from ._module import Module
from ._optimizer import MultiOptimizer, Optimizer, OptState
from ._placement import InitPlacementHook, variable_init_placement
from ._policy import Policy
from ._reexports import *  # noqa: F401,F403  (pipeline names from spectrax_core / spectrax_mpmd)
from ._reexports import MPMD_NAMES as _MPMD_NAMES
from ._reexports import __all__ as _pipeline_names
from ._rngs import (
    RngCount,
    RngKey,
    Rngs,
    RngStream,
    current_rngs,
    resolve_rngs,
    seed,
    split_rngs,
    split_stream_keys,
)
from ._run import run
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
from ._sharding_rules import Sharding
from ._state import (
    State,
    bind,
    check_unintentional_sharing,
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
from ._sxcall import sxcall
from ._variable import Buffer, Parameter, Variable
from .context import scope
from .sharding import (
    DEFAULT_MESH_AXIS_DIMS,
    DEFAULT_MESH_AXIS_NAMES,
    PartitionAxis,
    PartitionManager,
    apply_logical_sharding,
    cpu_context,
    create_cpu_mesh,
    create_mesh,
    current_mesh,
    extract_sharding_structure,
    extract_shardings,
    force_cpu,
    get_axes_size_in_mesh,
    get_corrected_named_sharding,
    get_current_partition_manager,
    get_current_stage_mesh,
    get_incontext_mesh,
    get_partition_manager,
    lax_reshard,
    make_shard_and_gather_fns,
    match_partition_rules,
    names_in_current_mesh,
    parse_mesh_from_string,
    place_setup_leaf_with_sharding,
    place_setup_tree_with_shardings,
    sanitize_partition_spec_for_mesh_and_shape,
    to_jax_mesh,
    use_mesh,
    with_sharding_constraint,
)

#: Logical axis names of an array, one per axis (None: unsharded).
AxisNames = tuple[str | None, ...]
__version__ = "0.1.0"

_ALIASES = {"SpxMesh": "MpmdMesh"}  # seed name -> spectrax_mpmd name


def __getattr__(name: str):
    if name in _MPMD_NAMES or name in _ALIASES:
        import spectrax_mpmd

        return getattr(spectrax_mpmd, _ALIASES.get(name, name))
    raise AttributeError(f"module 'spectrax_eager' has no attribute {name!r}")


__all__ = [
    "DeferredBuffer",
    "DeferredParameter",
    "InitPlacementHook",
    "lazy_init",
    "Policy",
    "common_types",
    "context",
    "scope",
    "variable_init_placement",
    "StateAxes",
    "AxisNames",
    "DEFAULT_MESH_AXIS_DIMS",
    "DEFAULT_MESH_AXIS_NAMES",
    "LazyInitUnderTransformError",
    "Opaque",
    "PartitionAxis",
    "PartitionManager",
    "Sharding",
    "SpecTraxError",
    "SpxMesh",  # noqa: F405  (module __getattr__)
    "Static",
    "__version__",
    "apply_logical_sharding",
    "associative_scan",
    "check_unintentional_sharing",
    "cpu_context",
    "create_cpu_mesh",
    "create_mesh",
    "current_mesh",
    "extract_sharding_structure",
    "extract_shardings",
    "force_cpu",
    "get_axes_size_in_mesh",
    "get_corrected_named_sharding",
    "get_current_partition_manager",
    "get_current_stage_mesh",
    "get_incontext_mesh",
    "get_partition_manager",
    "lax_reshard",
    "make_shard_and_gather_fns",
    "match_partition_rules",
    "names_in_current_mesh",
    "parse_mesh_from_string",
    "place_setup_leaf_with_sharding",
    "place_setup_tree_with_shardings",
    "resolve_rngs",
    "runtime",
    "typing",
    "sanitize_partition_spec_for_mesh_and_shape",
    "split_rngs",
    "split_stream_keys",
    "to_jax_mesh",
    "use_mesh",
    "with_sharding_constraint",
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
