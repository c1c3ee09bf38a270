"""Every measured figure quoted in README.md and docs/ comes from one recorded measurement.

A quoted figure is marked in the Markdown, invisibly once rendered:

    <!-- fig train_lm round({tokens_per_s}, -2) ,.0f -->11,900<!-- /fig -->

`train_lm` names a record (`docs/measurements/train_lm.json`), the expression between the record and
the last word reads the record's figures (`{key}`, with `+ - * / // %`, numbers and `round`, `min`,
`max`, `abs`), and the last word is the Python format spec the text uses (`,.0f` gives `11,900`;
`.0%` a percentage). Subcommands:

    python benchmarks/figures.py record NAME [--no-run]   run a benchmark, condense its JSON into
                                                          docs/measurements/NAME.json
    python benchmarks/figures.py write                    rewrite every marked figure, and
                                                          docs/measurements.md, from the records
    python benchmarks/figures.py check                    list every marked figure that disagrees

A record keeps every number of the benchmark's JSON under a flat key (`rows.Std1F1B.median_ms`),
with the date, the machine (CPU, cores, load average, JAX version), the device when the JSON names
one (`"device"`: an accelerator's kind) and the command that produced it; a command may start with
`NAME=value` words, set in its environment as a shell would. `tests/test_figures.py` fails when a
marked figure and its record disagree.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import operator
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RECORDS = ROOT / "docs" / "measurements"
PAGE = ROOT / "docs" / "measurements.md"
MARKER = re.compile(r"<!-- fig (?P<record>[\w-]+) (?P<expr>.+?) (?P<spec>\S+) -->(?P<value>.*?)<!-- /fig -->")
ROW_NAMES = (
    *("name", "label", "contender", "side", "config", "size"),
    *("schedule", "choice", "remat", "donate", "layout", "section", "kind"),
)


@dataclass(frozen=True)
class Source:
    """How a record is produced: the command (run from the repository root) and the JSON it writes."""

    command: str
    result: str
    what: str
    fresh: str = ""  # a folder the command must find absent (removed first): a checkpoint directory


PY = "python"
SOURCES = {
    "train_lm": Source(
        f"{PY} examples/train_lm.py --out runs/figures/train_lm",
        "runs/figures/train_lm/metrics.json",
        "the main job, as the README runs it",
    ),
    "train_lm_checkpoint": Source(
        f"{PY} examples/train_lm.py --checkpoint-dir runs/figures/ckpt --save-every 50 "
        "--out runs/figures/train_lm_checkpoint",
        "runs/figures/train_lm_checkpoint/metrics.json",
        "the main job saving a checkpoint every 50 steps",
        fresh="runs/figures/ckpt",
    ),
    "train_lm_resume": Source(
        f"{PY} examples/train_lm.py --checkpoint-dir runs/figures/ckpt --resume 100 --overwrite --stages 2 "
        "--out runs/figures/train_lm_resume",
        "runs/figures/train_lm_resume/metrics.json",
        "the main job resumed from train_lm_checkpoint's step 100 on 2 ranks",
    ),
    "train_lm_details": Source(
        f"{PY} examples/train_lm.py --details --steps 30 --out runs/figures/train_lm_details",
        "runs/figures/train_lm_details/metrics.json",
        "the main job's --details tables (30 steps)",
    ),
    "tpu_train_lm": Source(
        f"{PY} examples/train_lm.py --out runs/figures/tpu_train_lm",
        "runs/figures/tpu_train_lm/metrics.json",
        "the README's first command on a machine with one TPU v5e chip (its ranks on fake CPU devices)",
    ),
    "tpu_train_lm_one_rank": Source(
        f"{PY} examples/train_lm.py --stages 1 --details --out runs/figures/tpu_train_lm_one_rank",
        "runs/figures/tpu_train_lm_one_rank/metrics.json",
        "the main job on one TPU v5e chip: one rank, every stage on it, with --details",
    ),
    "tpu_accelerator_tests": Source(
        f"{PY} -m pytest -q -o addopts= -m accelerator tests/mpmd/test_mpmd_accelerator.py "
        "--junitxml runs/figures/tpu_accelerator_tests.xml",
        "runs/figures/tpu_accelerator_tests.xml",
        "the tests marked accelerator, on one TPU v5e chip",
    ),
    "test_suite": Source(
        f"{PY} -m pytest -q --junitxml runs/figures/test_suite.xml",
        "runs/figures/test_suite.xml",
        "the whole test suite, as CI runs it",
    ),
    "test_suite_quick": Source(
        f'{PY} -m pytest -q -m "not slow" --junitxml runs/figures/test_suite_quick.xml',
        "runs/figures/test_suite_quick.xml",
        "the quick loop: the test suite without the tests marked slow",
    ),
    **{
        f"generate_step_{layers}": Source(
            f"{PY} benchmarks/generate.py --model step --rounds 3{extra}",
            f"benchmarks/results/generate_step_{layers}.json",
            f"pipelined generation of a plain-JAX decode step ({layers} blocks): utilisation, tokens/s",
        )
        for layers, extra in [(4, ""), (8, " --layers 8")]
    },
    **{
        name: Source(f"{PY} benchmarks/{name}.py {args}".strip(), f"benchmarks/results/{name}.json", what)
        for name, args, what in [
            ("run", "--rounds 3", "spx.run against the hand-written step; pipelined against unsplit decode"),
            ("optimizer", "--rounds 3 --calls 5", "optimizer updates on pipelined gradients"),
            ("generate", "--rounds 3", "pipelined generation: issue cost, utilisation, tokens/s"),
            ("loss_weights", "--rounds 3 --calls 5", "the cost of an exact padded token mean"),
            ("compile_cache", "--processes 3", "first calls with the persistent compilation cache"),
            ("offload", "--rounds 3 --calls 3", "offload and recompute: peaks and step times"),
            ("stack_decode", "--rounds 3", "per-token decode of a BlockStack against its blocks"),
            ("dispatch", "--rounds 3 --calls 300", "eager spx.jit against raw jax.jit"),
            ("host_cost", "--rounds 7", "issue cost per cell of a one-rank step against a raw jax.jit call"),
            (
                "fused_cells",
                "--rounds 7 --sizes 256/64 --limits 32",
                "one-rank steps, cells fused or not, against lax.scan",
            ),
            ("planner", "--runs 3", "the planner's predicted against measured peaks and busy time"),
            ("multihost", "--rounds 3 --calls 3", "the same step in 1, 2 and 4 processes"),
            ("input_check", "--rounds 5 --calls 5", "the per-call argument check of a 2-process job"),
            ("first_call", "--configs lm", "where the main job's first call goes"),
            (
                "mlp_first_call",
                "--rounds 9",
                "the first call of a 4-stage homogeneous MLP against the unsplit jitted step's, fresh processes",
            ),
            (
                "cpu_codegen",
                "--rounds 3 --steps 40",
                "XLA:CPU's fusion emitters against its loop emitters: the main job's and the MLP's first calls and steps",
            ),
            ("train_step", "--rounds 3", "the one-plan update step against two calls"),
            (
                "run_ahead",
                "--rounds 5 --sizes 256/64",
                "the run-ahead bound: a one-rank step and a 4-rank step under each bound, a program's latency",
            ),
            ("ranks", "--rounds 3", "ranks of different sizes: an even split against a heavier last rank"),
            ("planner_devices", "--rounds 5", "devices per stage chosen for an LM with a heavy last stage"),
            ("length_buckets", "--rounds 3", "a long-tailed batch: length buckets against padding to the longest"),
            (
                "advise_cases",
                "--models byte_lm two_tower mlp --budgets 0.4 0.7 --top 2 --rounds 7",
                "the advisor's picks on three new models: fit, predicted against measured ratio",
            ),
            (
                "mpmd_overhead",
                "--rounds 3 --sections schedules --sizes small,large",
                "MPMD steps against one-device references, per schedule",
            ),
        ]
    },
    "tpu_dispatch": Source(
        "JAX_PLATFORMS=tpu python benchmarks/dispatch.py --rounds 3 --calls 300 "
        "--json benchmarks/results/tpu_dispatch.json",
        "benchmarks/results/tpu_dispatch.json",
        "eager spx.jit against raw jax.jit, on one TPU v5e chip",
    ),
    "tpu_fused_cells": Source(
        f"{PY} benchmarks/fused_cells.py --rounds 3 --json benchmarks/results/tpu_fused_cells.json",
        "benchmarks/results/tpu_fused_cells.json",
        "one-rank steps, cells fused or not, against lax.scan, on one TPU v5e chip",
    ),
    "tpu_run_ahead": Source(
        f"{PY} benchmarks/run_ahead.py --rounds 5 --json benchmarks/results/tpu_run_ahead.json",
        "benchmarks/results/tpu_run_ahead.json",
        "a one-rank step of 57 cells under each run-ahead bound, and a small program's latency, on one "
        "TPU v5e chip",
    ),
    "startup": Source(
        f"{PY} benchmarks/startup.py --rounds 3 --steps 10 --base runs/base",
        "benchmarks/results/startup.json",
        "the main job's first call against its plan and compile, this version (tree) and the one before "
        "(base: a checkout of it at runs/base) alternating, and plain JAX on the same model (jax: "
        "jax.jit(init), then the unsplit step's first update)",
    ),
    "settings_cost": Source(
        f"{PY} benchmarks/settings_cost.py --rounds 9 --base runs/base",
        "benchmarks/results/settings_cost.json",
        "a 4-rank Std1F1B MLP step's first call and host cost per cell, this version (tree) and the one "
        "before the step's settings record (base: a checkout of 20f476a^ at runs/base) alternating",
    ),
    "owner_init_programs": Source(
        f"{PY} benchmarks/owner_init.py --sections init --json benchmarks/results/owner_init_programs.json",
        "benchmarks/results/owner_init_programs.json",
        "owner-rank initialisation: each device's live arrays and its programs' XLA temporaries",
    ),
    "init_draws": Source(
        f"{PY} benchmarks/init_draws.py --rounds 5 --json benchmarks/results/init_draws.json",
        "benchmarks/results/init_draws.json",
        "compile seconds of owner-rank init programs with their random draws hashed together or each "
        "alone, and of jax.jit(init)",
    ),
    "tpu_owner_init_programs": Source(
        f"{PY} benchmarks/owner_init.py --sections init --json benchmarks/results/tpu_owner_init_programs.json",
        "benchmarks/results/tpu_owner_init_programs.json",
        "owner-rank initialisation: each device's live arrays and its programs' XLA temporaries, on a "
        "TPU v5e machine's 13 cores (CPU devices)",
    ),
    "tpu_cpu_codegen": Source(
        f"{PY} benchmarks/cpu_codegen.py --rounds 3 --steps 40 --json benchmarks/results/tpu_cpu_codegen.json",
        "benchmarks/results/tpu_cpu_codegen.json",
        "XLA:CPU's fusion emitters against its loop emitters: the main job's and the MLP's first calls and "
        "steps, on a TPU v5e machine's 13 cores (CPU devices)",
    ),
    "tpu_startup": Source(
        f"{PY} benchmarks/startup.py --rounds 3 --steps 10 --base runs/base --json benchmarks/results/tpu_startup.json",
        "benchmarks/results/tpu_startup.json",
        "the main job's first call against its plan and compile, this version (tree) and the one before "
        "(base: a checkout of it at runs/base) alternating, and plain JAX on the same model (jax: "
        "jax.jit(init), then the unsplit step's first update), on a TPU v5e machine's 13 cores",
    ),
    **{
        name: Source(
            f"{env}{PY} benchmarks/owner_init.py --sections init,restore --json benchmarks/results/{name}.json",
            f"benchmarks/results/{name}.json",
            f"owner-rank initialisation and restores, {which}: seconds and each device's peak live bytes, "
            "on a TPU v5e machine's 13 cores (CPU devices)",
        )
        for name, env, which in [
            ("tpu_owner_init", "", "compiled programs"),
            (
                "tpu_owner_init_before",
                "PYTHONPATH=runs/base ",
                "the version before (a checkout at runs/base)",
            ),
        ]
    },
    "tpu_host_cost": Source(
        f"{PY} benchmarks/host_cost.py --rounds 7 --json benchmarks/results/tpu_host_cost.json",
        "benchmarks/results/tpu_host_cost.json",
        "issue cost per cell of a one-rank step against a raw jax.jit call, on one TPU v5e chip",
    ),
    "tpu_cpu_mpmd_overhead": Source(
        f"JAX_PLATFORMS=cpu {PY} benchmarks/mpmd_overhead.py --rounds 3 --sections schedules --sizes small "
        "--out benchmarks/results/tpu_cpu_mpmd_overhead.json",
        "benchmarks/results/tpu_cpu_mpmd_overhead.json",
        "the small model's MPMD steps against one-device references, on the TPU machine's 13 cores (CPU devices)",
    ),
}
ENV_WORD = re.compile(r"[A-Z_][A-Z0-9_]*=\S*")  # a command's leading NAME=value: its environment


def flatten(value, prefix: str = "") -> dict:
    """Every number (and bool) of a JSON value under a dotted key; a list of records is keyed by each
    record's name field where it has one (`rows.Std1F1B.median_ms`), else by position."""
    if isinstance(value, bool | int | float):
        return {prefix: value}
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = list(zip(_row_names(value), value))
    else:
        return {}
    out = {}
    for key, child in items:
        out.update(flatten(child, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _row_names(rows: list) -> list[str]:
    """One key per row: the fewest name fields (`schedule`; else `size` and `schedule`: `large.GPipe`)
    whose values tell every row apart, the same fields for every row; for rows of several kinds
    (sections with fields of their own) every name field each row has; else the rows' positions."""
    if rows and all(isinstance(r, dict) for r in rows):
        present = [f for f in ROW_NAMES if all(f in r for r in rows)]
        spans = [(i, i + k) for k in range(1, len(present) + 1) for i in range(len(present) - k + 1)]
        for fields in [*(present[i:j] for i, j in spans), ROW_NAMES]:
            names = [".".join(str(r[f]) for f in fields if f in r).replace(" ", "_") for r in rows]
            if all(names) and len(set(names)) == len(names):
                return names
    return [str(k) for k in range(len(rows))]


def junit(path: Path) -> dict:
    """A pytest JUnit XML report's counts and seconds (`tests`, `failures`, `errors`, `skipped`,
    `time`), summed over its test suites."""
    import xml.etree.ElementTree as ET

    suites = ET.parse(path).getroot().iter("testsuite")
    keys = ("tests", "failures", "errors", "skipped", "time")
    totals = dict.fromkeys(keys, 0.0)
    for suite in suites:
        for key in keys:
            totals[key] += float(suite.get(key, 0))
    return totals


def machine() -> str:
    """The CPU model, core count, load average and library versions, in one line."""
    model = platform.processor()
    model = model if model not in ("", "unknown") else platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        names = [ln.split(":", 1)[1].strip() for ln in cpuinfo.read_text().splitlines() if "model name" in ln]
        model = names[0] if names else model
    import jax

    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"{model}, {os.cpu_count()} cores (load average {load} when recorded), "
        f"Python {platform.python_version()}, jax {jax.__version__}"
    )


def record(name: str, run: bool = True) -> dict:
    """Run `name`'s command (unless `run` is false: its JSON was written already), then write the
    condensed record to docs/measurements/NAME.json and return it."""
    source = SOURCES[name]
    result = ROOT / source.result
    took, load = None, os.getloadavg()[0]  # the load before the run: other jobs, not this one
    if run:
        from _timing import once  # benchmarks/ is on the path when this script runs

        if source.fresh:
            shutil.rmtree(ROOT / source.fresh, ignore_errors=True)
        argv, env = command_environment(source.command)
        took, _ = once(lambda: subprocess.run(argv, cwd=ROOT, check=True, env=env), wait=None)
    stamp = datetime.datetime.fromtimestamp(result.stat().st_mtime, datetime.UTC)
    data = junit(result) if result.suffix == ".xml" else json.loads(result.read_text())
    figures = flatten(data)
    device = data.get("device") if isinstance(data, dict) else None  # a list of rows names none
    if took is not None:
        figures["load_average_1m"] = load
        figures["command_wall_s"] = took
    data = {
        "name": name,
        "what": source.what,
        "date": stamp.strftime("%Y-%m-%d %H:%M UTC"),
        "machine": machine(),
        **({"device": device} if isinstance(device, str) else {}),
        "command": source.command,
        "figures": dict(sorted(figures.items())),
    }
    RECORDS.mkdir(parents=True, exist_ok=True)
    (RECORDS / f"{name}.json").write_text(json.dumps(data, indent=1) + "\n")
    return data


def command_environment(command: str) -> tuple[list[str], dict]:
    """`command` as an argument list (`python` this interpreter) and the environment to run it in:
    this one, with the command's leading `NAME=value` words set."""
    words, env = shlex.split(command), dict(os.environ)
    while words and ENV_WORD.fullmatch(words[0]):
        name, value = words.pop(0).split("=", 1)
        env[name] = value
    return [sys.executable if word == PY else word for word in words], env


def load_records(folder: Path = RECORDS) -> dict:
    """Every record in `folder`, by name."""
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


_BINARY = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}
_CALLS = {"round": round, "min": min, "max": max, "abs": abs}


