"""Train a byte-level transformer LM as a true MPMD pipeline: one XLA program per stage.

The core `TransformerLM` is cut into `--stages` pipeline stages (embedding and
the first blocks on rank 0, the last blocks, final norm and head on the last
rank) and trained with a pipeline schedule on the public-domain text in
`examples/data/corpus.txt` (Alice in Wonderland and As You Like It, one token
per byte). On a machine with fewer accelerators than ranks (none, or one) the
ranks run on 8 fake CPU devices, and a note says which `--stages` fits the
machine's own devices (`examples/_machine.py`).

It prints a short summary (the run's configuration, the compile, a progress
bar, the loss and tokens/s, the schedule's bubble simulated from one measured
step, the decode check) and writes the loss curve (`metrics.json`, with
matplotlib `loss.png`) and the timeline of one real step run cell by cell
(Chrome trace JSON: open it in Perfetto; `timeline.png` draws it under the
pipeline simulated from those cell times). At the end it continues a prompt
greedily through the training step's own `generate` (pipelined: each rank
keeps its own blocks and KV caches) and through the unsplit model, which must
agree. `--details` also prints the schedule's grid, where the first call's
time went, the host cost of a step per rank and cell kind, and each rank's
peak memory, predicted and measured.

    python examples/train_lm.py                       # 4 stages, Std1F1B, 8 microbatches
    python examples/train_lm.py --schedule ZeroBubbleH1 --steps 300
    python examples/train_lm.py --details             # grid, compile phases, host and memory tables
    python examples/train_lm.py --stages 1            # one rank: every stage on one accelerator
    python examples/train_lm.py --spmd                # the same model, one SPMD program
    python examples/train_lm.py --offload             # saved residuals in host memory between F and B
    python examples/train_lm.py --remat none,dots_saveable,true,none --offload 0.5   # per stage
    python examples/train_lm.py --checkpoint-dir runs/ckpt --stop-after 60   # save, stop at step 60
    python examples/train_lm.py --checkpoint-dir runs/ckpt --resume --stages 2   # go on, 2 ranks
    python -m spectrax_mpmd.launch --nproc 2 --devices-per-proc 2 examples/train_lm.py \
        --checkpoint-dir runs/ckpt2                   # 2 processes, each running 2 of the 4 ranks

With `--checkpoint-dir`, each rank writes its own parameters and optimizer
state through orbax-checkpoint (the `checkpoint` extra); `--resume` reads the
latest step onto the ranks of this run's layout, which may differ. Resuming
from an earlier step (`--resume 60`) while the directory holds later steps
stops without touching them, unless `--overwrite` says to delete them.
Under the launcher every process trains its own ranks and returns the loss;
process 0 reports and writes the metrics, and every process takes part in the
pipelined sample (each issues its own ranks' cells); the cell-by-cell
timeline and the host and memory tables run only in a one-process job.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

_FLAG = "--xla_force_host_platform_device_count"
if _FLAG not in os.environ.get("XLA_FLAGS", ""):  # must precede importing JAX; affects the CPU backend only
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_FLAG}=8".strip()

import _plots  # noqa: E402  (examples/_plots.py: the PNGs)
from _lm_args import checkpoints, make_schedule, memory_settings, parse_args  # noqa: E402  (the flags)
from _lm_report import Measured, measure_step  # noqa: E402  (one step measured cell by cell)
from _machine import choose_devices  # noqa: E402  (examples/_machine.py: the ranks' devices)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import spectrax_mpmd as mp  # noqa: E402
from spectrax_core.losses import softmax_cross_entropy  # noqa: E402
from spectrax_core.models import TransformerLM, greedy_decode  # noqa: E402

CORPUS = Path(__file__).parent / "data" / "corpus.txt"
PROMPT = "Alice was beginning to "


def lm_init(args, n_stages: int):
    """The model's init, `key -> TransformerLM`: one block per stage, at least 4 (or `--layers`)."""

    def init(key):
        n_layers = args.layers or max(4, n_stages)
        return TransformerLM.init(key, vocab_size=256, d_model=args.d_model, n_layers=n_layers, n_heads=4,
                                  d_ff=4 * args.d_model)  # fmt: skip

    return init


