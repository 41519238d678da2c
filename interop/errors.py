"""Exception types. Every error a user can hit names the file (or rank, or component) and what is wrong.

The CLI prints ``str(error)`` as one line and exits non-zero; it never shows a traceback for these.
"""

from __future__ import annotations

import os


class InteropError(Exception):
    """Base class for every error this toolkit raises on purpose."""


def one_line(exc: BaseException) -> str:
    """An exception's message on one line (a library's own message may span several)."""
    return " ".join(str(exc).split())


class CheckpointError(InteropError):
    """A problem with a checkpoint on disk; ``path`` names the file or directory at fault."""

    def __init__(self, path: str | os.PathLike | None, problem: str):
        self.path = None if path is None else os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}" if self.path else problem)


class UncommittedCheckpointError(CheckpointError):
    """The directory has no manifest: a save that never finished, or not a checkpoint at all."""


class CorruptCheckpointError(CheckpointError):
    """A file is truncated, has a bad header, or disagrees with the manifest."""


class MissingFileError(CheckpointError):
    """A file the manifest (or the format) requires is absent."""


class UnknownFormatError(CheckpointError):
    """No registered format recognises the directory."""


class UnsafePathError(CheckpointError):
    """A checkpoint names a path that lies outside it (``..``, an absolute path, a link leading out)."""


class CheckpointInUseError(InteropError):
    """Another process is writing the same checkpoint root or conversion target."""


class UnsafePickleError(CheckpointError):
    """A pickle holds objects beyond tensors and plain containers; loading it could run code."""


class OutputWriteError(CheckpointError):
    """Writing an output file failed (a full disk, a read-only directory); nothing was published."""

    @classmethod
    def of(cls, path: str, exc: OSError) -> "OutputWriteError":
        return cls(path, f"could not be written: {exc.strerror or exc}")


class UnsupportedStateError(InteropError):
    """A state dict holds a value the no-pickle codec cannot represent."""


class ComponentError(InteropError):
    """A state component is declared wrongly (missing group, bad pattern, missing stateful)."""


class TopologyError(InteropError):
    """The saved and current topology disagree in a way the component's policy refuses."""


class ReplicationError(InteropError):
    """State declared replicated differs between ranks."""


class SaveFailedError(InteropError):
    """A save failed on at least one rank; raised on every rank with the same message."""


class LoadFailedError(InteropError):
    """Loading failed on another rank; raised on the ranks that did not fail themselves."""


class DestinationExistsError(InteropError):
    """A conversion target exists and is not empty; pass --overwrite to replace it."""


class ConfigurationError(InteropError, ValueError):
    """A setting cannot be used (a trainer flag, a layout that does not divide, a model the trainer cannot run)."""


class ConversionError(InteropError):
    """The source cannot be expressed in the target format."""
