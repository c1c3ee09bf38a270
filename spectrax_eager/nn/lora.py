"""`spectrax_eager.nn.lora`: `spectrax-lib`'s module path `spectrax.nn.lora`, holding layers
(`spx.nn`'s)."""

from ._lora import LoRA, LoRALinear, LoraParameter, wrap_lora

__all__ = ["LoRA", "LoRALinear", "LoraParameter", "wrap_lora"]
