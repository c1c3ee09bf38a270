"""`spectrax_eager.sharding.logical`: `spectrax-lib`'s module path `spectrax.sharding.logical`, holding
sharding helpers (`spx.sharding`'s)."""

from .._sharding.rules import current_axis_rules, logical_axis_rules

__all__ = ["current_axis_rules", "logical_axis_rules"]
