"""Shared pieces of the MPMD tests: meshes, a heterogeneous pipeline, reference values, cases.

Compiles are the cost of this suite, so every pipelined step built here is
cached for the whole session (`run_case`) and reused by every test that
inspects it (exactness, dispatch order, cell jaxprs, shardings). A module
with a unique name (not `conftest`) so test files can import it directly.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import spectrax_mpmd as mp
from spectrax_core import apply
from spectrax_core import schedules as S
from spectrax_core.losses import softmax_cross_entropy
from spectrax_core.models import TransformerLM, lm_embed, lm_head

RTOL, ATOL = 1e-5, 1e-6
VOCAB, LENGTH, CLASSES, BATCH = 11, 3, 5, 16
# Block widths (and the MLP blocks' hidden widths, 16 and 11): all distinct and
# distinct from CLASSES, so within a stage every weight and activation shape is
# unique — the I/W tests tell dot products apart by their output shapes.
WIDTHS = (8, 12, 6, 10, 7, 9, 13)

FLAT = ("GPipe", "Std1F1B", "Eager1F1B", "ZeroBubbleH1")
VIRTUAL = ("InterleavedH1", "InterleavedGPipe", "Interleaved1F1BPlusOne", "DualPipeV", "KimiK2")
ALL = FLAT + VIRTUAL


def assert_close(actual, expected, rtol=RTOL, atol=ATOL):
    """Every leaf of `actual` equals `expected` (same tree structure) to fp32 rounding."""
    assert jax.tree.structure(actual) == jax.tree.structure(expected)
    for a, e in zip(jax.tree.leaves(actual), jax.tree.leaves(expected)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(e), rtol=rtol, atol=atol)


def unaligned_copy(x) -> np.ndarray:
    """A numpy copy of `x` whose buffer is not 64-byte aligned.

    On CPU, JAX may alias an aligned numpy buffer instead of copying it, so a
    stale placement would still see new contents; an unaligned buffer is
    copied, as it always is on an accelerator.
    """
    x = np.asarray(x, np.float32)
    raw = np.empty(x.size + 1, np.float32)
    start = 1 if raw.ctypes.data % 64 == 0 else 0
    out = raw[start : start + x.size].reshape(x.shape)
    out[...] = x
    assert out.ctypes.data % 64 != 0
    return out


def make_schedule(name: str, microbatches: int, v: int = 1):
    """Schedule `name` with `microbatches`; loop schedules get `virtual_stages=v` (DualPipeV's v is 2)."""
    cls = getattr(S, name)
    if name in VIRTUAL and name != "DualPipeV":
        return cls(microbatches=microbatches, virtual_stages=v)
    return cls(microbatches=microbatches)


def pipeline_mesh(n: int) -> mp.MpmdMesh:
    """`n` pipeline ranks over the 8 fake devices; the rest go to the fsdp axis."""
    return mp.create_mesh((n, 1, -1, 1, 1, 1), mpmd_axis="pp")


# --- the heterogeneous pipeline -------------------------------------------------------------
# Stage 0 embeds int tokens; stages 1 … S-2 are blocks of three different
# parameter structures and widths; stage S-1 pools, projects to CLASSES logits
# and takes the cross-entropy against int labels.


def _block_params(key, kind: int, d_in: int, d_out: int):
    k1, k2 = jax.random.split(key)
    if kind == 0:  # dict of weight and bias
        return {"w": jax.random.normal(k1, (d_in, d_out)) * 0.3, "b": jax.random.normal(k2, (d_out,)) * 0.1}
    if kind == 1:  # tuple: a two-matmul MLP with a hidden width of its own
        hidden = d_in + 4  # 16 and 11: distinct from every width
        return (jax.random.normal(k1, (d_in, hidden)) * 0.3, jax.random.normal(k2, (hidden, d_out)) * 0.3)
    return {  # nested dict: projection then a learned-scale RMS norm
        "proj": {"w": jax.random.normal(k1, (d_in, d_out)) * 0.3},
        "scale": 1.0 + 0.1 * jax.random.normal(k2, (d_out,)),
    }


def _block_apply(kind: int, p, h):
    if kind == 0:
        return jnp.tanh(h @ p["w"] + p["b"])
    if kind == 1:
        return jax.nn.gelu(h @ p[0]) @ p[1]
    y = h @ p["proj"]["w"]
    return y * p["scale"] * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + 1e-5)


def hetero_params(key, n_stages: int) -> dict:
    """Parameters of the `n_stages`-stage heterogeneous pipeline (needs n_stages ≤ 8)."""
    n_blocks = n_stages - 2
    keys = jax.random.split(key, n_blocks + 3)
    return {
        "embed": {
            "table": jax.random.normal(keys[0], (VOCAB, WIDTHS[0])) * 0.5,
            "pos": jax.random.normal(keys[1], (LENGTH, WIDTHS[0])) * 0.1,
        },
        "blocks": [_block_params(keys[2 + k], k % 3, WIDTHS[k], WIDTHS[k + 1]) for k in range(n_blocks)],
        "head": jax.random.normal(keys[-1], (WIDTHS[n_blocks], CLASSES)) * 0.3,
    }


