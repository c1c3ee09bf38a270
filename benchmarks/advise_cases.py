"""The advisor on models it was not developed against, under budgets of 40-70% of plain Std1F1B's peak.

Three models of different shapes, each a function of the stage count: a byte LM cut into
half-blocks (attention, then MLP, each its own stage), a two-tower model (two MLP
towers, each block updating one, joined by a contrastive loss over each microbatch,
`reduce="mean"`) and a deep narrow MLP. For each budget `mp.advise` (AdamW, the update
timed) picks a step; the pick, the top fitting candidates by prediction and plain
Std1F1B are then built and run in interleaved rounds (`_timing.interleaved`), their
order shuffled anew each round (seeded): on shared cores a step's place in a fixed order
skews its time (measured: steps predicted alike up to 1.33x apart). A step's measured
time is the least over the rounds (other work on the shared cores only ever adds time,
in bursts that a median of a few rounds does not always outlast; the median is reported
next to it). Per case: (a) whether the pick fits, measured (`measure_peak_bytes`, device
bytes); (b) its measured time relative to plain Std1F1B against the predicted ratio
(within 25%?); (c) whether any measured fitting candidate is more than 10% faster than
the pick. `advise`'s own time is reported for a cold profile cache and a warm one (the
second and later budgets of a model reuse its profiles). Prints one table per case and
writes benchmarks/results/advise_cases.json.

    python benchmarks/advise_cases.py                    # every model, budgets 0.4 0.55 0.7
    python benchmarks/advise_cases.py --models mlp --budgets 0.5 --top 3
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import statistics
import tempfile

from _devices import cpu_devices

cpu_devices(8)  # before JAX is imported

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from _timing import interleaved, once  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402

OUT = pathlib.Path(__file__).parent / "results" / "advise_cases.json"
MESH = mp.create_mesh((4, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=jax.devices()[:4])
TX = optax.adamw(1e-3)


def _normal(key, shape, scale):
    return jax.random.normal(key, shape) * scale


def _cut(units: int, n_stages: int) -> set:
    """The unit indices after which a stage ends, `units` cut into `n_stages` near-even stages."""
    sizes = mp.stage_sizes(units, n_stages)
    return {sum(sizes[: k + 1]) for k in range(len(sizes) - 1)}


def byte_lm(blocks: int = 4, d: int = 64, length: int = 64, batch: int = 32):
    """A byte LM (vocab 256) of `blocks` pre-norm blocks, each cut as two half-blocks (attention,
    MLP): `fn(n_stages) -> (loss, (params, tokens, targets))` for up to `2 * blocks` stages."""
    keys = iter(jax.random.split(jax.random.key(0), 6 * blocks + 4))
    params = {
        "embed": _normal(next(keys), (256, d), 0.02),
        "blocks": [
            {
                "qkv": _normal(next(keys), (d, 3 * d), d**-0.5),
                "proj": _normal(next(keys), (d, d), d**-0.5),
                "up": _normal(next(keys), (d, 4 * d), d**-0.5),
                "down": _normal(next(keys), (4 * d, d), (4 * d) ** -0.5),
            }
            for _ in range(blocks)
        ],
        "head": _normal(next(keys), (d, 256), d**-0.5),
    }
    tokens = jax.random.randint(next(keys), (batch, length), 0, 256)
    targets = jnp.roll(tokens, -1, axis=1)

    def norm(x):
        return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-6)

    def attention(x, p):
        q, k, v = jnp.split(norm(x) @ p["qkv"], 3, -1)
        mask = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
        w = jnp.where(mask, q @ jnp.swapaxes(k, 1, 2) / d**0.5, -1e9)
        return x + jax.nn.softmax(w, -1) @ v @ p["proj"]

    def mlp(x, p):
        return x + jax.nn.gelu(norm(x) @ p["up"]) @ p["down"]

    def build(n_stages):
        ends = _cut(2 * blocks, n_stages)

        def loss(params, tokens, targets):
            x = params["embed"][tokens]
            for h in range(2 * blocks):
                x = (attention if h % 2 == 0 else mlp)(x, params["blocks"][h // 2])
                if h + 1 in ends:
                    x = mp.sxstage_iter(x)
            logp = jax.nn.log_softmax(norm(x) @ params["head"])
            return -jnp.mean(jnp.take_along_axis(logp, targets[..., None], -1))

        return loss, (params, tokens, targets)

    return build


def two_tower(blocks: int = 8, d: int = 64, batch: int = 512):
    """Two MLP towers (inputs of 128 and 48 features) of `blocks // 2` blocks each, computed one
    block at a time, joined by a contrastive loss over the batch (pipelined: over each microbatch,
    see `STEP_SETTINGS`)."""
    keys = iter(jax.random.split(jax.random.key(1), 2 * blocks + 6))
    params = {
        "in_a": _normal(next(keys), (128, d), 128**-0.5),
        "in_b": _normal(next(keys), (48, d), 48**-0.5),
        "blocks": [
            {
                "w1": _normal(next(keys), (d, 2 * d), d**-0.5),
                "w2": _normal(next(keys), (2 * d, d), 0.5 / d**0.5),
            }
            for _ in range(blocks)
        ],
    }
    a = jax.random.normal(next(keys), (batch, 128))
    b = jax.random.normal(next(keys), (batch, 48))

    def build(n_stages):
        ends = _cut(blocks, n_stages)

        def loss(params, a, b):
            xa, xb = a @ params["in_a"], b @ params["in_b"]
            for k, p in enumerate(params["blocks"]):
                if k % 2 == 0:
                    xa = xa + jnp.tanh(xa @ p["w1"]) @ p["w2"]
                else:
                    xb = xb + jnp.tanh(xb @ p["w1"]) @ p["w2"]
                if k + 1 in ends:
                    xa, xb = mp.sxstage_iter((xa, xb))
            logits = xa @ xb.T / d**0.5
            return -jnp.mean(jnp.diag(jax.nn.log_softmax(logits, -1)))

        return loss, (params, a, b)

    return build


def deep_mlp(layers: int = 16, width: int = 48, batch: int = 256):
    """A deep narrow MLP regressor: `layers` residual layers of `width`, a squared loss."""
    keys = iter(jax.random.split(jax.random.key(2), layers + 3))
    params = [_normal(next(keys), (width, width), 0.7 / width**0.5) for _ in range(layers)]
    x = jax.random.normal(next(keys), (batch, width))
    y = jax.random.normal(next(keys), (batch, width))

    def build(n_stages):
        ends = _cut(layers, n_stages)

        def loss(params, x, y):
            for k, w in enumerate(params):
                x = x + jnp.tanh(x @ w)
                if k + 1 in ends:
                    x = mp.sxstage_iter(x)
            return jnp.mean((x - y) ** 2)

        return loss, (params, x, y)

    return build


MODELS = {"byte_lm": byte_lm, "two_tower": two_tower, "mlp": deep_mlp}
# the two towers' contrastive loss pairs the rows of a batch with each other: pipelined, each
# microbatch's rows are each other's negatives and the step averages the microbatches' losses,
# which a loss not equal to the whole batch's must ask for (without it the step refuses)
STEP_SETTINGS = {"two_tower": {"reduce": "mean"}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--budgets", type=float, nargs="+", default=[0.4, 0.55, 0.7], help="of Std1F1B's peak")
    p.add_argument("--microbatches", type=int, nargs="+", default=[8])
    p.add_argument("--top", type=int, default=4, help="fitting candidates measured besides the pick")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds")
    return p.parse_args(argv)


def _contenders(advice, top: int) -> list:
    """The pick, the next `top` fitting candidates by prediction, and plain Std1F1B."""
    chosen = [advice.best, *[c for c in advice.fitting if c is not advice.best][:top]]
    if advice.default not in chosen:
        chosen.append(advice.default)
    return chosen


def _run(advice, candidates: list, rounds: int) -> dict:
    """Per candidate: median and min step seconds over interleaved rounds of a training loop (each
    call takes the parameters and state the last one returned, donated, as in training), and the
    measured device peak of the step."""
    calls, peaks = {}, {}
    for k, c in enumerate(candidates):
        step = advice.step(TX, candidate=c)
        params, *batch = advice.arguments(c)
        params = jax.tree.map(jnp.copy, params)
        state = [params, TX.init(params)]
        peaks[k] = max(step.measure_peak_bytes(*state, *batch))  # copies what it donates
        calls[k] = _looped(step, state, batch)
        calls[k]()  # compile
    wall, _ = interleaved(calls, rounds, shuffle=random.Random(0))
    return {k: (statistics.median(w), min(w), peaks[k]) for k, w in wall.items()}


def _looped(step, state: list, batch: list):
    """A call of `step` on `state` (params, optimizer state) that keeps what it returns."""

    def call():
        loss, state[0], state[1] = step(*state, *batch)
        return loss, state[0], state[1]

    return call


def case(name: str, build, fraction: float, plain_peak: int, args, cache: str) -> dict:
    budget = int(fraction * plain_peak)
    made = []
    kwargs = dict(mesh=MESH, tx=TX, memory_budget=budget, microbatches=tuple(args.microbatches))
    kwargs.update(STEP_SETTINGS.get(name, {}))
    seconds, _ = once(lambda: made.append(mp.advise(build, profile_cache=cache, **kwargs)), wait=None)
    (advice,) = made
    if not advice.fitting:  # the parameters and optimizer state alone exceed it
        least = max(advice.smallest_peak.peak_bytes)
        return {
            "model": name,
            "budget_fraction": fraction,
            "budget": budget,
            "advise_s": seconds,
            "fits": False,
            "least_budget": least,
            "rows": [],
        }
    candidates = _contenders(advice, args.top)
    measured = _run(advice, candidates, args.rounds)
    default = candidates.index(advice.default)
    base_pred, (base_med, base_low, _) = advice.default.step_s, measured[default]
    rows = []
    for k, c in enumerate(candidates):
        med, low, peak = measured[k]
        rows.append(
            {
                "label": c.brief(),
                "memory_choice": c.memory is not None,
                "fits_predicted": c.fits,
                "predicted_ms": c.step_s * 1e3,
                "limit": c.limit,
                "measured_ms": low * 1e3,
                "measured_median_ms": med * 1e3,
                "predicted_ratio": c.step_s / base_pred,
                "measured_ratio": low / base_low,
                "measured_median_ratio": med / base_med,
                "peak_predicted": max(c.peak_bytes),
                "peak_measured": peak,
                "fits_measured": peak <= budget,
            }
        )
    pick = rows[0]
    fitting = [r for r in rows if r["fits_measured"]]
    return {
        "model": name,
        "budget_fraction": fraction,
        "budget": budget,
        "advise_s": seconds,
        "cached": advice.cached,
        "profiles": advice.profiles,
        "confidence": advice.confidence,
        "backend": advice.backend.as_dict(),
        "summary": str(advice),
        "rows": rows,
        "pick": pick,
        "default": rows[default],
        "offload_measured_ratio": _span(rows, "measured_ratio"),
        "offload_predicted_ratio": _span(rows, "predicted_ratio"),
        "a_fits": pick["fits_measured"],
        "b_ratio_error": pick["measured_ratio"] / pick["predicted_ratio"] - 1,
        "c_faster": max((pick["measured_ms"] / r["measured_ms"] - 1 for r in fitting), default=0.0),
    }


def _span(rows: list, key: str) -> list:
    """`[least, most]` of `key` over the rows that offload or recompute (empty when none does)."""
    values = [r[key] for r in rows if r["memory_choice"]]
    return [min(values), max(values)] if values else []


def show(result: dict) -> None:
    if not result["rows"]:
        print(
            f"\n{result['model']}, budget {result['budget_fraction']:.0%}: nothing fits; the least budget "
            f"is {result['least_budget'] / 2**20:.2f} MiB (advise {result['advise_s']:.1f} s)"
        )
        return
    print(
        f"\n{result['model']}, budget {result['budget_fraction']:.0%} of plain Std1F1B's peak "
        f"({result['budget'] / 2**20:.2f} MiB): advise {result['advise_s']:.1f} s "
        f"({result['cached']}/{result['profiles']} profiles from the cache); ranks at once "
        f"{result['backend']['parallelism']:.2f} ({result['backend']['parallelism_source']})"
    )
    columns = f"{'pred ms':>8} {'ratio':>6} {'meas ms':>8} {'ratio':>6} {'median':>6} {'peak MiB':>8}"
    print(f"{'candidate':44} {columns} fits limit")
    for r in result["rows"]:
        print(
            f"{r['label'][:44]:44} {r['predicted_ms']:>8.2f} {r['predicted_ratio']:>6.2f} "
            f"{r['measured_ms']:>8.2f} {r['measured_ratio']:>6.2f} {r['measured_median_ratio']:>6.2f} "
            f"{r['peak_measured'] / 2**20:>8.2f} "
            f"{'yes' if r['fits_measured'] else 'no':4} {r['limit']}"
        )
    print(
        f"(a) pick fits: {result['a_fits']}; "
        f"(b) measured/predicted ratio - 1: {result['b_ratio_error']:+.0%}; "
        f"(c) a measured fitting candidate faster than the pick by {result['c_faster']:+.0%}"
    )


def main(argv=None) -> None:
    args = parse_args(argv)
    results = []
    for name in args.models:
        build = MODELS[name]()
        with tempfile.TemporaryDirectory() as cache:  # cold for the model's first budget
            first = mp.advise(
                build,
                mesh=MESH,
                tx=TX,
                microbatches=tuple(args.microbatches),
                profile_cache=cache,
                confirm=0,
                **STEP_SETTINGS.get(name, {}),
            )
            plain_peak = max(first.default.peak_bytes)
            print(
                f"\n{name}: advise without a budget {first.seconds:.1f} s (cold cache); "
                f"plain Std1F1B peak {plain_peak / 2**20:.2f} MiB"
            )
            for fraction in args.budgets:
                result = case(name, build, fraction, plain_peak, args, cache)
                result["advise_cold_s"] = first.seconds
                show(result)
                results.append(result)
                OUT.parent.mkdir(parents=True, exist_ok=True)
                OUT.write_text(json.dumps({"cases": results}, indent=1))  # after each case
    print(f"\nwrote {OUT}")


if __name__ == "__main__":
    main()
