"""Starting a reference trainer on N local processes with torchrun, as a user would, and reading its summary.

Used by ``interop demo`` and the resume matrix; a user runs the same command line (``run_command``) by hand.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from dataclasses import dataclass

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A trainer run failed; the message holds the command and each rank's first errors."""


@dataclass
class RunSummary:
    step: int
    losses: list[float]  # of the steps this run trained
    checkpoint: str | None  # its last committed checkpoint (None: a finished run resumed, nothing written)
    log: str = ""  # what the run printed, stdout then stderr


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_command(module: str, nproc: int, args: list[str], port: int | None = None) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
            f"--master_port={port or free_port()}", "-m", module, *args]


def launch_env() -> dict[str, str]:
    """One thread per process (the processes share the cores), and the source tree importable."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=path, PYTHONUNBUFFERED="1")


def run_processes(cmd: list[str], env: dict[str, str] | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a multi-process command (torchrun, deepspeed, accelerate launch) to the end; raise ``LaunchError``
    with each rank's first errors if it fails.

    About one 2-rank gloo CPU run in fifty loses a rank to SIGABRT inside torch's native code (no Python
    traceback; seen with DeepSpeed and Accelerate alike, at exit and mid-run; twice in a row once on a loaded
    2-core CI machine): such a run is started again, up to twice, with a warning. Any other failure, or a
    third abort, is an error."""
    attempts = 3
    for attempt in range(attempts):
        result = subprocess.run(cmd, env=env or launch_env(), capture_output=True, text=True, timeout=timeout,
                                stdin=subprocess.DEVNULL)
        aborted = "exitcode  : -6" in result.stderr and "(SIGABRT)" in result.stderr
        if result.returncode == 0 or not aborted or attempt == attempts - 1:
            break
        log.warning("a rank aborted (SIGABRT) in native code; starting again: %s", " ".join(cmd[-6:]))
    if result.returncode != 0:
        firsts = [line for line in result.stderr.splitlines() if "Error" in line or "error:" in line or "terminate" in line][:8]
        raise LaunchError(f"{' '.join(cmd)} failed ({result.returncode}):\n" + "\n".join(firsts) + "\n...\n"
                          + result.stdout[-2000:] + result.stderr[-5000:])
    return result


def launch(module: str, nproc: int, args: list[str], timeout: float = 900) -> RunSummary:
    """Run ``python -m torch.distributed.run ... -m module args`` and return the summary line it prints."""
    cmd = run_command(module, nproc, args)
    result = run_processes(cmd, launch_env(), timeout)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if not lines:
        raise LaunchError(f"{' '.join(cmd)} printed no summary line:\n{result.stdout[-2000:]}")
    summary = json.loads(lines[-1])
    return RunSummary(summary["step"], summary["losses"], summary["checkpoint"], result.stdout + result.stderr)
