"""`spectrax_eager.api`: `spectrax-lib`'s module path `spectrax.api`, holding `spx.run`."""

from ._pipeline.run import run

__all__ = ["run"]
