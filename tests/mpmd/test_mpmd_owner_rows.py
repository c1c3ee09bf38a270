"""A rank's slice of a stacked init computed on the rank's rows alone (`_trace.rows`).

A class of stacked inits (blocks made by `vmap` over split keys: normal, truncated normal,
uniform draws; a draw sliced along the stack axis; an iota table; a scale broadcast from size 1; an orthogonal matrix that a
row-wise rule cannot narrow; an unstacked embedding) cut into rank slices of one and two
blocks, and the library's `TransformerLM` cut with `mp.stage_blocks`: each rank's program
gives `jax.jit(init)`'s values (within `ULPS` at the suite's `-O0`, bit for bit at default
optimisation), draws no whole stack, and ranks that keep the same shapes run one program.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec
from test_mpmd_owner_programs import ULPS, at_default_optimisation, ulps

import spectrax_mpmd as mp
from spectrax_core.models import TransformerLM
from spectrax_mpmd._checkpoint.owner_programs import make_leaves
from spectrax_mpmd._trace.rows import rows_program

BLOCKS, D, H = 6, 8, 16


def block(key):
    k = jax.random.split(key, 4)
    return {
        "w": jax.random.normal(k[0], (D, H)) / D**0.5,
        "t": jax.random.truncated_normal(k[1], -2.0, 2.0, (H, D)) * 0.02,
        "u": jax.random.uniform(k[2], (D,), minval=-0.1, maxval=0.1),
        "q": jax.nn.initializers.orthogonal()(k[3], (D, D)),
        "table": jnp.sin(jnp.arange(D, dtype=jnp.float32) / 3.0),
        "scale": jnp.broadcast_to(jnp.ones((1,)) * 0.5, (D,)) * jax.random.normal(k[0], (D,)),
    }


def stacked(key, per_rank: int):
    """Blocks stacked by `vmap`, cut into rank parts of `per_rank` blocks, and an embedding."""
    kb, ke = jax.random.split(key)
    blocks = jax.vmap(block)(jax.random.split(kb, BLOCKS))
    blocks["shifted"] = jax.random.normal(ke, (BLOCKS + 1, D))[1:]  # a slice along the stack axis
    parts = [jax.tree.map(lambda x, a=a: x[a : a + per_rank], blocks) for a in range(0, BLOCKS, per_rank)]
    return {"embed": jax.random.normal(ke, (16, D)), "parts": parts}


def rank_outputs(abstract, rank: int) -> list[int]:
    """Leaf indices of rank `rank`'s part (the embedding goes with rank 0)."""
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(abstract)[0]]
    mine = [k for k, p in enumerate(paths) if p.startswith(f"['parts'][{rank}]")]
    return mine + ([paths.index("['embed']")] if rank == 0 else [])


def programs(init, key, ranks: int):
    closed, abstract = jax.make_jaxpr(init, return_shape=True)(key)
    return closed, abstract, [rank_outputs(abstract, r) for r in range(ranks)]


@pytest.mark.parametrize("per_rank", [1, 2])
def test_each_rank_gets_the_jitted_values_without_drawing_the_whole_stack(per_rank):
    key = jax.random.key(5)
    init = lambda k: stacked(k, per_rank)
    closed, _, outputs = programs(init, key, BLOCKS // per_rank)
    want = jax.tree.leaves(jax.jit(init)(key))
    for outs in outputs:
        fn, offsets = rows_program(closed, outs)
        got = jax.jit(fn)(jnp.asarray(offsets, jnp.int32), key)
        assert max(ulps(g, want[k]) for g, k in zip(got, outs)) <= ULPS
        drawn = jax.make_jaxpr(fn)(jnp.asarray(offsets, jnp.int32), key)
        shapes = {tuple(v.aval.shape) for e in drawn.jaxpr.eqns for v in e.outvars}
        assert not shapes & {(BLOCKS, D, H), (BLOCKS, H, D)}, "a rank drew every block's w or t"
        assert (BLOCKS, D, D) in shapes  # the orthogonal leaf: QR is not row-wise, drawn whole


def test_ranks_keeping_the_same_shapes_run_one_program():
    key = jax.random.key(5)
    closed, _, outputs = programs(lambda k: stacked(k, 2), key, 3)
    texts, starts = [], []
    for outs in outputs[1:]:
        fn, offsets = rows_program(closed, outs)
        texts.append(str(jax.make_jaxpr(fn)(jnp.asarray(offsets, jnp.int32), key)))
        starts.append(offsets)
    assert len(set(texts)) == 1 and len(set(starts)) == 2, starts


def lm(key):
    model = TransformerLM.init(key, vocab_size=32, d_model=16, n_layers=4, n_heads=2, d_ff=32)
    return mp.stage_blocks(model, 4)


def test_staged_lm_init_compiles_one_program_for_every_ranks_blocks(monkeypatch):
    from spectrax_mpmd._compile import compiler as compiler_module

    counts = []
    original = compiler_module.Compiler.prefetch

    def counting(self, specs):
        original(self, specs)
        counts.append((self.stats.compiled, self.stats.relocated, self.relocating))

    monkeypatch.setattr(compiler_module.Compiler, "prefetch", counting)
    key = jax.random.key(0)
    closed, abstract = jax.make_jaxpr(lm, return_shape=True)(key)
    leaves = jax.tree.leaves(abstract)
    owner = [0] * len(leaves)
    for k, (path, _) in enumerate(jax.tree_util.tree_flatten_with_path(abstract)[0]):
        text = jax.tree_util.keystr(path)
        owner[k] = next(
            (r for r in range(4) if f".parts[{r}]" in text), 3 if "head" in text or "norm" in text else 0
        )
    on = [NamedSharding(jax.sharding.Mesh(np.array([d]), ("x",)), PartitionSpec()) for d in jax.devices()[:4]]
    got = make_leaves(closed, key, [on[r] for r in owner], leaves)
    want = jax.tree.leaves(jax.jit(lm)(key))
    assert max(ulps(g, w) for g, w in zip(got, want)) <= ULPS
    compiled, relocated, relocating = counts[0]
    # the 4 ranks' blocks: one program, loaded onto 3 more; the first's embedding and the last's
    # norm and head: one program each (without relocation, each device set compiles its own)
    assert (compiled, relocated) == ((3, 3) if relocating else (6, 0)), counts


VALUES = """
import json, sys
import jax, jax.numpy as jnp
sys.path.insert(0, {here!r})
import test_mpmd_owner_rows as t
from spectrax_mpmd._trace.rows import rows_program
key = jax.random.key(5)
out = {{}}
for per_rank in (2,):
    init = lambda k: t.stacked(k, per_rank)
    closed, abstract, outputs = t.programs(init, key, t.BLOCKS // per_rank)
    want = jax.tree.leaves(jax.jit(init)(key))
    for r, outs in enumerate(outputs):
        fn, offsets = rows_program(closed, outs)
        got = jax.jit(fn)(jnp.asarray(offsets, jnp.int32), key)
        out[f"{{per_rank}}/{{r}}"] = max(t.ulps(g, want[k]) for g, k in zip(got, outs))
print(json.dumps(out))
"""


def test_at_default_optimisation_each_rank_gets_the_jitted_values_bit_for_bit():
    distances = at_default_optimisation(VALUES)
    assert set(distances.values()) == {0.0}, distances
