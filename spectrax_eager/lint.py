"""`spectrax_eager.lint`: `spectrax-lib`'s module path `spectrax.lint`, holding
`spx.check_unintentional_sharing`."""

from ._graph.walk import check_unintentional_sharing

__all__ = ["check_unintentional_sharing"]
