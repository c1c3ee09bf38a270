"""Dispatch overhead of the eager facade against raw JAX and other frameworks.

One process; every framework runs the same 2-layer pre-norm transformer with
the same weights and the same `spectrax_core` math (d=64 and d=48, seq 16,
batch 2, fp32), so the differences are framework overhead: the forward loss, an
SGD train step, and a jitted no-op over the whole model (framework overhead
alone). Frameworks are interleaved round by round; each round times
`--calls` calls (each followed by `block_until_ready`), and the reported time
is the median over `--rounds` rounds. Columns: raw `jax.jit` over a params
dict; `spectrax_core` + `jax.jit`; `spx.jit`; `equinox.filter_jit`;
`flax.nnx.jit` and `nnx.cached_partial` (when flax is installed);
`spectrax-lib` (`import spectrax`, when installed; its own Linear/LayerNorm
holding the same weights, the same formulas). Before timing, every column's loss
is checked (rtol 1e-5) against the same transformer written independently in
jax.numpy. Framework order is shuffled each round. Besides the medians the
table gives each column's min and spread, the calling thread's CPU time, and
the paired overhead (median over rounds of column minus raw within a round),
which stays readable on a shared, noisy machine.

    python benchmarks/dispatch.py [--rounds 5] [--calls 1000] [--only spx.jit]
        [--json benchmarks/results/dispatch.json]
    python benchmarks/dispatch.py --facade   # the facade's own work per call, without XLA
    JAX_PLATFORMS=tpu python benchmarks/dispatch.py   # on the accelerator (default: the CPU)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics

os.environ.setdefault("JAX_PLATFORMS", "cpu")

import equinox as eqx  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from _timing import interleaved, issue_clock, ratio, summary, times  # noqa: E402

import spectrax_core as sc  # noqa: E402
import spectrax_eager as spx  # noqa: E402

LR = 1e-4
SEQ, BATCH, HEADS, LAYERS = 16, 2, 4, 2


# ---------------------------------------------------------------- raw JAX


def raw_params(core_blocks: list, core_norm) -> dict:
    """The same weights as a plain dict (built from the core params)."""
    layers = []
    for b in core_blocks:
        layers.append({
            "ln1_s": b.norm1.scale, "ln1_b": b.norm1.bias, "ln2_s": b.norm2.scale, "ln2_b": b.norm2.bias,
            "wq": b.attn.q.weight, "wk": b.attn.k.weight, "wv": b.attn.v.weight, "wo": b.attn.o.weight,
            "w_up": b.mlp.up.weight, "w_down": b.mlp.down.weight,
        })
    return {"layers": layers, "ln_s": core_norm.scale, "ln_b": core_norm.bias}


def _ln(x, s, b, eps=1e-5):
    m = x.mean(-1, keepdims=True)
    v = jnp.mean((x - m) ** 2, -1, keepdims=True)
    return (x - m) * jax.lax.rsqrt(v + eps) * s + b


def raw_forward(p: dict, x: jax.Array) -> jax.Array:
    b, t, d = x.shape
    hd = d // HEADS
    causal = jnp.tril(jnp.ones((t, t), bool))
    for lp in p["layers"]:
        h = _ln(x, lp["ln1_s"], lp["ln1_b"])
        q = (h @ lp["wq"]).reshape(b, t, HEADS, hd)
        k = (h @ lp["wk"]).reshape(b, t, HEADS, hd)
        v = (h @ lp["wv"]).reshape(b, t, HEADS, hd)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
        probs = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(jnp.float32).min), -1)
        x = x + jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d) @ lp["wo"]
        x = x + jax.nn.gelu(_ln(x, lp["ln2_s"], lp["ln2_b"]) @ lp["w_up"]) @ lp["w_down"]
    return _ln(x, p["ln_s"], p["ln_b"])


def raw_loss(p, x, y):
    """The same loss written independently in jax.numpy (a correctness check of every column)."""
    return jnp.mean((raw_forward(p, x) - y) ** 2)


def flat_params(core) -> tuple[dict, object]:
    """The core model's arrays as a flat `{"NNN.path": array}` dict (keys sort in leaf order)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(core)
    return {f"{i:03d}{jax.tree_util.keystr(k)}": v for i, (k, v) in enumerate(leaves)}, treedef


def from_flat(p: dict, treedef) -> object:
    return jax.tree.unflatten(treedef, [p[k] for k in sorted(p)])


# --------------------------------------------------------- spectrax_core


