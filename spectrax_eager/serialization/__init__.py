"""`spectrax_eager.serialization`: `spectrax-lib`'s module path `spectrax.serialization`; none of its
names is built here, and importing one says what to use."""

from .._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "checkpoints are written by spx.save_checkpoint and read by spx.restore_checkpoint, and by "
    "spectrax_mpmd.CheckpointManager for pipelined training",
)

__all__ = ()
