"""`spectrax_eager.runtime.schedules.interleaved`: `spectrax-lib`'s module path
`spectrax.runtime.schedules.interleaved`, holding the pipeline schedules (`spx`'s)."""

from ..._compat.schedules import Interleaved1F1BPlusOne, InterleavedGPipe, InterleavedH1, KimiK2

__all__ = ["Interleaved1F1BPlusOne", "InterleavedGPipe", "InterleavedH1", "KimiK2"]
