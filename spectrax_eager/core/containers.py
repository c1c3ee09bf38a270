"""`spectrax_eager.core.containers`: `spectrax-lib`'s module path `spectrax.core.containers`, holding
the module system's names (`spx`'s)."""

from ..nn._containers import ModuleDict, ModuleList, ParameterList, Sequential, StackedModuleList

__all__ = ["ModuleDict", "ModuleList", "ParameterList", "Sequential", "StackedModuleList"]
