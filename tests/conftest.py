"""Shared helpers: launching real torchrun process groups, tiny Hugging Face models."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKER = str(ROOT / "tests" / "dist_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict[str, str]:
    env = dict(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    return env


def torchrun_cmd(nproc: int, *args: str, nnodes: int = 1, node_rank: int = 0, port: int | None = None) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}"]
    if nnodes == 1 and port is None:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={nnodes}", f"--node_rank={node_rank}", "--master_addr=127.0.0.1", f"--master_port={port}"]
    return cmd + [WORKER, *args]


def torchrun(nproc: int, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    return subprocess.run(torchrun_cmd(nproc, *args), env=worker_env(), capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def tiny_llama():
    from trainers.base import tiny_config

    def make(tied: bool = False):
        import torch
        import transformers

        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(tiny_config("llama", tied))

    return make
