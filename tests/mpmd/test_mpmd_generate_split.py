"""The decode-aware stage split: the slowest stage is the least any split gives (checked by
enumerating every split of a cost table), and a decoder on a measured split gives the unsplit
tokens."""

from __future__ import annotations

import itertools

import jax
import numpy as np
import pytest

import spectrax_mpmd as mp
from spectrax_core.models import TransformerLM, generate
from spectrax_mpmd._facade.generate.split import _best, _kind


def _every_split(n_blocks: int, n_stages: int):
    for cuts in itertools.combinations(range(1, n_blocks), n_stages - 1):
        bounds = (0, *cuts, n_blocks)
        yield tuple(b - a for a, b in zip(bounds, bounds[1:]))


@pytest.mark.parametrize("n_blocks, n_stages", [(4, 2), (8, 4), (9, 3), (12, 5)])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_split_minimises_the_slowest_stage(n_blocks, n_stages, seed):
    rng = np.random.default_rng(seed)
    fixed, per_block = rng.uniform(1, 3, 3), rng.uniform(0.2, 1, 3)
    fixed[2] += 2  # a heavier last stage (head and sampler), as measured
    cost = {
        (k, b): fixed[k] + per_block[k] * b + rng.uniform(0, 0.1)
        for k in range(3)
        for b in range(1, n_blocks)
    }
    slowest = lambda sizes: max(cost[_kind(s, n_stages), k] for s, k in enumerate(sizes))  # noqa: E731
    got = _best(n_blocks, n_stages, cost)
    assert sum(got) == n_blocks and len(got) == n_stages and min(got) >= 1
    assert slowest(got) == min(slowest(sizes) for sizes in _every_split(n_blocks, n_stages))


def test_a_decoder_on_the_measured_split_gives_the_unsplit_tokens():
    lm = TransformerLM.init(jax.random.key(0), vocab_size=16, d_model=16, n_layers=4, n_heads=2, d_ff=32)
    mesh = mp.create_mesh((2, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:2])
    split = mp.decode_split(lm, mesh=mesh, group_size=2, max_len=9, repeats=2)
    assert sum(split.sizes) == 4 and len(split.sizes) == 2 and min(split.sizes) >= 1
    assert set(split.measured) == {(kind, b) for kind in ("first", "last") for b in (1, 2, 3)}
    assert split.predicted == tuple(
        split.measured[("first", "last")[s], k] for s, k in enumerate(split.sizes)
    )
    prompt = jax.random.randint(jax.random.key(1), (4, 5), 0, 16)
    decoder = mp.PipelineDecoder(lm, mesh=mesh, stage_sizes=split.sizes)
    np.testing.assert_array_equal(decoder.generate(prompt, 4, groups=2), generate(lm, prompt, 4))
    with pytest.raises(mp.StageSplitError, match=r"3 blocks for 4 stages"):
        small = TransformerLM.init(
            jax.random.key(0), vocab_size=16, d_model=16, n_layers=3, n_heads=2, d_ff=32
        )
        mp.decode_split(
            small,
            mesh=mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4]),
            group_size=2,
            max_len=9,
        )
