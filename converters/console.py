"""The ``interop`` console script. It imports nothing heavy itself, so an interrupt at any moment, while torch
and the converters are still being imported included, ends in one line instead of a traceback."""

from __future__ import annotations

import logging
import os
import sys


def run() -> None:
    """``converters.cli.main``, then exit without the interpreter's teardown. Unloading torch costs about 0.4 s
    per call, a tenth of a large conversion; every output is fsynced before ``main`` returns, and the streams
    are flushed here."""
    try:
        from .cli import main

        code = main()
    except KeyboardInterrupt:  # before main's own handler was reached: nothing was started
        print("interop: interrupted; nothing was written", file=sys.stderr)
        code = 130
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more to say
            pass
    os._exit(code)
