"""The conversion examples run as written (bash, the engines' own launchers, the `interop` console script) and
check themselves: a resumed run continues the source run's losses; an export equals DeepSpeed's own tool's."""

from __future__ import annotations

import os
import subprocess

import pytest

from .conftest import ROOT, worker_env

pytestmark = pytest.mark.dist


def run_example(name: str, out) -> str:
    env = worker_env()
    env.pop("OMP_NUM_THREADS")  # as a user's shell would have it
    env["OUT"] = str(out)
    result = subprocess.run(["bash", str(ROOT / "examples" / name)], env=env, capture_output=True, text=True, timeout=600,
                            stdin=subprocess.DEVNULL)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result.stdout


# under -m slow: `interop demo` (test_cli.py) makes the same ZeRO-2 -> FSDP2 resume and checks its losses; the
# resume matrix covers Megatron
@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2_to_fsdp2.sh", "megatron_to_zero3.sh"])
def test_resume_example_continues_the_source_run(tmp_path, name):
    out = run_example(name, tmp_path)
    assert "OK: largest relative difference" in out
    steps = [line.split()[0] for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert steps == ["5", "6", "7", "8"]  # the resumed half of the 8-step run, compared step by step


@pytest.mark.slow  # by default: the README's base-trainer block exports and re-imports through the CLI, the
# launcher example and zero_to_fp32 run in test_deepspeed.py, and Megatron round trips in test_megatron.py
def test_export_example_equals_zero_to_fp32_and_round_trips_megatron(tmp_path):
    out = run_example("export_to_hf.sh", tmp_path)
    diffs = [line for line in out.splitlines() if " vs " in line and "compared" in line]
    assert len(diffs) == 2 and all("0 different" in line for line in diffs), diffs
    assert "from_pretrained + generate: The " in out
    assert os.path.isfile(tmp_path / "hf" / "model.safetensors")
