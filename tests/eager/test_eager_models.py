"""Three small models written as a user of the PyTorch-shaped API would write them, trained
for a few steps: a GPT-2 block stack (CausalSelfAttention, StackedModuleList), a ViT
(Conv2d patches, MultiheadAttention) and a Llama-style model whose weights carry
`sharding=` keywords, trained on a (dp, fsdp, tp) mesh and unsharded with the same numbers."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

import spectrax_core as sc
import spectrax_eager as spx

# ---------------------------------------------------------------- GPT-2


class GPT2Block(spx.Module):
    def __init__(self, d_model, n_heads, dropout, rngs):
        self.ln_1 = spx.nn.LayerNorm(d_model)
        self.attn = spx.nn.CausalSelfAttention(d_model, n_heads, dropout, rngs=rngs)
        self.ln_2 = spx.nn.LayerNorm(d_model)
        self.mlp = spx.nn.MLPBlock(d_model, 4 * d_model, dropout=dropout, rngs=rngs)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2(spx.Module):
    def __init__(self, vocab, d_model, n_heads, n_layers, max_len, rngs, dropout=0.1):
        self.wte = spx.nn.Embed(vocab, d_model, w_init=spx.init.normal(0.02), rngs=rngs)
        self.wpe = spx.nn.Embed(max_len, d_model, w_init=spx.init.normal(0.01), rngs=rngs)
        self.drop = spx.nn.Dropout(dropout, rngs=rngs)
        self.h = spx.nn.StackedModuleList(
            [GPT2Block(d_model, n_heads, dropout, rngs) for _ in range(n_layers)]
        )
        self.ln_f = spx.nn.LayerNorm(d_model)

    def forward(self, tokens):
        pos = jnp.arange(tokens.shape[1])
        x = self.drop(self.wte(tokens) + self.wpe(pos))
        return self.wte.attend(self.ln_f(self.h(x)))  # tied head


# ---------------------------------------------------------------- ViT


class EncoderBlock(spx.Module):
    def __init__(self, d_model, n_heads, rngs):
        self.norm1 = spx.nn.LayerNorm(d_model)
        self.attn = spx.nn.MultiheadAttention(d_model, n_heads, rngs=rngs)
        self.norm2 = spx.nn.LayerNorm(d_model)
        self.mlp = spx.nn.Sequential(
            spx.nn.Linear(d_model, 2 * d_model, rngs=rngs),
            spx.nn.GELU(),
            spx.nn.Linear(2 * d_model, d_model, rngs=rngs),
        )

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h)
        return x + self.mlp(self.norm2(x))


class ViT(spx.Module):
    def __init__(self, image, patch, channels, d_model, n_heads, n_layers, n_classes, rngs):
        self.patch = spx.nn.Conv2d(channels, d_model, patch, stride=patch, padding="VALID", rngs=rngs)
        n_patches = (image // patch) ** 2
        self.cls = spx.Parameter(jnp.zeros((1, 1, d_model)))
        self.pos = spx.Parameter(spx.init.truncated_normal(0.02)(rngs.params(), (1, n_patches + 1, d_model)))
        self.blocks = spx.nn.ModuleList([EncoderBlock(d_model, n_heads, rngs) for _ in range(n_layers)])
        self.norm = spx.nn.LayerNorm(d_model)
        self.head = spx.nn.Linear(d_model, n_classes, rngs=rngs)

    def forward(self, images):
        x = self.patch(images)  # (batch, h', w', d)
        b, d = x.shape[0], x.shape[-1]
        x = x.reshape(b, -1, d)
        x = jnp.concatenate([jnp.broadcast_to(self.cls.value, (b, 1, d)), x], axis=1) + self.pos.value
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x)[:, 0])


# ---------------------------------------------------------------- Llama-style


def rotate(x, positions, theta=10000.0):
    half = x.shape[-1] // 2
    freq = theta ** (-jnp.arange(half) / half)
    angle = positions[:, None] * freq[None, :]
    cos, sin = jnp.cos(angle)[None, :, None, :], jnp.sin(angle)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


class LlamaAttention(spx.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, rngs):
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, d_model // n_heads
        kv = n_kv_heads * self.head_dim
        self.q_proj = spx.nn.Linear(d_model, d_model, use_bias=False, sharding=("EMBED", "HEAD"), rngs=rngs)
        self.k_proj = spx.nn.Linear(d_model, kv, use_bias=False, sharding=("EMBED", "KV_HEAD"), rngs=rngs)
        self.v_proj = spx.nn.Linear(d_model, kv, use_bias=False, sharding=("EMBED", "KV_HEAD"), rngs=rngs)
        self.o_proj = spx.nn.Linear(d_model, d_model, use_bias=False, sharding=("HEAD", "EMBED"), rngs=rngs)

    def forward(self, x):
        b, t, _ = x.shape
        pos = jnp.arange(t)
        q = rotate(self.q_proj(x).reshape(b, t, self.n_heads, self.head_dim), pos)
        k = rotate(self.k_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim), pos)
        v = self.v_proj(x).reshape(b, t, self.n_kv_heads, self.head_dim)
        out = spx.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(out.reshape(b, t, -1))


class LlamaMLP(spx.Module):
    def __init__(self, d_model, d_ff, rngs):
        self.gate_proj = spx.nn.Linear(
            d_model, d_ff, use_bias=False, sharding=spx.sharding.ColumnWise, rngs=rngs
        )
        self.up_proj = spx.nn.Linear(
            d_model, d_ff, use_bias=False, sharding=spx.sharding.ColumnWise, rngs=rngs
        )
        self.down_proj = spx.nn.Linear(
            d_ff, d_model, use_bias=False, sharding=spx.sharding.RowWise, rngs=rngs
        )

    def forward(self, x):
        return self.down_proj(spx.functional.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaLayer(spx.Module):
    def __init__(self, d_model, n_heads, n_kv_heads, d_ff, rngs):
        self.input_layernorm = spx.nn.RMSNorm(d_model)
        self.self_attn = LlamaAttention(d_model, n_heads, n_kv_heads, rngs)
        self.post_attention_layernorm = spx.nn.RMSNorm(d_model)
        self.mlp = LlamaMLP(d_model, d_ff, rngs)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(spx.Module):
    def __init__(self, vocab, d_model, n_heads, n_kv_heads, d_ff, n_layers, rngs):
        self.embed_tokens = spx.nn.Embed(vocab, d_model, sharding=("VOCAB", "EMBED"), rngs=rngs)
        self.layers = spx.nn.ModuleList(
            [LlamaLayer(d_model, n_heads, n_kv_heads, d_ff, rngs) for _ in range(n_layers)]
        )
        self.norm = spx.nn.RMSNorm(d_model)
        self.lm_head = spx.nn.Linear(d_model, vocab, use_bias=False, sharding=("EMBED", "VOCAB"), rngs=rngs)

    def forward(self, tokens):
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# ---------------------------------------------------------------- training


def _lm_loss(model, tokens):
    logits = model(tokens[:, :-1])
    return sc.losses.softmax_cross_entropy(logits, tokens[:, 1:])


def _train(model, loss_fn, batch, steps, lr=3e-3, mesh=None):
    opt = spx.Optimizer(model, optax.adam(lr), wrt="parameters")

    @spx.jit(mutable=("parameters", "opt_state"), mesh=mesh)
    def step(model, opt, *batch):
        loss, grads = spx.value_and_grad(loss_fn)(model, *batch)
        opt.update(model, grads)
        return loss

    return [float(step(model, opt, *batch)) for _ in range(steps)]


def _tokens(seed, shape, vocab):
    return jnp.asarray(np.random.default_rng(seed).integers(0, vocab, shape), jnp.int32)


def test_gpt2_block_stack_trains():
    model = GPT2(vocab=32, d_model=16, n_heads=2, n_layers=2, max_len=16, rngs=spx.Rngs(0))
    assert model.h.layers.attn.q.weight.shape == (2, 16, 16)
    tokens = _tokens(0, (4, 9), 32)
    losses = _train(model, _lm_loss, (tokens,), steps=8, lr=1e-2)
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0] - 0.3


def test_vit_with_multihead_attention_and_conv_patches_trains():
    model = ViT(
        image=8, patch=4, channels=3, d_model=16, n_heads=2, n_layers=1, n_classes=3, rngs=spx.Rngs(1)
    )
    images = jnp.asarray(np.random.default_rng(1).standard_normal((6, 8, 8, 3)), jnp.float32)
    labels = jnp.asarray([0, 1, 2, 0, 1, 2])

    def loss_fn(model, images, labels):
        return sc.losses.softmax_cross_entropy(model(images), labels)

    losses = _train(model, loss_fn, (images, labels), steps=8, lr=1e-2)
    assert np.all(np.isfinite(losses)) and losses[-1] < 0.5 * losses[0]


def test_llama_with_sharding_keywords_trains_sharded_and_unsharded_alike():
    auto = (jax.sharding.AxisType.Auto,) * 3
    mesh = jax.make_mesh((2, 2, 2), ("dp", "fsdp", "tp"), axis_types=auto)
    config = dict(vocab=32, d_model=16, n_heads=4, n_kv_heads=2, d_ff=32, n_layers=1)
    with jax.set_mesh(mesh):
        sharded = Llama(**config, rngs=spx.Rngs(2))
    plain = Llama(**config, rngs=spx.Rngs(2))
    rules = sc.sharding.Rules.default()
    w = sharded.layers[0].self_attn.k_proj.weight
    assert w.value.sharding.spec == sc.sharding.spec(("EMBED", "KV_HEAD"), rules, mesh=mesh, shape=w.shape)
    assert w.value.sharding.spec == jax.sharding.PartitionSpec("fsdp", "tp")
    assert sharded.layers[0].mlp.down_proj.weight.axes == ("MLP", "EMBED")
    tokens = _tokens(2, (8, 9), 32)
    sharded_losses = _train(sharded, _lm_loss, (tokens,), steps=4, mesh=mesh)
    plain_losses = _train(plain, _lm_loss, (tokens,), steps=4)
    np.testing.assert_allclose(sharded_losses, plain_losses, rtol=1e-5)
    assert sharded_losses[-1] < sharded_losses[0]