def evaluate(expr: str, figures: dict) -> float:
    """The value of a marker's expression: `{key}` reads `figures`; arithmetic and `_CALLS` only."""
    names = {}

    def name_for(match):
        key = match.group(1)
        if key not in figures:
            raise KeyError(f"no figure {key!r} in the record (marker expression {expr!r})")
        names[f"_k{len(names)}"] = figures[key]
        return f"_k{len(names) - 1}"

    return _eval(ast.parse(re.sub(r"\{([^}]+)\}", name_for, expr), mode="eval").body, names, expr)


def _eval(node, names: dict, expr: str):
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return node.value
    if isinstance(node, ast.Name) and node.id in names:
        return names[node.id]
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        return _BINARY[type(node.op)](_eval(node.left, names, expr), _eval(node.right, names, expr))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, names, expr)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _CALLS:
        return _CALLS[node.func.id](*(_eval(a, names, expr) for a in node.args))
    raise ValueError(f"marker expression {expr!r}: only {{key}}, numbers, + - * / // % and {sorted(_CALLS)}")


def render(match: re.Match, records: dict) -> str:
    """The text a marker should hold, from its record."""
    name = match["record"]
    if name not in records:
        raise KeyError(f"no record {name!r} in docs/measurements (run `figures.py record {name}`)")
    return format(evaluate(match["expr"], records[name]["figures"]), match["spec"])


