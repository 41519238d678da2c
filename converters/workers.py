"""``interop convert`` on several processes: joining the group ``torchrun`` started, or starting one (``--workers``).

The processes read the source each and write a share of the output's bytes (``interop.spread``). Under
``torchrun`` (one machine or several, a shared filesystem assumed) the group comes from its environment
(RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT); ``--workers N`` starts N such processes on this machine itself,
so that a failure is the failing rank's one line, not a launcher's traceback.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from interop.dist import TorchCollective
from interop.errors import ConversionError
from interop.spread import Spread


GRACE_SECONDS = 20  # after one rank failed, how long the others may take to end on their own
joined = False  # this process joined its launcher's group: its failures are its lead's to report


def launched() -> bool:
    """This process is one of several a launcher started (torchrun's or ours)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1 and "RANK" in os.environ


def join() -> Spread:
    """The launcher's group (gloo: the conversion exchanges Python objects on the CPU). RANK and WORLD_SIZE left
    in a shell, without the rest of a launcher's environment, are one line saying so, not torch's traceback."""
    import torch.distributed as dist

    if not dist.is_initialized():
        missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if v not in os.environ]
        if missing:
            raise ConversionError(f"WORLD_SIZE={os.environ['WORLD_SIZE']} and RANK={os.environ['RANK']} are set, so this "
                                  f"process would be one of a group, but {' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} "
                                  "not: start it with torchrun (or --workers N), or unset WORLD_SIZE and RANK to convert "
                                  "in one process")
        dist.init_process_group("gloo")
    global joined
    joined = True
    return Spread(TorchCollective())


def leave() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _free_port() -> int:
    import socket  # (3 ms of every conversion's start-up, for --workers only)

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def without_workers(argv: list[str]) -> list[str]:
    """``argv`` less its ``--workers N`` (or ``--workers=N``)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--workers":
            skip = True
        elif not arg.startswith("--workers="):
            out.append(arg)
    return out


def run_workers(argv: list[str], n: int) -> int:
    """Run ``python -m converters.cli ARGV`` as ranks 0..n-1 of one group; the first failure stops the others.
    Returns rank 0's exit status, or the failing rank's."""
    env = dict(os.environ, WORLD_SIZE=str(n), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
               LOCAL_WORLD_SIZE=str(n), OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    procs = [subprocess.Popen([sys.executable, "-m", "converters.cli", *argv],
                              env=dict(env, RANK=str(r), LOCAL_RANK=str(r))) for r in range(n)]
    status, deadline = None, None
    try:
        while True:
            codes = [p.poll() for p in procs]
            failed = [c for c in codes if c not in (None, 0)]
            if status is None and failed:
                # the others learn of it in their next collective and end with rank 0's one line: let them
                status, deadline = failed[0], time.monotonic() + GRACE_SECONDS
            if all(c is not None for c in codes) or (deadline is not None and time.monotonic() > deadline):
                break
            time.sleep(0.05)
        if status is None:
            status = 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait()
    return status