def batches(data: np.ndarray, batch: int, seq: int, seed: int = 0):
    """Random windows of the byte stream: `(tokens, next-byte targets)`, each `(batch, seq)` int32."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, len(data) - seq - 1, batch)
        window = np.stack([data[s : s + seq + 1] for s in starts]).astype(np.int32)
        yield window[:, :-1], window[:, 1:]


def progress(total: int):
    """A tqdm bar when tqdm is installed (the `examples` extra), else a line every 10 steps."""
    try:
        from tqdm import tqdm

        return tqdm(total=total, unit="step")
    except ImportError:
        return None


def run_name(args, schedule) -> str:
    """The run in a few words, for the plots' titles."""
    if args.spmd:
        return f"SPMD, {args.stages}-way data parallel, {args.microbatches} microbatches"
    stages = f" x {schedule.virtual_stages} stages" if schedule.virtual_stages > 1 else ""
    return f"{type(schedule).__name__}, {args.stages} ranks{stages}, {args.microbatches} microbatches"


def unsplit_first_call(args, params, tx, device) -> float:
    """Seconds of the first update of the same model as one program on `device` (trace, compile
    and one step; `params` are consumed), the reference for the pipeline's first call."""
    mesh = mp.create_mesh((1, 1, 1, 1, 1, 1), devices=[device])
    step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, microbatches=args.microbatches, tx=tx)
    tokens, targets = next(batches(np.zeros(args.seq + 2, np.uint8), args.batch, args.seq))
    start = time.perf_counter()
    jax.block_until_ready(step.update(params, tx.init(params), tokens, targets))
    return time.perf_counter() - start


def as_text(tokens) -> str:
    """The first row of generated byte tokens as text."""
    return bytes(np.asarray(tokens[0]).astype(np.uint8)).decode(errors="replace")


def decode_check(args, step, params, one_process: bool) -> bool | None:
    """Continue the prompt greedily through the training step's own `generate` and through the
    unsplit model; whether both gave the same tokens (None: no pipelined sample, or none asked for
    with --sample-tokens 0). Every process takes part; process 0 prints."""
    if args.sample_tokens == 0:
        return None
    prompt = jnp.asarray([list(PROMPT.encode())], jnp.int32)
    gathered = mp.gather(params)  # every process takes part; process 0 samples
    # the training step's own generation: each rank decodes with the blocks the step left on it (no
    # gather, no copy; after a later optimizer step it reuses the compiled programs); in a
    # multi-process job every process issues its own ranks' cells and gets the tokens
    sample = step.generate(params, prompt, args.sample_tokens) if one_process or not args.spmd else None
    if jax.process_index() > 0:
        return None
    reference = greedy_decode(mp.unstage_blocks(gathered), prompt, args.sample_tokens)
    if sample is None or args.details:
        print(f"unsplit model:   {PROMPT}{as_text(reference)!r}")
    if sample is None:
        return None
    same = bool(np.array_equal(np.asarray(sample), np.asarray(reference)))
    print(
        f"{'SPMD' if args.spmd else 'pipelined'} decode: {PROMPT}{as_text(sample)!r}  "
        f"(identical to the unsplit model's: {same})"
    )
    return same


