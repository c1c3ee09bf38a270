"""`spectrax_eager.sharding.placement`: `spectrax-lib`'s module path `spectrax.sharding.placement`,
holding sharding helpers (`spx.sharding`'s)."""

from .._sharding.mesh import mesh_axis_product
from .._sharding.named import (
    named_sharding_for_shape,
    named_sharding_for_value,
    place_setup_leaf_with_sharding,
    place_setup_tree_with_shardings,
    reshape_with_named_shardings,
    spec_shape_mismatches,
    transpose_with_named_shardings,
    with_named_sharding,
)

__all__ = [
    "mesh_axis_product",
    "named_sharding_for_shape",
    "named_sharding_for_value",
    "place_setup_leaf_with_sharding",
    "place_setup_tree_with_shardings",
    "reshape_with_named_shardings",
    "spec_shape_mismatches",
    "transpose_with_named_shardings",
    "with_named_sharding",
]
