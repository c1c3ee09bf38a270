"""`spx.functional`: the stateless operations called inside `forward` (those of
`spectrax_core.functional`: activations, linear, dropout, normalisations, convolutions,
pooling, attention)."""

from spectrax_core.functional import *  # noqa: F401,F403
from spectrax_core.functional import __all__  # noqa: F401
