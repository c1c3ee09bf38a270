"""`spectrax_eager.nn.conv`: `spectrax-lib`'s module path `spectrax.nn.conv`, holding layers
(`spx.nn`'s)."""

from ._conv import Conv, Conv1d, Conv2d, Conv3d, ConvTranspose1d, ConvTranspose2d, ConvTranspose3d

__all__ = ["Conv", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d", "ConvTranspose3d"]