class CoreModel(eqx.Module):
    blocks: list
    norm: sc.nn.LayerNorm


def core_loss(m: CoreModel, x, y):
    for blk in m.blocks:
        x = sc.apply(blk, x)
    return jnp.mean((sc.apply(m.norm, x) - y) ** 2)


# ---------------------------------------------------------------- spx


class SpxModel(spx.Module):
    def __init__(self, core: CoreModel):
        self.blocks = spx.nn.ModuleList([spx.nn.from_core(b) for b in core.blocks])
        self.norm = spx.nn.from_core(core.norm)

    def forward(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.norm(x)


def spx_loss(m, x, y):
    return jnp.mean((m(x) - y) ** 2)


# ---------------------------------------------------------- spectrax-lib
# Its own `nn.Linear`/`nn.LayerNorm` hold the core weights; attention and MLP are
# small `spectrax.Module`s whose forward is the core math in jax.numpy. Its graph
# layer re-imports module classes by qualified name, so they live at module level.

try:
    import spectrax as sxl
except ImportError:
    sxl = None

if sxl is not None:

    def _sxl_linear(w):
        lin = sxl.nn.Linear(w.shape[0], w.shape[1], use_bias=False, rngs=0)
        lin.weight.value = w
        return lin

    def _sxl_layer_norm(n):
        ln = sxl.nn.LayerNorm(n.scale.shape[-1], eps=n.eps)
        ln.weight.value, ln.bias.value = n.scale, n.bias
        return ln

    class SxlAttention(sxl.Module):
        def __init__(self, a):
            self.q, self.k, self.v = _sxl_linear(a.q.weight), _sxl_linear(a.k.weight), _sxl_linear(a.v.weight)
            self.o = _sxl_linear(a.o.weight)

        def forward(self, h):
            b, t, d = h.shape
            hd = d // HEADS
            q, k, v = (f(h).reshape(b, t, HEADS, hd) for f in (self.q, self.k, self.v))
            logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(hd)
            causal = jnp.tril(jnp.ones((t, t), bool))
            probs = jax.nn.softmax(jnp.where(causal, logits, jnp.finfo(logits.dtype).min), -1)
            return self.o(jnp.einsum("bhqk,bkhd->bqhd", probs, v).reshape(b, t, d))

    class SxlMLP(sxl.Module):
        def __init__(self, m):
            self.up, self.down = _sxl_linear(m.up.weight), _sxl_linear(m.down.weight)

        def forward(self, h):
            return self.down(jax.nn.gelu(self.up(h)))

    class SxlBlock(sxl.Module):
        def __init__(self, blk):
            self.norm1, self.attn = _sxl_layer_norm(blk.norm1), SxlAttention(blk.attn)
            self.norm2, self.mlp = _sxl_layer_norm(blk.norm2), SxlMLP(blk.mlp)

        def forward(self, x):
            x = x + self.attn(self.norm1(x))
            return x + self.mlp(self.norm2(x))

    class SxlModel(sxl.Module):
        def __init__(self, core: CoreModel):
            self.blocks = sxl.nn.ModuleList([SxlBlock(b) for b in core.blocks])
            self.norm = _sxl_layer_norm(core.norm)

        def forward(self, x):
            for blk in self.blocks:
                x = blk(x)
            return self.norm(x)


# -------------------------------------------------------------- columns


def make_columns(core: CoreModel, x, y) -> dict[str, dict]:
    """Per framework: `fwd()`, `train()`, `noop()` closures and `loss()` for the equality check."""
    cols: dict[str, dict] = {}
    sgd = lambda p, g: jax.tree.map(lambda a, b: a - LR * b, p, g)  # noqa: E731

    # raw jax.jit over a params pytree (a flat dict of arrays; the same core math as every column)
    flat, treedef = flat_params(core)
    box = {"p": flat}

    def flat_loss(p, x, y):
        return core_loss(from_flat(p, treedef), x, y)

    r_fwd, r_noop = jax.jit(flat_loss), jax.jit(lambda p, x: x)

    @jax.jit
    def r_train(p, x, y):
        loss, g = jax.value_and_grad(flat_loss)(p, x, y)
        return loss, sgd(p, g)

    def raw_train():
        loss, box["p"] = r_train(box["p"], x, y)
        return loss

    cols["raw jax.jit"] = dict(fwd=lambda: r_fwd(box["p"], x, y), train=raw_train,
                                noop=lambda: r_noop(box["p"], x), loss=lambda: r_fwd(box["p"], x, y))

    # spectrax_core + jax.jit
    cbox = {"m": core}
    c_fwd, c_noop = jax.jit(core_loss), jax.jit(lambda m, x: x)

    @jax.jit
    def c_train(m, x, y):
        loss, g = jax.value_and_grad(core_loss)(m, x, y)
        return loss, sgd(m, g)

    def core_train():
        loss, cbox["m"] = c_train(cbox["m"], x, y)
        return loss

    cols["core+jax.jit"] = dict(fwd=lambda: c_fwd(cbox["m"], x, y), train=core_train,
                                 noop=lambda: c_noop(cbox["m"], x), loss=lambda: c_fwd(cbox["m"], x, y))

    # spx.jit
    model = SpxModel(core)
    s_fwd, s_noop = spx.jit(spx_loss), spx.jit(lambda m, x: x)

    @spx.jit(mutable="parameters")
    def s_train(m, x, y):
        loss, g = spx.value_and_grad(spx_loss)(m, x, y)
        spx.update(m, sgd(spx.tree_state(m).filter("parameters"), g))
        return loss

    cols["spx.jit"] = dict(fwd=lambda: s_fwd(model, x, y), train=lambda: s_train(model, x, y),
                            noop=lambda: s_noop(model, x), loss=lambda: s_fwd(model, x, y),
                            jitted=dict(fwd=(s_fwd, (model, x, y)), train=(s_train, (model, x, y)),
                                        noop=(s_noop, (model, x))))

    # equinox.filter_jit
    ebox = {"m": core}
    e_fwd, e_noop = eqx.filter_jit(core_loss), eqx.filter_jit(lambda m, x: x)

    @eqx.filter_jit
    def e_train(m, x, y):
        loss, g = eqx.filter_value_and_grad(core_loss)(m, x, y)
        return loss, eqx.apply_updates(m, jax.tree.map(lambda g: -LR * g, g))

    def eqx_train():
        loss, ebox["m"] = e_train(ebox["m"], x, y)
        return loss

    cols["equinox.filter_jit"] = dict(fwd=lambda: e_fwd(ebox["m"], x, y), train=eqx_train,
                                       noop=lambda: e_noop(ebox["m"], x), loss=lambda: e_fwd(ebox["m"], x, y))

    cols.update(_nnx_columns(core, x, y))
    cols.update(_spectrax_lib_columns(core, x, y))
    return cols


def _nnx_columns(core, x, y) -> dict[str, dict]:
    try:
        from flax import nnx
    except ImportError:
        return {}
    flat, treedef = flat_params(core)

    class Model(nnx.Module):
        """One nnx.Param per core array; the forward is the core math."""

        def __init__(self):
            self.names = tuple(flat)
            for i, k in enumerate(self.names):
                setattr(self, f"p{i}", nnx.Param(flat[k]))

        def __call__(self, x):
            p = {k: getattr(self, f"p{i}")[...] for i, k in enumerate(self.names)}
            m = from_flat(p, treedef)
            for blk in m.blocks:
                x = sc.apply(blk, x)
            return sc.apply(m.norm, x)

    def loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    model, cached_model = Model(), Model()  # each column trains its own copy
    n_fwd, n_noop = nnx.jit(loss), nnx.jit(lambda m, x: x)

    def train(m, x, y):
        value, g = nnx.value_and_grad(loss)(m, x, y)
        ps = nnx.state(m, nnx.Param)
        nnx.update(m, jax.tree.map(lambda a, b: a - LR * b, ps, g))
        return value

    n_train = nnx.jit(train)
    cached_fwd = nnx.cached_partial(n_fwd, cached_model)
    cached_train = nnx.cached_partial(n_train, cached_model)
    cached_noop = nnx.cached_partial(n_noop, cached_model)
    return {
        "flax.nnx.jit": dict(fwd=lambda: n_fwd(model, x, y), train=lambda: n_train(model, x, y),
                             noop=lambda: n_noop(model, x), loss=lambda: n_fwd(model, x, y)),
        "nnx.cached_partial": dict(fwd=lambda: cached_fwd(x, y), train=lambda: cached_train(x, y),
                                   noop=lambda: cached_noop(x), loss=lambda: cached_fwd(x, y)),
    }


def _spectrax_lib_columns(core: CoreModel, x, y) -> dict[str, dict]:
    """spectrax-lib (`import spectrax`) is not a dependency: its column is skipped when absent."""
    if sxl is None:
        return {}

    def loss(m, x, y):
        return jnp.mean((m(x) - y) ** 2)

    model = SxlModel(core)
    l_fwd, l_noop = sxl.jit(loss), sxl.jit(lambda m, x: x)

    @sxl.jit(mutable="parameters")
    def l_train(m, x, y):
        value, g = sxl.value_and_grad(loss)(m, x, y)
        params = sxl.tree_state(m).filter("parameters")
        sxl.update(m, jax.tree.map(lambda a, b: a - LR * b, params, g))
        return value

    return {"spectrax-lib": dict(fwd=lambda: l_fwd(model, x, y), train=lambda: l_train(model, x, y),
                                 noop=lambda: l_noop(model, x), loss=lambda: l_fwd(model, x, y))}


# ---------------------------------------------------------------- timing


def run(d: int, rounds: int, calls: int, only: list[str] | None = None) -> dict:
    k = jax.random.key(d)
    kb, kx, ky = jax.random.split(k, 3)
    blocks = [sc.nn.Block.init(kk, d, HEADS, 4 * d) for kk in jax.random.split(kb, LAYERS)]
    core = CoreModel(blocks=blocks, norm=sc.nn.LayerNorm.init(None, d))
    x = jax.random.normal(kx, (BATCH, SEQ, d))
    y = jax.random.normal(ky, (BATCH, SEQ, d))
    cols = make_columns(core, x, y)
    if only:
        unknown = sorted(set(only) - set(cols))
        if unknown:
            raise ValueError(f"--only: unknown columns {unknown}; the columns are {list(cols)}.")
        cols = {n: c for n, c in cols.items() if n in only or n == "raw jax.jit"}
    ref = float(jax.jit(raw_loss)(raw_params(core.blocks, core.norm), x, y))
    losses = {name: float(c["loss"]()) for name, c in cols.items()}
    for name, loss in losses.items():
        if not np.isclose(loss, ref, rtol=1e-5):
            raise AssertionError(f"d={d}: {name} computes loss {loss}, the jax.numpy reference {ref}")
    for c in cols.values():  # compile everything before timing
        for w in ("fwd", "train", "noop"):
            jax.block_until_ready(c[w]())
    # seconds per call of each round; a round times every workload, the frameworks in a new order
    # for each (no framework always runs right after another)
    times = {w: {name: [] for name in cols} for w in ("fwd", "train", "noop")}
    cpu = {w: {name: [] for name in cols} for w in ("fwd", "train", "noop")}
    rng = np.random.default_rng(0)
    for _ in range(rounds):
        for w in ("fwd", "train", "noop"):
            wall, thread = interleaved({name: c[w] for name, c in cols.items()}, 1, calls, shuffle=rng)
            for name in cols:
                times[w][name] += wall[name]
                cpu[w][name] += thread[name]
    stats = {w: {n: summary(times[w][n], cpu[w][n], unit="us") for n in cols} for w in times}

    def pick(key):
        return {w: {n: s[key] for n, s in t.items()} for w, t in stats.items()}

    def us(seconds):
        return {w: {n: [x * 1e6 for x in v] for n, v in r.items()} for w, r in seconds.items()}

    return {"d": d, "clock": issue_clock().name, "loss": ref, "losses": losses, "median_us": pick("median_us"), "min_us": pick("min_us"),
            "spread": pick("spread"), "cpu_median_us": pick("cpu_median_us"), "rounds_us": us(times),
            "rounds_cpu_us": us(cpu)}


WORKLOADS = (("fwd", "forward"), ("train", "train step"), ("noop", "no-op"))


def facade_us(jitted, args: tuple, calls: int) -> float:
    """The facade's own work per `spx.jit` call, in µs: the compiled program is swapped for a
    stub returning its real outputs, so what is timed is argument handling, reading the
    variables' values and writing back, without XLA and hot in the caches (min of 7 interleaved
    rounds, the garbage collector off as in `timeit`, minus the stub's own cost)."""
    (key, program), = jitted._cache.items()
    values = [v.value for _, v in spx.iter_variables(args[0])]
    out, updates = program(values, *args[1:])
    stub = lambda values, *leaves: (out, dict(updates))  # noqa: E731
    jitted._cache[key] = stub
    hot = getattr(jitted, "_hot", None)  # the remembered last call, when the version has one
    if hot is not None:
        jitted._hot = (*hot[:4], stub, hot[5])
    try:
        wall, _ = interleaved(
            {"call": lambda: jitted(*args), "stub": lambda: stub(values, *args[1:])},
            7,
            calls,
            wait=None,
            collect_garbage=False,
        )
    finally:
        jitted._cache[key] = program
        if hot is not None:
            jitted._hot = None
    per, own = (summary(wall[k], unit="us")["min_us"] for k in ("call", "stub"))
    return per - own


def facade_table(d: int, calls: int) -> tuple[str, dict]:
    k = jax.random.key(d)
    kb, kx, ky = jax.random.split(k, 3)
    blocks = [sc.nn.Block.init(kk, d, HEADS, 4 * d) for kk in jax.random.split(kb, LAYERS)]
    core = CoreModel(blocks=blocks, norm=sc.nn.LayerNorm.init(None, d))
    x, y = jax.random.normal(kx, (BATCH, SEQ, d)), jax.random.normal(ky, (BATCH, SEQ, d))
    jitted = make_columns(core, x, y)["spx.jit"]["jitted"]
    out = {}
    for w, _ in WORKLOADS:
        fn, args = jitted[w]
        jax.block_until_ready(fn(*args))
        out[w] = facade_us(fn, args, calls)
    line = ", ".join(f"{title} {out[w]:.2f}" for w, title in WORKLOADS)
    return f"d={d}: spx.jit facade work per call, program stubbed (µs): {line}", out


def table(result: dict) -> str:
    """Per workload: wall median (ratio to raw), min and spread ((max - min) / median over the
    rounds), the calling thread's CPU time median (ratio to raw; its wall time where this machine's
    thread CPU clock is too coarse: the column names the clock), and the paired overheads: the
    median over rounds of (column - raw) in the same round, wall and issue clock. A ratio to a
    raw time that measured 0 prints as n/a."""
    med, low, cpu, spreads = result["median_us"], result["min_us"], result["cpu_median_us"], result["spread"]
    rounds, rounds_cpu = result["rounds_us"], result["rounds_cpu_us"]
    names = list(med["fwd"])
    lines = [
        f"d={result['d']} (seq {SEQ}, batch {BATCH}, {LAYERS} layers, fp32); µs per call over the rounds"
    ]
    for w, title in WORKLOADS:
        raw, raw_cpu = med[w]["raw jax.jit"], cpu[w]["raw jax.jit"]
        lines.append(
            f"{title:<22} {'median':>16} {'min':>8} {'spread':>7} {result['clock']:>16} "
            f"{'paired +wall':>13} {'+CPU':>7}"
        )
        for n in names:
            spread = spreads[w][n]
            d_wall = statistics.median(a - b for a, b in zip(rounds[w][n], rounds[w]["raw jax.jit"]))
            d_cpu = statistics.median(a - b for a, b in zip(rounds_cpu[w][n], rounds_cpu[w]["raw jax.jit"]))
            lines.append(
                f"  {n:<20} {med[w][n]:8.1f} ({times(ratio(med[w][n], raw)):>5}) {low[w][n]:8.1f} "
                f"{spread:6.0%} {cpu[w][n]:8.1f} ({times(ratio(cpu[w][n], raw_cpu)):>5}) {d_wall:13.1f} "
                f"{d_cpu:7.1f}"
            )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--calls", type=int, default=1000)
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 48])
    ap.add_argument("--json", default="benchmarks/results/dispatch.json")
    ap.add_argument("--facade", action="store_true",
                    help="only time the facade's own work per spx.jit call (the compiled program stubbed)")
    ap.add_argument("--only", nargs="+", default=None,
                    help='time only these columns (and "raw jax.jit"), e.g. --only spx.jit')
    args = ap.parse_args()
    if args.rounds < 1 or args.calls < 1:
        raise ValueError("--rounds and --calls must be at least 1 (the figure uses >= 5 and >= 1000).")
    if sxl is None:
        print("spectrax-lib (`import spectrax`) is not installed: its column is skipped.")
    if args.facade:
        for d in args.dims:
            print(facade_table(d, max(args.calls, 1000) * 10)[0])
        return
    device = jax.devices()[0]
    print(f"on {device.device_kind} ({device.platform}); issue times on the {issue_clock().name} clock")
    if issue_clock().note:
        print(issue_clock().note)
    results = [run(d, args.rounds, args.calls, args.only) for d in args.dims]
    for r in results:
        print(table(r), end="\n\n")
    if args.json:
        os.makedirs(os.path.dirname(args.json) or ".", exist_ok=True)
        record = {"device": device.device_kind, "rounds": args.rounds, "calls": args.calls, "results": results}
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
