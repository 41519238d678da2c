"""Build DeepSpeed's CPU communication op (``deepspeed_shm_comm``) once, before the tests.

DeepSpeed compiles it with the C++ compiler the first time any process initializes ``deepspeed.comm`` on a
CPU machine (about 40 s on 2 cores), so the first DeepSpeed test of a fresh machine would otherwise pay for it
inside its own timing. Built here, it is cached under ``TORCH_EXTENSIONS_DIR`` for every test after.
"""

from __future__ import annotations

import importlib


def main() -> None:
    built = importlib.import_module("deepspeed.comm.torch").build_shm_op()  # None where DeepSpeed does not use it
    print(f"deepspeed shm comm op: {'built' if built is not None else 'not used on this machine'}")


if __name__ == "__main__":
    main()