def pages(root: Path = ROOT) -> list[Path]:
    """The Markdown files whose figures are marked: README.md and docs/*.md."""
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def problems(text: str, records: dict) -> list[str]:
    """One line per marker of `text` whose value differs from its record, or that cannot be read."""
    out = []
    for match in MARKER.finditer(text):
        try:
            want = render(match, records)
        except (KeyError, ValueError) as err:
            out.append(f"{match[0]!r}: {err}")
            continue
        if match["value"] != want:
            out.append(f"{match[0]!r}: the record gives {want!r}")
    return out


def rewrite(text: str, records: dict) -> str:
    """`text` with every marked figure replaced by its record's value (a marker its records cannot
    render is left as it is: `problems` names it)."""

    def one(match: re.Match) -> str:
        try:
            value = render(match, records)
        except (KeyError, ValueError):
            return match[0]
        return match[0].replace(f"-->{match['value']}<!--", f"-->{value}<!--")

    return MARKER.sub(one, text)


def uses(root: Path = ROOT) -> dict:
    """(record, expression, spec) → the pages that quote it."""
    out = {}
    for page in pages(root):
        for match in MARKER.finditer(page.read_text()):
            out.setdefault((match["record"], match["expr"], match["spec"]), set()).add(page.name)
    return out


def measurements_page(records: dict, quoted: dict) -> str:
    """docs/measurements.md: every record's date, machine and command, each figure the docs quote
    (with the pages quoting it), then every figure the record holds."""
    lines = [
        "# Measurements",
        "",
        "Every measured figure quoted in the README and these pages comes from one of the records",
        "below (`docs/measurements/*.json`), written by `python benchmarks/figures.py record NAME`,",
        "which runs the command shown and keeps every number of its JSON. `python benchmarks/figures.py",
        "write` rewrites the quoted figures and this page from the records; a test fails when a quoted",
        "figure and its record disagree. Figures measured on a shared machine vary with its load (the",
        "load average is in each record's machine line): compare a run of yours with the record's",
        "command on your machine, not with these numbers.",
        "",
        "This page is generated; do not edit it by hand.",
    ]
    for name, data in records.items():
        lines += ["", f"## {name}: {data['what']}", "", f"- date: {data['date']}"]
        lines += [f"- machine: {data['machine']}"]
        lines += [f"- device: {data['device']}"] if "device" in data else []
        lines += [f"- command: `{data['command']}`", ""]
        mine = sorted((expr, spec, pages) for (rec, expr, spec), pages in quoted.items() if rec == name)
        if mine:
            lines += ["| quoted figure | value | quoted in |", "|---|---|---|"]
            for expr, spec, where in mine:
                try:
                    value = format(evaluate(expr, data["figures"]), spec)
                except (KeyError, ValueError) as err:
                    value = f"missing: {err}"
                lines.append(f"| `{expr}` | {value} | {', '.join(sorted(where))} |")
            lines.append("")
        figures = data["figures"]
        lines += [f"<details><summary>all {len(figures)} figures of this record</summary>", ""]
        lines += ["| key | value |", "|---|---|"]
        lines += [f"| `{key}` | {value:.6g} |" for key, value in figures.items()]
        lines += ["", "</details>"]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="action", required=True)
    rec = sub.add_parser("record", help="run benchmarks and record their JSON")
    rec.add_argument("names", nargs="*", help=f"records (default: every one): {', '.join(SOURCES)}")
    rec.add_argument("--no-run", action="store_true", help="record the JSON the command wrote already")
    sub.add_parser("write", help="rewrite the marked figures and docs/measurements.md")
    sub.add_parser("check", help="list marked figures that disagree with their records")
    args = parser.parse_args(argv)
    if args.action == "record":
        if unknown := sorted(set(args.names) - set(SOURCES)):
            parser.error(f"no record named {unknown}; the records are {', '.join(SOURCES)}")
        for name in args.names or SOURCES:  # in order: train_lm_resume reads train_lm_checkpoint's
            record(name, run=not args.no_run)
        return 0
    records = load_records()
    if args.action == "write":
        for page in pages():
            if page != PAGE:
                page.write_text(rewrite(page.read_text(), records))
        PAGE.write_text(measurements_page(records, uses()))
    found = [f"{page.name}: {line}" for page in pages() for line in problems(page.read_text(), records)]
    print("\n".join(found) or "every marked figure agrees with its record")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
