"""For tests of staged saves: every background commit starts only when the training thread awaits it (the next
save, or the end of training), so a staged copy is written after later steps changed the live tensors in place;
and what lay in the save's staging directory when ``save()`` returned is recorded, to show what was staged
rather than written.

    python tests/held_commit.py OUT_JSON MODULE [args... --output-dir DIR ...]   # MODULE as __main__, commits held
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading

import interop.checkpoint as manager_module
from interop.manifest import STAGING_SUFFIX

RETURNED_WITH: list[list[str]] = []  # per background save: the files in its staging directory when save() returned


def hold(root: str, out: str) -> None:
    """Hold every background commit under ``root`` until awaited; rank 0 rewrites ``out`` (JSON) at each save
    (trainers end with os._exit: nothing runs after them)."""
    real = manager_module.PendingCommit

    class HeldCommit(real):
        def __init__(self, work, name):
            self._gate = threading.Event()
            RETURNED_WITH.append(sorted(os.path.relpath(os.path.join(d, f), s)
                                        for s in _staging_dirs(root) for d, _, files in os.walk(s) for f in files))
            if int(os.environ.get("RANK", "0")) == 0:
                with open(out, "w") as f:
                    json.dump(RETURNED_WITH, f)
            super().__init__(lambda: (self._gate.wait(), work())[1], name)

        def wait(self):
            self._gate.set()
            return super().wait()

    manager_module.PendingCommit = HeldCommit


def _staging_dirs(root: str) -> list[str]:
    return [os.path.join(root, n) for n in os.listdir(root) if n.endswith(STAGING_SUFFIX)] if os.path.isdir(root) else []


if __name__ == "__main__":
    out, module, args = sys.argv[1], sys.argv[2], sys.argv[3:]
    root = args[args.index("--output-dir") + 1]
    hold(root, out)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
