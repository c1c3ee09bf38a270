"""The main job runs on a machine with one accelerator: with fewer devices than ranks its ranks go to
fake CPU devices, and a note says so and which `--stages` runs on the machine's own device. The
device lists are injected (a one-accelerator machine is emulated on the CPU): the choice alone, and
the whole script, pipelined and `--spmd`, with JAX's default devices replaced by one accelerator."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


def _machine_module():
    spec = importlib.util.spec_from_file_location("_machine", EXAMPLES / "_machine.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


choose_devices = _machine_module().choose_devices


@dataclass(frozen=True)
class Device:
    platform: str
    device_kind: str
    id: int = 0


TPU = [Device("tpu", "TPU v5 lite")]
CPUS = [Device("cpu", "cpu", k) for k in range(8)]


def test_enough_devices_are_used_as_they_are():
    assert choose_devices(1, TPU, lambda: CPUS) == (TPU, "")
    assert choose_devices(4, CPUS, lambda: CPUS) == (CPUS[:4], "")


def test_one_accelerator_and_four_ranks_run_on_cpu_devices_with_a_note():
    chosen, note = choose_devices(4, TPU, lambda: CPUS)
    assert chosen == CPUS[:4]
    assert "this machine has 1 TPU v5 lite" in note and "4 of its 8 fake CPU devices" in note
    assert "To train on the TPU, pass --stages 1" in note and "--virtual-stages 2" in note


@pytest.mark.parametrize(
    "devices, cpus, found",
    [
        (TPU, lambda: CPUS[:2], "1 TPU v5 lite and 2 CPU device(s)"),
        (TPU, lambda: (_ for _ in ()).throw(RuntimeError("Unknown backend cpu")), "1 TPU v5 lite and 0 CPU"),
        (CPUS[:1], lambda: CPUS[:1], "1 CPU device(s)"),
    ],
)
def test_too_few_devices_anywhere_say_what_to_pass(devices, cpus, found):
    with pytest.raises(SystemExit) as stop:
        choose_devices(4, devices, cpus)
    message = str(stop.value)
    assert "--stages 4 needs 4 devices" in message and found in message
    assert "Pass --stages 1 or fewer" in message and "--xla_force_host_platform_device_count=8" in message


ONE_ACCELERATOR = """
import runpy, sys
import jax

class Accelerator:  # what jax.devices() lists on a machine with one accelerator
    platform, device_kind, id, process_index = "tpu", "TPU v5 lite", 0, 0

cpu_backend = jax.devices
jax.devices = lambda backend=None: [Accelerator()] if backend is None else cpu_backend(backend)
sys.path.insert(0, sys.argv[1])
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.parametrize("mode", [[], ["--spmd"]], ids=["pipeline", "spmd"])
def test_the_main_job_runs_on_a_machine_with_one_accelerator(mode, tmp_path):
    flags = "--steps 3 --batch 8 --seq 16 --d-model 32 --microbatches 4 --sample-tokens 4"
    script = [str(EXAMPLES), str(EXAMPLES / "train_lm.py"), *flags.split(), *mode, "--out", str(tmp_path)]
    result = subprocess.run(
        [sys.executable, "-c", ONE_ACCELERATOR, *script], capture_output=True, text=True, timeout=600, cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "this machine has 1 TPU v5 lite" in result.stdout and "pass --stages 1" in result.stdout
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["device"] == "4 x cpu" and metrics["decode_identical"] is True
    assert len(metrics["losses"]) == 3
