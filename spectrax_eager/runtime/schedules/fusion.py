"""`spectrax_eager.runtime.schedules.fusion`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.fusion`; none of its names is built here, and importing one says what to
use."""

from ..._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "which forward and backward run fused is the schedule's table (KimiK2, DualPipeV); "
    "spectrax_core.schedules holds the actions and the simulator",
)

__all__ = ()
