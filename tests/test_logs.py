"""The console belongs to interop's own lines: the engines' loggers, warnings and prints show with --verbose."""

from __future__ import annotations

import logging
import warnings

import pytest

from interop.logs import LIBRARY_LOGGERS, library_prints, quiet_libraries


@pytest.fixture
def restored():
    saved = {name: (logging.getLogger(name).level, list(logging.getLogger(name).filters)) for name in LIBRARY_LOGGERS}
    with warnings.catch_warnings():
        yield
    for name, (level, filters) in saved.items():
        logger = logging.getLogger(name)
        logger.setLevel(level)
        logger.filters[:] = filters


def test_quiet_libraries_silences_child_loggers_and_warnings(restored, caplog):
    quiet_libraries(False)
    child = logging.getLogger("accelerate.checkpointing")  # accelerate's line per saved file
    with caplog.at_level(logging.INFO):
        child.info("Model weights saved in x")
        logging.getLogger("DeepSpeed").warning("Setting accelerator to CPU")
        child.error("a real failure")
        logging.getLogger("interop.checkpoint").info("saved x")
    assert [r.getMessage() for r in caplog.records] == ["a real failure", "saved x"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.warn("deprecated", FutureWarning)  # the filter quiet_libraries installed drops it
    assert seen == []


def test_library_prints_go_to_debug_unless_verbose_or_failing(capsys, caplog):
    with caplog.at_level(logging.DEBUG, logger="tests.logs"), library_prints(False, "tests.logs"):
        print("DeepSpeed op built successfully")
    assert capsys.readouterr().out == ""
    assert [r.getMessage() for r in caplog.records] == ["DeepSpeed op built successfully"]
    with library_prints(True, "tests.logs"):
        print("shown")
    assert capsys.readouterr().out == "shown\n"
    with pytest.raises(RuntimeError), library_prints(False, "tests.logs"):
        print("what the library said first")
        raise RuntimeError("init failed")
    assert "what the library said first" in capsys.readouterr().err  # it may explain the failure
