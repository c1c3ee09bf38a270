"""`spectrax_eager.sharding.partition`: `spectrax-lib`'s module path `spectrax.sharding.partition`,
holding sharding helpers (`spx.sharding`'s)."""

from .._compat.paths import not_built
from .._sharding.mesh import (
    get_axes_size_in_mesh,
    get_current_stage_mesh,
    get_incontext_mesh,
    names_in_current_mesh,
    to_jax_mesh,
)
from .._sharding.named import (
    extract_sharding_structure,
    extract_shardings,
    get_corrected_named_sharding,
    make_shard_and_gather_fns,
    match_partition_rules,
    sanitize_partition_spec_for_mesh_and_shape,
)
from .._sharding.specs import (
    lax_reshard,
    with_partitioning,
    with_sharding_constraint,
    with_sharding_constraint_by_name,
)
from . import apply_logical_sharding, get_named_sharding, get_partition_spec

__getattr__ = not_built(
    __name__,
    "spectrax-lib's helper is not kept; spx.sharding.get_named_sharding and "
    "apply_logical_sharding place arrays by their logical axes",
)

__all__ = [
    "apply_logical_sharding",
    "extract_sharding_structure",
    "extract_shardings",
    "get_axes_size_in_mesh",
    "get_corrected_named_sharding",
    "get_current_stage_mesh",
    "get_incontext_mesh",
    "get_named_sharding",
    "get_partition_spec",
    "lax_reshard",
    "make_shard_and_gather_fns",
    "match_partition_rules",
    "names_in_current_mesh",
    "sanitize_partition_spec_for_mesh_and_shape",
    "to_jax_mesh",
    "with_partitioning",
    "with_sharding_constraint",
    "with_sharding_constraint_by_name",
]
