"""`spectrax_eager.core.lazy_init`: `spectrax-lib`'s module path `spectrax.core.lazy_init`, holding the
module system's names (`spx`'s)."""

from .._scope.lazy import lazy_init

__all__ = ["lazy_init"]
