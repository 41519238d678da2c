"""Durable, atomic publication of checkpoint directories.

Order of a commit: files written and fsynced in a staging directory -> manifest written to a temporary
name, fsynced, renamed, directory fsynced -> staging renamed to its final name, parent fsynced -> ``latest``
replaced atomically -> old checkpoints pruned (never the one ``latest`` names). A crash at any point leaves
either the previous state or a committed, verifiable new checkpoint; a staging directory is never loaded.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import re
import shutil
from typing import Iterator

from .errors import DestinationExistsError, MissingFileError
from .manifest import MANIFEST, STAGING_SUFFIX, FileRecord, Manifest, read_manifest
from .tensors import DIGEST_ALGO

log = logging.getLogger(__name__)

LATEST = "latest"


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: str, data: bytes) -> FileRecord:
    """Write a new file and fsync it; returns its size and digest for the manifest."""
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return FileRecord(len(data), f"{DIGEST_ALGO}:" + hashlib.sha256(data).hexdigest())


def atomic_write_text(path: str, text: str) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_manifest(directory: str, manifest: Manifest) -> None:
    atomic_write_text(os.path.join(directory, MANIFEST), manifest.to_json())


def publish(staging: str, final: str) -> None:
    """Move a complete staging directory to ``final``, replacing a previous directory of that name."""
    trash = None
    if os.path.lexists(final):
        trash = f"{final}.replaced{os.getpid()}"
        os.replace(final, trash)
    os.replace(staging, final)
    fsync_path(os.path.dirname(os.path.abspath(final)))
    if trash:
        shutil.rmtree(trash, ignore_errors=True)


def write_latest(root: str, name: str) -> None:
    atomic_write_text(os.path.join(root, LATEST), name + "\n")


def read_latest(root: str) -> str | None:
    path = os.path.join(root, LATEST)
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        return f.read().strip() or None


def resolve_checkpoint_dir(path: str) -> str:
    """A checkpoint directory, or a root whose ``latest`` names one."""
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    name = read_latest(path)
    if name is not None:
        target = os.path.join(path, name)
        if not os.path.isdir(target):
            raise MissingFileError(os.path.join(path, LATEST), f"names {name!r}, which does not exist")
        return target
    return path


def committed_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, name) of every committed checkpoint under ``root``, oldest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        full = os.path.join(root, name)
        if name.endswith(STAGING_SUFFIX) or not os.path.isfile(os.path.join(full, MANIFEST)):
            continue
        try:
            step = read_manifest(full).step
        except Exception:  # an unreadable manifest is not a checkpoint retention may count on
            continue
        if step is None:
            m = re.search(r"(\d+)$", name)
            step = int(m.group(1)) if m else -1
        found.append((step, name))
    return sorted(found)


def prune(root: str, keep_last: int) -> list[str]:
    """Remove all but the newest ``keep_last`` committed checkpoints; never the one ``latest`` names."""
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1")
    protected = read_latest(root)
    ckpts = committed_checkpoints(root)
    removed = []
    for _, name in ckpts[: max(0, len(ckpts) - keep_last)]:
        if name == protected:
            continue
        shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        removed.append(name)
    if removed:
        log.info("retention (keep_last=%d) removed %s", keep_last, ", ".join(removed))
    return removed


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def check_destination(dst: str, overwrite: bool) -> None:
    if os.path.lexists(dst) and not _is_empty_dir(dst) and not overwrite:
        raise DestinationExistsError(f"{dst}: destination exists and is not empty (pass --overwrite to replace it)")


@contextlib.contextmanager
def staged_output(dst: str, overwrite: bool = False) -> Iterator[str]:
    """Build an output directory beside ``dst`` and move it into place only when complete.

    On any exception the staging directory is removed and ``dst`` is left exactly as it was.
    """
    dst = os.path.abspath(dst)
    check_destination(dst, overwrite)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    staging = os.path.join(parent, f".{os.path.basename(dst)}.{os.getpid()}{STAGING_SUFFIX}")
    shutil.rmtree(staging, ignore_errors=True)
    os.makedirs(staging)
    try:
        yield staging
        publish(staging, dst)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
