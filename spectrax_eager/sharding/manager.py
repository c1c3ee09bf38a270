"""`spectrax_eager.sharding.manager`: `spectrax-lib`'s module path `spectrax.sharding.manager`, holding
sharding helpers (`spx.sharding`'s)."""

from .._compat.partition_axis import PartitionAxis
from .._compat.paths import not_built
from . import PartitionManager, apply_logical_sharding, get_current_partition_manager, get_partition_manager

__getattr__ = not_built(
    __name__,
    "spectrax-lib's helper is not kept; spx.sharding.get_named_sharding and "
    "apply_logical_sharding place arrays by their logical axes",
)

__all__ = [
    "PartitionAxis",
    "PartitionManager",
    "apply_logical_sharding",
    "get_current_partition_manager",
    "get_partition_manager",
]
