"""Who speaks on the console: interop's own progress and results; the engines' chatter only when asked for."""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from typing import Iterator

# Loggers of the libraries interop drives. Named here (not imported): this package imports no engine.
LIBRARY_LOGGERS = ("DeepSpeed", "accelerate", "transformers", "torch.distributed", "peft")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


def quiet_libraries(verbose: bool) -> None:
    """Without ``verbose``: the libraries' INFO and WARNING lines (DeepSpeed's accelerator detection,
    accelerate's line per saved file) and Python warnings (torch's and transformers' deprecations) are
    dropped; their errors still show. With it: everything, warnings through logging."""
    if verbose:
        logging.captureWarnings(True)
        return
    warnings.simplefilter("ignore")
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        logger.setLevel(logging.ERROR)  # for the library's child loggers (accelerate.checkpointing), which inherit it
        if _errors_only not in logger.filters:  # for a library that sets its own logger's level again (DeepSpeed)
            logger.addFilter(_errors_only)


@contextlib.contextmanager
def library_prints(verbose: bool, name: str) -> Iterator[None]:
    """What a library ``print``s inside the block (DeepSpeed announcing the CPU op it built) goes to logger
    ``name`` at DEBUG instead of stdout, unless ``verbose``."""
    if verbose:
        yield
        return
    buffer = io.StringIO()
    try:
        with contextlib.redirect_stdout(buffer):
            yield
    except BaseException:
        sys.stderr.write(buffer.getvalue())  # what the library said before it failed may explain the failure
        raise
    else:
        logger = logging.getLogger(name)
        for line in buffer.getvalue().splitlines():
            logger.debug("%s", line)
