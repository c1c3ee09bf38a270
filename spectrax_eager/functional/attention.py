"""`spectrax_eager.functional.attention`: `spectrax-lib`'s module path `spectrax.functional.attention`,
holding functional ops (`spx.functional`'s)."""

from . import scaled_dot_product_attention

__all__ = ["scaled_dot_product_attention"]
