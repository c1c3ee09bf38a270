"""Models assembled from `spectrax_core.nn` layers."""

from ._generate import (
    check_generate,
    generate,
    left_pad,
    lm_blocks,
    lm_generate_step,
    lm_sample_head,
    lm_step,
    pad_mask,
    right_padded,
)
from ._lm import TransformerLM, greedy_decode, init_cache, lm_embed, lm_head, lm_loss
from ._sample import GenState, Sampler, gen_state, next_tokens, sample_tokens

__all__ = [
    "TransformerLM",
    "greedy_decode",
    "init_cache",
    "lm_embed",
    "lm_head",
    "lm_loss",
    "Sampler",
    "GenState",
    "gen_state",
    "sample_tokens",
    "next_tokens",
    "generate",
    "left_pad",
    "check_generate",
    "pad_mask",
    "lm_blocks",
    "lm_sample_head",
    "lm_generate_step",
    "lm_step",
    "right_padded",
]
