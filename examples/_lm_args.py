"""The main job's command line (`examples/train_lm.py`): its flags, and what they choose: the schedule,
each stage's recompute and offload settings, and the checkpoint manager with the step to resume from."""

from __future__ import annotations

import argparse

import spectrax_mpmd as mp
from spectrax_core import schedules


def parse_args(argv=None, description: str = "") -> argparse.Namespace:
    """The main job's flags from `argv` (the command line's by default), checked; `description` heads
    `--help`."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--stages", type=int, default=4, help="pipeline ranks (default 4)")
    p.add_argument("--virtual-stages", type=int, default=1, help="stages per rank for loop schedules")
    p.add_argument("--schedule", default="Std1F1B", help="a spectrax_core.schedules class name")
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=32, help="sequences per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--layers", type=int, default=0, help="blocks (default: one per stage, at least 4)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument(
        "--sample-tokens", type=int, default=60, help="greedy tokens generated at the end (0: none)"
    )
    p.add_argument("--spmd", action="store_true", help="run the same model as one SPMD program instead")
    p.add_argument(
        "--compile-reference",
        action="store_true",
        help="also build the same model's unsplit step (one program on one device) and print its first "
        "call next to the pipeline's",
    )
    p.add_argument("--out", default="runs/train_lm", help="directory for metrics, trace and plots")
    p.add_argument(
        "--details",
        action="store_true",
        help="also print the schedule's grid, the first call's phases, the host cost of a step per rank "
        "and cell kind, and each rank's peak memory (predicted and measured)",
    )
    p.add_argument("--checkpoint-dir", default=None, help="save checkpoints here (orbax-checkpoint)")
    p.add_argument("--save-every", type=int, default=0, help="save every N steps (default: only at the end)")
    p.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        default=None,
        help="continue from the latest checkpoint in --checkpoint-dir (or from the step given)",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="with --resume STEP: delete the directory's later steps (the run this one replaces); "
        "without it such steps are kept and the run stops",
    )
    p.add_argument("--stop-after", type=int, default=0, help="stop (and save) after this many steps")
    p.add_argument(
        "--offload",
        nargs="?",
        const="all",
        default=None,
        help="keep saved residuals and the I->W stash in host memory: all (no value), a share of their "
        "bytes (0.5), 'residuals' or 'stash'; comma-separated for one value per stage",
    )
    p.add_argument(
        "--remat",
        default="none",
        help="recompute in the backward: none, true or a jax.checkpoint_policies name (dots_saveable); "
        "comma-separated for one value per stage",
    )
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps must be at least 1, got {args.steps}")
    if args.sample_tokens < 0:
        p.error(f"--sample-tokens must be 0 (no sample) or more, got {args.sample_tokens}")
    return args


def memory_settings(args) -> dict:
    """`remat=` and `offload=` for the step from --remat and --offload (one value, or one per stage)."""

    def remat(word):
        return {"none": False, "false": False, "true": True}.get(word.lower(), word)

    def offload(word):
        if word in ("all", "true"):
            return True
        try:
            return float(word)
        except ValueError:
            return word  # 'residuals' or 'stash'; the step checks it

    def per_stage(text, one):
        values = [one(w) for w in text.split(",")]
        return values[0] if len(values) == 1 else values

    settings = {"remat": per_stage(args.remat, remat)}
    if args.offload is not None:
        settings["offload"] = per_stage(args.offload, offload)
    return settings


def make_schedule(args):
    """The schedule --schedule names, over --microbatches (and --virtual-stages where it takes them)."""
    cls = getattr(schedules, args.schedule, None)
    if cls is None:
        raise SystemExit(f"unknown --schedule {args.schedule!r}; one of {', '.join(schedules.__all__)}")
    if args.virtual_stages > 1 and args.schedule != "DualPipeV":
        return cls(microbatches=args.microbatches, virtual_stages=args.virtual_stages)
    return cls(microbatches=args.microbatches)


def checkpoints(args):
    """The run's `mp.CheckpointManager` (None without --checkpoint-dir) and the step to resume from
    (None: the latest), after checking that resuming deletes nothing the user did not ask to."""
    if args.overwrite and args.resume in (None, "latest"):
        raise SystemExit("--overwrite applies to --resume STEP: it deletes the steps after STEP.")
    if args.checkpoint_dir is None:
        if args.resume is not None:
            raise SystemExit("--resume needs --checkpoint-dir, the directory a run saved to.")
        return None, None
    at = None
    if args.resume not in (None, "latest"):
        if not args.resume.isdigit():
            raise SystemExit(f"--resume takes a step number (or nothing: the latest), got {args.resume!r}.")
        at = int(args.resume)
    manager = mp.CheckpointManager(args.checkpoint_dir, max_to_keep=3)
    later = [k for k in manager.all_steps() if at is not None and k > at]
    if later and not args.overwrite:
        raise SystemExit(
            f"--resume {at}: {manager.directory} also holds the later steps {later}, of the run this one "
            f"would replace; they are kept and nothing was trained. Pass --overwrite to delete them and "
            f"train on from step {at}, resume from the latest step (--resume), or give another "
            "--checkpoint-dir."
        )
    return manager, at
