"""`spectrax_eager.runtime.types.array`: `spectrax-lib`'s module path `spectrax.runtime.types.array`,
holding the pipeline runtime's types."""

from ..._compat.stages_array import StagesArray, abstract_stages_array

__all__ = ["StagesArray", "abstract_stages_array"]
