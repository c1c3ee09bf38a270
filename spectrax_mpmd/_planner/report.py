"""How an `Advice` reads: a short summary, a table of one line per candidate, a dict for JSON."""

from __future__ import annotations

from .model_error import MODEL_ERROR


def summary(advice) -> str:
    """The pick, why, the runner-up and the default with its cost."""
    budget = "no budget" if advice.memory_budget is None else f"budget {advice.memory_budget / 2**20:.2f} MiB"
    if not advice.fitting:
        return f"nothing fits ({budget}): {advice.least_budget(lambda b: f'{b / 2**20:.3f} MiB')}"
    pick, lines = advice.best, []
    peak = max(pick.peak_bytes) / 2**20
    lines.append(f"pick: {pick.brief()}: {_cost(pick)}, peak {peak:.2f} MiB ({budget})")
    why = f"bubble {pick.bubble:.1%}, time set by the {pick.limit}"
    if pick.memory is not None:
        why += f"; fitting costs {pick.memory.describe()}"
    lines.append(f"why: {why}")
    runner = next((c for c in advice.fitting if c is not pick), None)
    if runner is not None:
        lines.append(f"runner-up: {runner.brief()}: {_cost(runner)} ({runner.step_s / pick.step_s:.2f}x)")
    default = advice.default
    if default is not None and default is not pick:
        fit = "fits" if default.fits else f"does not fit ({max(default.peak_bytes) / 2**20:.2f} MiB)"
        lines.append(f"default: {default.brief()}: {_cost(default)}, {fit}")
    return "\n".join([*lines, *_footer(advice)])


def _footer(advice) -> list[str]:
    """The lines that close both the summary and the table: how sure the advice is, what its
    absolute times are calibrated on, and what it took."""
    lines = [f"confidence: {advice.confidence}"] if advice.confidence else []
    if advice.calibration is not None:
        lines.append(f"calibrated: {advice.calibration.describe()}: within {MODEL_ERROR:.0%} at that load")
    elif advice.candidates:
        lines.append("uncalibrated: no plain Std1F1B step ran on these arguments; the times are the model's")
    if advice.seconds:
        cached = f", {advice.cached} from the disk cache" if advice.cached else ""
        lines.append(f"advised in {advice.seconds:.1f} s ({advice.profiles} profiled steps{cached})")
    return lines


def table(advice) -> str:
    """One line per candidate (at most 120 characters): predicted ms per step, the update's
    part, bubble, what sets the time, fit, the largest peak and its rank, the largest host
    peak, the measured ms when it was run, and what it offloads or recomputes."""
    budget = "none" if advice.memory_budget is None else f"{advice.memory_budget / 2**20:.2f} MiB"
    lines = [f"memory budget per device: {budget}"]
    if advice.optimizer:
        lines.append(f"optimizer: {advice.optimizer}"[:120])
    lines.append(
        f"{'schedule':22} {'m':>3} {'v':>2} {'pred ms':>8} {'upd ms':>6} {'bubble':>6} "
        f"{'time set by':>14} {'fits':>4} {'peak MiB':>8} {'rank':>4} {'host MiB':>8} "
        f"{'meas ms':>8}  memory"
    )
    measured = {id(c): t for c, t in advice.measured}
    for c in advice.candidates:
        host = 0.0 if c.memory is None else max(c.memory.host_peak_bytes) / 2**20
        meas = f"{measured[id(c)] * 1e3:.2f}" if id(c) in measured else "-"
        peak = max(c.peak_bytes)
        line = (
            f"{c.label[:22]:22} {c.microbatches:>3} {c.virtual_stages:>2} {c.step_s * 1e3:>8.2f} "
            f"{c.update_s * 1e3:>6.2f} {c.bubble:>6.1%} {c.limit:>14} {'yes' if c.fits else 'no':>4} "
            f"{peak / 2**20:>8.2f} {c.peak_bytes.index(peak):>4} {host:>8.2f} {meas:>8}  "
            f"{'-' if c.memory is None else c.memory.label()}"
        )
        lines.append(line if len(line) <= 120 else line[:119] + "~")
    if not advice.fitting:
        lines.append(f"no configuration fits: {advice.least_budget(lambda b: f'{b / 2**20:.3f} MiB')}")
    for s in advice.skipped:
        lines.append(f"skipped {s.name}, m={s.microbatches}, v={s.virtual_stages}: {s.reason}")
    return "\n".join([*lines, *_footer(advice)])


def as_dict(advice) -> dict:
    return {
        "memory_budget": advice.memory_budget,
        "optimizer": advice.optimizer,
        "seconds": advice.seconds,
        "profiles": advice.profiles,
        "cached": advice.cached,
        "candidates": [
            {
                **_configuration(c),
                "step_s": c.step_s,
                "update_s": c.update_s,
                "bubble": c.bubble,
                "peak_bytes": list(c.peak_bytes),
                "fits": c.fits,
                "memory": None if c.memory is None else c.memory.as_dict(),
                "label": c.label,
                "limit": c.limit,
            }
            for c in advice.candidates
        ],
        "binding_rank": advice.binding_rank,
        "measured": [{"label": c.brief(), "step_s": t} for c, t in advice.measured],
        "confidence": advice.confidence,
        "calibration": None if advice.calibration is None else advice.calibration.as_dict(),
        "backend": None if advice.backend is None else advice.backend.as_dict(),
        "skipped": [{**_configuration(s), "reason": s.reason} for s in advice.skipped],
    }


def _configuration(row) -> dict:
    """A candidate's or a skipped configuration's schedule, microbatches and virtual stages."""
    return {"schedule": row.name, "microbatches": row.microbatches, "virtual_stages": row.virtual_stages}


def _cost(c) -> str:
    return f"predicted {c.step_s * 1e3:.2f} ms/step"