def hetero_loss(params, batch):
    """Embed → blocks (one per stage) → pooled head → mean cross-entropy; a marker after each stage."""
    tokens, labels = batch
    emb = params["embed"]
    h = emb["table"][tokens] + emb["pos"]
    h = mp.sxstage_iter(h)
    for k, block in enumerate(params["blocks"]):
        h = _block_apply(k % 3, block, h)
        h = mp.sxstage_iter(h)
    logits = jnp.mean(h, axis=1) @ params["head"]
    logp = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(logp, labels[:, None], axis=1))


def hetero_batch(key=jax.random.key(7), batch: int = BATCH):
    k1, k2 = jax.random.split(key)
    return (
        jax.random.randint(k1, (batch, LENGTH), 0, VOCAB),
        jax.random.randint(k2, (batch,), 0, CLASSES),
    )


@functools.lru_cache(maxsize=None)
def hetero_reference(n_stages: int):
    """`(params, batch, loss, grads)`: `jax.value_and_grad` of the unsplit function on one device."""
    params = hetero_params(jax.random.key(n_stages), n_stages)
    batch = hetero_batch()
    loss, grads = jax.jit(jax.value_and_grad(hetero_loss))(params, batch)
    return params, batch, loss, grads


# --- one pipelined run per configuration, kept for the session -----------------------------


@dataclass
class Case:
    """A pipelined training step run once, with the reference it should match."""

    name: str
    n: int
    v: int
    remat: bool
    mesh: Any
    schedule: Any
    step: Any
    params: Any
    batch: Any
    loss: Any
    grads: Any
    ref_loss: Any
    ref_grads: Any
    log: list


def microbatches_for(name: str, n: int) -> int:
    """At least 4 microbatches and as many as the schedule needs (n; 2n for DualPipeV)."""
    return 2 * n if name == "DualPipeV" else max(n, 4)


@functools.lru_cache(maxsize=None)
def run_case(name: str, n: int, v: int, remat: bool) -> Case:
    """Build and run the pipelined step of schedule `name` on `n` ranks (cached per configuration)."""
    mesh = pipeline_mesh(n)
    schedule = make_schedule(name, microbatches_for(name, n), v)
    params, batch, ref_loss, ref_grads = hetero_reference(n * schedule.virtual_stages)
    step = mp.sxvalue_and_grad(hetero_loss, mesh=mesh, schedule=schedule, remat=remat)
    loss, grads = step(params, batch)
    return Case(
        name,
        n,
        v,
        remat,
        mesh,
        schedule,
        step,
        params,
        batch,
        loss,
        grads,
        ref_loss,
        ref_grads,
        step.dispatch_log,
    )


def config_of(name: str, wide: bool = False) -> tuple[int, int]:
    """`(n, v)` for a schedule: flat ones on 4 ranks; loop/V ones on 2 ranks x 2 (4 ranks x 2 if `wide`)."""
    if name in FLAT:
        return 4, 1
    return (4, 2) if wide else (2, 2)


# --- the core transformer LM, pipelined by hand -----------------------------------------------

LM_VOCAB, LM_DIM, LM_LEN = 16, 16, 4


def tiny_lm(key, *, n_layers: int, tie_embeddings: bool):
    """A 16-wide core TransformerLM (2 heads, 1 KV head, d_ff 32)."""
    return TransformerLM.init(
        key,
        vocab_size=LM_VOCAB,
        d_model=LM_DIM,
        n_layers=n_layers,
        n_heads=2,
        n_kv_heads=1,
        d_ff=32,
        tie_embeddings=tie_embeddings,
    )


def lm_batch(key, batch: int) -> tuple:
    """`(tokens, next-token targets)`, each `(batch, LM_LEN)` int32."""
    seq = jax.random.randint(key, (batch, LM_LEN + 1), 0, LM_VOCAB)
    return seq[:, :-1], seq[:, 1:]


def pipelined_lm_loss(groups: tuple[int, ...], sharding=None):
    """The LM's next-token loss cut into `len(groups)` stages; stage k runs `groups[k]` blocks.

    Stage 0 also embeds, the last stage also applies the head and the loss;
    `sharding` is the activation's PartitionSpec on each receiving stage.
    """

    def loss(lm, batch):
        tokens, targets = batch
        x = lm_embed(lm, tokens)
        layer = 0
        for k, count in enumerate(groups):
            for _ in range(count):
                x = apply(lm.blocks.layer(layer), x)
                layer += 1
            if k < len(groups) - 1:
                x = mp.sxstage_iter(x, sharding=sharding)
        return softmax_cross_entropy(lm_head(lm, x), targets)

    return loss
