"""A generation request checked on the host: prompts padded on the right, lengths, budgets, groups.

Each sequence has its own positions, so prompts of different lengths need no
left padding: they are padded on the right to the longest, and every
sequence's first new token follows its own last real one. A left-padded
prompt with its `lengths` (the layout of `spectrax_core.models.left_pad`) is
accepted too and moved to the right here.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import MpmdError


@dataclass(frozen=True)
class Request:
    """`tokens` `(batch, longest)` padded on the right, `lengths` `(batch,)`, `budgets` `(batch,)`
    new tokens per sequence, `steps` the largest, `max_len` the cache positions, `groups`."""

    tokens: np.ndarray
    lengths: np.ndarray
    budgets: np.ndarray
    steps: int
    max_len: int
    groups: int

    @property
    def size(self) -> int:
        """Sequences per group."""
        return self.tokens.shape[0] // self.groups

    def part(self, i: int) -> slice:
        return slice(i * self.size, (i + 1) * self.size)


def right_padded(prompts, lengths, pad_id: int, name: str) -> tuple[np.ndarray, np.ndarray]:
    """`(tokens, lengths)` from a list of token lists, or an array `(batch, length)` (all full
    length, or left-padded with `lengths`)."""
    if isinstance(prompts, (list, tuple)):
        if lengths is not None:
            raise MpmdError(f"{name}: lengths= goes with a padded prompt array; a list of prompts has them.")
        rows = [np.asarray(p, np.int32).reshape(-1) for p in prompts]
        lengths = np.asarray([len(r) for r in rows], np.int32)
        if not rows or lengths.min() < 1:
            raise MpmdError(
                f"{name}: every prompt needs at least one token, received lengths {lengths.tolist()}."
            )
        tokens = np.full((len(rows), lengths.max()), pad_id, np.int32)
        for b, r in enumerate(rows):
            tokens[b, : len(r)] = r
        return tokens, lengths
    tokens = np.asarray(prompts)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise MpmdError(
            f"{name}: prompts must be a list of token lists or an int array (batch, length), got "
            f"{tokens.dtype} of shape {tokens.shape}."
        )
    batch, width = tokens.shape
    if lengths is None:
        return tokens.astype(np.int32), np.full((batch,), width, np.int32)
    lengths = np.asarray(lengths).reshape(-1).astype(np.int32)
    if lengths.shape != (batch,) or lengths.min() < 1 or lengths.max() > width:
        raise MpmdError(
            f"{name}: lengths must give each of the {batch} prompts a length in 1..{width}, received "
            f"{lengths.tolist()}; pass a list of token lists instead to skip the padding."
        )
    return right_padded([row[width - n :] for row, n in zip(tokens, lengths)], None, pad_id, name)


def check_request(prompts, lengths, max_new_tokens, max_len, groups, pad_id: int, name: str) -> Request:
    """The checked request; raises naming the argument that does not fit."""
    tokens, lengths = right_padded(prompts, lengths, pad_id, name)
    batch, width = tokens.shape
    budgets = np.broadcast_to(np.asarray(max_new_tokens, np.int32), (batch,)).copy()
    if budgets.min() < 1:
        raise MpmdError(
            f"{name}: max_new_tokens must be >= 1 for every sequence, received {budgets.tolist()}."
        )
    steps = int(budgets.max())
    need = int((lengths + budgets).max())
    max_len = max(need, width) if max_len is None else int(max_len)
    if need > max_len or width > max_len:
        raise MpmdError(
            f"{name}: a prompt plus its new tokens needs a cache of {max(need, width)} positions, but "
            f"max_len is {max_len}; raise max_len or shorten the prompts or max_new_tokens."
        )
    if not isinstance(groups, int) or groups < 1 or batch % groups:
        raise MpmdError(
            f"{name}: groups={groups!r} must be a positive int dividing the batch of {batch} sequences; "
            f"pick a divisor of {batch} (groups >= ranks keeps every rank busy)."
        )
    return Request(tokens, lengths, budgets, steps, max_len, groups)
