"""`spectrax_eager.hooks.forward`: `spectrax-lib`'s module path `spectrax.hooks.forward`, holding
forward hooks (`spx.hooks`'s)."""

from . import Handle, register_forward_hook, register_forward_pre_hook

__all__ = ["Handle", "register_forward_hook", "register_forward_pre_hook"]
