"""Models assembled from `spectrax_core.nn` layers."""

from ._lm import TransformerLM, init_cache, lm_embed, lm_head, lm_loss

__all__ = ["TransformerLM", "init_cache", "lm_embed", "lm_head", "lm_loss"]
