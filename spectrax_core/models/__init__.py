"""Models assembled from `spectrax_core.nn` layers."""

from ._lm import TransformerLM, greedy_decode, init_cache, lm_embed, lm_head, lm_loss

__all__ = ["TransformerLM", "greedy_decode", "init_cache", "lm_embed", "lm_head", "lm_loss"]
