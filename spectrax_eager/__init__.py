"""spectrax_eager: the PyTorch-shaped stateful facade (`import spectrax_eager as spx`).

A thin layer over `spectrax_core`: modules hold Variables, the math is the
core's functions, and transforms turn calls on modules into pure JAX.
"""

from spectrax_core.schedules import Schedule

from . import (
    common_types,
    context,
    contrib,
    functional,
    hooks,
    init,
    inspect,
    nn,
    runtime,
    serialization,
    sharding,
    typing,
)
from ._compat.markers import Opaque, Static
from ._compat.schedules import SCHEDULES as _SCHEDULES
from ._compat.schedules import (
    DualPipeV,
    Eager1F1B,
    GPipe,
    Interleaved1F1BPlusOne,
    InterleavedGPipe,
    InterleavedH1,
    KimiK2,
    Std1F1B,
    ZeroBubbleH1,
)
from ._errors import (
    CyclicGraphError,
    IllegalMutationError,
    LazyInitUnderTransformError,
    SelectorError,
    SpecTraxError,
    StaticEditError,
    StructureChangeError,
)
from ._graph.deferred import DeferredBuffer, DeferredParameter
from ._graph.export import bind, clone, export, partition_state, tree_state, update
from ._graph.module import Module
from ._graph.rngs import (
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
from ._graph.selector import (
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
from ._graph.state import State
from ._graph.structure import GraphDef
from ._graph.variable import Buffer, Parameter, Variable
from ._graph.walk import (
    check_unintentional_sharing,
    find,
    freeze,
    iter_modules,
    iter_variables,
    live_variables,
    pop,
    unfreeze,
)
from ._pipeline.checkpoint import restore_checkpoint, save_checkpoint
from ._pipeline.entry_points import (
    sxgrad,
    sxjit,
    sxstage_region,
    sxvalue_and_grad,
    sxvalue_and_grad_and_apply,
)
from ._pipeline.mpmd import MPMD_NAMES as _MPMD_NAMES
from ._pipeline.mpmd import mpmd_name as _mpmd_name
from ._pipeline.run import run
from ._pipeline.stages import assign_stage
from ._pipeline.sxcall import sxcall
from ._scope.init_placement import InitPlacementHook, variable_init_placement
from ._scope.lazy import lazy_init
from ._scope.policy import Policy
from ._sharding.rules import Sharding
from ._transforms.autodiff import grad, jvp, value_and_grad, vjp
from ._transforms.branches import cond, switch
from ._transforms.jit import jit
from ._transforms.loops import associative_scan, fori_loop, remat_scan, scan, while_loop
from ._transforms.remat import eval_shape, remat
from ._transforms.vmap import StateAxes, vmap
from .context import scope
from .contrib import MultiOptimizer, Optimizer, OptState
from .inspect import count_bytes, count_parameters, summary
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
from .typing import AxisNames

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _MPMD_NAMES or name == "SpxMesh":  # spectrax_mpmd's, imported on first use
        return _mpmd_name(name)
    raise AttributeError(f"module 'spectrax_eager' has no attribute {name!r}")


__all__ = [
    "DeferredBuffer",
    "DeferredParameter",
    "InitPlacementHook",
    "lazy_init",
    "Policy",
    "common_types",
    "context",
    "serialization",
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
    "SpxMesh",  # noqa: F822  (module __getattr__)
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
    *_SCHEDULES,
    "Schedule",
    "sxgrad",
    "sxjit",
    "sxstage_region",
    "sxvalue_and_grad",
    "sxvalue_and_grad_and_apply",
    *_MPMD_NAMES,
]
