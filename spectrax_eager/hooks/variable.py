"""`spectrax_eager.hooks.variable`: `spectrax-lib`'s module path `spectrax.hooks.variable`; none of its
names is built here, and importing one says what to use."""

from .._compat.paths import not_built

__getattr__ = not_built(
    __name__,
    "variable hooks are not built; forward hooks are spx.hooks.register_forward_hook and "
    "register_forward_pre_hook",
)

__all__ = ()