def main(argv=None) -> dict:
    args = parse_args(argv, __doc__.splitlines()[0])
    if "JAX_COORDINATOR_ADDRESS" in os.environ:  # started by `python -m spectrax_mpmd.launch`
        mp.initialize()
    one_process = jax.process_count() == 1  # else: this process runs its own ranks; process 0 reports
    manager, resume_at = checkpoints(args)  # before anything else: a resume that would delete stops here
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    data = np.frombuffer(CORPUS.read_bytes(), np.uint8)
    schedule = make_schedule(args)
    n_stages = args.stages * schedule.virtual_stages
    devices, note = choose_devices(args.stages, jax.devices(), lambda: jax.devices("cpu"))
    if note:
        print(note)
        jax.config.update("jax_default_device", devices[0])  # the prompt, the unsplit model: there too
    # the update runs inside the step's plan, each leaf's on its rank; the global norm crosses as a scalar
    warmup = max(1, args.steps // 10)  # the cosine decay needs a step after the warmup
    lr = optax.warmup_cosine_decay_schedule(0.0, args.lr, warmup, max(args.steps, warmup + 1))
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr))
    init_lm = lm_init(args, n_stages)

    def init_staged(key):  # the pipeline's layout: each rank's blocks, made on that rank (init_on_owners)
        return mp.stage_blocks(init_lm(key), n_stages)

    lm = init_lm(jax.random.key(0)) if args.spmd or args.compile_reference else None  # whole, one device
    unsplit_params = lm if args.compile_reference else None
    if args.spmd:
        mesh = mp.create_mesh((1, args.stages, 1, 1, 1, 1), devices=devices)  # data parallel
        params = lm
        step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, microbatches=args.microbatches, tx=tx)
        print(
            f"SPMD: {args.stages}-way data parallel, {args.microbatches} microbatches per step (one program)"
        )
    else:
        mesh = mp.create_mesh((args.stages, 1, 1, 1, 1, 1), mpmd_axis="pp", devices=devices)
        params = None  # made on the ranks once the batch's shapes are known (mp.init_on_owners)
        memory = memory_settings(args)
        step = mp.runner(mesh=mesh, loss_fn=softmax_cross_entropy, schedule=schedule, tx=tx, **memory)
        per_rank = f" x {schedule.virtual_stages} stages" if schedule.virtual_stages > 1 else ""
        blocks = jax.eval_shape(init_staged, jax.random.key(0)).blocks.sizes
        print(
            f"MPMD pipeline: {args.stages} ranks{per_rank}, {type(schedule).__name__}, {args.microbatches} "
            f"microbatches; blocks per stage {', '.join(map(str, blocks))}; remat {args.remat}; "
            f"offload {args.offload or 'none'}"
        )
    sizes = sum(x.size for x in jax.tree.leaves(jax.eval_shape(init_lm, jax.random.key(0))))
    print(
        f"model: {sizes / 1e6:.2f} M parameters, byte vocabulary; batches of {args.batch} x {args.seq} "
        f"bytes from {len(data):,} bytes of text"
    )

    stream = batches(data, args.batch, args.seq)
    tokens, targets = next(stream)
    ckpt = {"dir": args.checkpoint_dir, "saved": [], "save_s": [], "restore_s": None}

    programs = "one XLA program" if args.spmd else "one XLA program per stage and cell kind"
    print(f"compiling ({programs}) ...", flush=True)
    start = time.perf_counter()
    first, state = 0, None
    if args.resume is not None:
        if params is None:  # each array read onto the rank that keeps it (builds the step: compiles)
            like, opt_like = mp.owner_layout(step, init_staged, jax.random.key(0), tokens, targets)
        else:
            like, opt_like = params, tx.init(params)
        t0 = time.perf_counter()
        restored = manager.restore(resume_at, like=like, opt_like=opt_like)
        ckpt["restore_s"] = time.perf_counter() - t0
        params, state, first = restored.params, restored.opt_state, restored.step
        if first >= (min(args.steps, args.stop_after) if args.stop_after else args.steps):
            raise SystemExit(
                f"the checkpoint is at step {first}: nothing left to train (--steps {args.steps})."
            )
        print(
            f"resumed at step {first} from {manager.directory} in {ckpt['restore_s']:.2f} s "
            f"(saved by {restored.extra['layout']}), each leaf read onto the rank that uses it"
        )
        later = [k for k in manager.all_steps() if k > first]  # only with --overwrite (see checkpoints)
        for k in later:  # this run continues from `first`: later steps belonged to the one it replaces
            manager.delete(k)
        if later:
            print(f"deleted the later checkpoints {later} (--overwrite): this run replaces them")
        for _ in range(first):  # the data stream where the saved run stopped
            tokens, targets = next(stream)
    if params is None:  # parameters and optimizer state made on their ranks, never whole on one device
        params, state = mp.init_on_owners(step, init_staged, jax.random.key(0), tokens, targets)
    state = tx.init(params) if state is None else state
    loss, params, state = step.update(params, state, tokens, targets)  # params, state: consumed and returned
    jax.block_until_ready(loss)
    first_call = None if args.spmd else step.runner.update_step.timings()
    compiled = 1 if args.spmd else first_call["compiled"] + first_call["relocated"]
    first_s = time.perf_counter() - start
    print(f"compiled {compiled} program{'s' * (compiled != 1)} in {first_s:.1f} s", end="")
    if first_call is not None:
        loaded = first_call["relocated"]
        print(f" ({first_call['compiled']} compiled, {loaded} loaded onto other ranks)", end="")
    print()
    if first_call is not None and args.details:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in first_call["seconds"].items())
        print(f"  first call's seconds: {phases}")
    unsplit_s = None
    if unsplit_params is not None and not args.spmd:
        unsplit_s = unsplit_first_call(args, unsplit_params, tx, devices[0])
        print(
            f"the same model's unsplit step (one program, one device): first call {unsplit_s:.1f} s; "
            f"the pipeline's is {first_s / unsplit_s:.2f}x that"
        )
    layout = "SPMD" if args.spmd else f"{args.stages} ranks, {schedule!r}"

    last = min(args.steps, args.stop_after) if args.stop_after else args.steps
    bar = progress(last - first) if jax.process_index() == 0 else None
    losses, t_train = [], time.perf_counter()
    for k in range(first, last):
        t0 = time.perf_counter()
        if k > first:
            tokens, targets = next(stream)
            loss, params, state = step.update(params, state, tokens, targets)
        losses.append(float(loss))
        if manager is not None and ((args.save_every and (k + 1) % args.save_every == 0) or k + 1 == last):
            t_save = time.perf_counter()
            manager.save(k + 1, params=params, opt_state=state, extra={"layout": layout}, force=True)
            ckpt["save_s"].append(time.perf_counter() - t_save)
            ckpt["saved"].append(k + 1)
        dt = time.perf_counter() - t0
        rate = args.batch * args.seq / dt
        if bar is not None:
            bar.set_postfix(loss=f"{losses[-1]:.3f}", tok_s=f"{rate:,.0f}", step_ms=f"{dt * 1e3:.0f}")
            bar.update()
        elif jax.process_index() == 0 and (k % 10 == 0 or k == args.steps - 1):
            print(f"step {k:4d}  loss {losses[-1]:.3f}  {rate:,.0f} tokens/s  {dt * 1e3:.0f} ms/step")
    if bar is not None:
        bar.close()
    wall = time.perf_counter() - t_train
    tokens_per_s = (last - first) * args.batch * args.seq / wall
    print(
        f"trained steps {first}..{last - 1} in {wall:.1f} s ({tokens_per_s:,.0f} tokens/s); "
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} nats per byte"
    )
    if manager is not None:
        t0 = time.perf_counter()
        manager.close()  # waits for the background writes
        ckpt["commit_wait_s"] = time.perf_counter() - t0
        print(
            f"saved steps {ckpt['saved']} to {manager.directory} (blocking part "
            f"{max(ckpt['save_s']) * 1e3:.0f} ms at most, then written in the background)"
        )

    files = ["metrics.json"]
    measured = Measured()
    if not args.spmd and one_process:  # measurements run the plan step by step, in one process
        call = (params, state, tokens, targets)
        measured = measure_step(step, schedule, args.stages, tx, devices, call, out, args.details)
        files.append("timeline.json")

    same = decode_check(args, step, params, one_process)
    if jax.process_index() > 0:
        return {"losses": losses}
    run = run_name(args, schedule)
    batch = f"batch {args.batch} x {args.seq} bytes, steps {first}..{last - 1}"
    if _plots.plot_loss(out / "loss.png", f"{run}, {batch}", first, losses):
        files.append("loss.png")
    if measured.timeline is not None and _plots.plot_timeline(
        out / "timeline.png", run, measured.simulated, measured.updated, measured.timeline
    ):
        files.append("timeline.png")

    metrics = {
        "mode": "spmd" if args.spmd else "mpmd",
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "schedule": repr(schedule),
        "stages": n_stages,
        "steps": args.steps,
        "first_step": first,
        "losses": losses,
        "wall_s": wall,
        "tokens_per_s": tokens_per_s,
        "programs": compiled,
        "first_call_s": first_s,
        "first_call": first_call,
        "unsplit_first_call_s": unsplit_s,
        "host": None if measured.host is None else measured.host.as_dict(),
        "cell_by_cell_idle": None if measured.timeline is None else measured.timeline.bubble_fraction,
        "simulated_bubble": None if measured.timeline is None else measured.simulated.bubble_fraction,
        "simulated_step_s": None if measured.timeline is None else measured.updated.makespan * 1e-6,
        "decode_identical": same,
        "peak_bytes": measured.peaks,
        "checkpoint": ckpt if manager is not None else None,
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1))
    print(f"wrote {', '.join(files)} to {out}/")
    return metrics


if __name__ == "__main__":
    main()
