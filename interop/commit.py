"""Durable, atomic publication of checkpoint directories.

Order of a commit: files written and fsynced in a staging directory -> manifest written to a temporary
name, fsynced, renamed, directory fsynced -> staging renamed to its final name, parent fsynced -> ``latest``
replaced atomically -> old checkpoints pruned (never the one ``latest`` names). A crash at any point leaves
either the previous state or a committed, verifiable new checkpoint; a staging directory is never loaded.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from typing import Iterable, Iterator

from . import digests
from .errors import DestinationExistsError, MissingFileError, OutputWriteError
from . import locking
from .locking import exclusive
from .manifest import MANIFEST, STAGING_SUFFIX, FileRecord, Manifest, read_manifest
from .paths import check_relative

log = logging.getLogger(__name__)

LATEST = "latest"
REMOVING_SUFFIX = ".removing"  # a pruned checkpoint, renamed out of the way while it is deleted


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_paths(paths: Iterable[str], threads: int = 16) -> None:
    """fsync many files or directories at once. Why threads: each fsync waits for a journal commit, and the
    filesystem (ext4, xfs) joins the fsyncs that wait together into one, so hundreds of small files (a
    ds-universal tree) become durable in a few commits instead of one each."""
    paths = list(paths)
    if len(paths) <= 2:
        for p in paths:
            fsync_path(p)
        return
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(threads, len(paths)), thread_name_prefix="fsync") as pool:
        list(pool.map(fsync_path, paths))


def durable_write(path: str, data: bytes) -> FileRecord:
    """Write a new file and fsync it; returns its size and digest for the manifest."""
    try:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        raise OutputWriteError.of(path, exc) from None
    return FileRecord(len(data), digests.of_bytes(data))


def fsync_tree(top: str) -> None:
    """fsync every directory under ``top`` (and ``top``): the entries of new files are durable too."""
    fsync_paths(dirpath for dirpath, _, _ in os.walk(top))


_TMP = re.compile(r"\.tmp(\d+)$")


def remove_stale_temporaries(path: str) -> None:
    """Remove ``<path>.tmp<pid>`` files whose writer is no longer running (a save killed mid-write)."""
    parent, name = os.path.split(os.path.abspath(path))
    for entry in os.listdir(parent) if os.path.isdir(parent) else []:
        m = _TMP.search(entry)
        if m and entry[: m.start()] == name and not _alive(int(m.group(1))):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(parent, entry))


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def atomic_write_text(path: str, text: str) -> None:
    remove_stale_temporaries(path)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(os.path.abspath(path)))


def write_manifest(directory: str, manifest: Manifest) -> None:
    """The manifest, as its own reader takes it or not at all: a manifest the reader would refuse (a value no run
    has that slipped past a writer's checks) would publish a checkpoint nothing can read, so it stops the save
    before it commits, and the previous checkpoint stays the last one."""
    import json

    from .errors import CheckpointError

    path = os.path.join(directory, MANIFEST)
    text = manifest.to_json()
    try:
        Manifest.from_dict(json.loads(text), path)
    except CheckpointError as exc:
        raise OutputWriteError(_published_as(directory), f"not written: its manifest would be refused by its own reader: "
                               f"{exc.problem.removeprefix('malformed manifest: ')}") from None
    atomic_write_text(path, text)


def _published_as(directory: str) -> str:
    """The directory a staging directory becomes when published (a conversion's ``.<name>.<pid>.staging`` beside
    it, a trainer's ``<name>.staging``): what a user asked for, where an error names it."""
    parent, name = os.path.split(os.path.abspath(directory))
    found = re.fullmatch(r"\.(.+)\.\d+" + re.escape(STAGING_SUFFIX), name)
    return os.path.join(parent, found[1] if found else name.removesuffix(STAGING_SUFFIX))


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


def read_tag(path: str, what: str = "tag file") -> str | None:
    """The one name a tag file (``latest``, DeepSpeed's ``latest``, ``latest_universal``) holds, checked to be a
    plain relative name inside its directory; None when there is no such file."""
    from .errors import CorruptCheckpointError
    from .paths import containment_root, is_within

    if not os.path.isfile(path):
        return None
    if os.path.islink(path) and not is_within(path, containment_root(os.path.dirname(os.path.abspath(path)))):
        from .errors import UnsafePathError

        raise UnsafePathError(path, "is a symbolic link leading outside its directory; a tag file is read only from inside")
    if os.path.getsize(path) > 4096:
        raise CorruptCheckpointError(path, f"is {os.path.getsize(path)} bytes; a {what} holds one name")
    with open(path, "rb") as f:
        raw = f.read()
    try:
        name = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise CorruptCheckpointError(path, f"is not a {what}: not UTF-8 text") from None
    return check_relative(name, path) if name else None


def read_latest(root: str) -> str | None:
    return read_tag(os.path.join(root, LATEST), "'latest' file")


# The tag files an engine reads in the directory it is pointed at, naming the checkpoint inside: ours and
# DeepSpeed's ``latest``, DeepSpeed's ``latest_universal`` (load_universal), Megatron-LM's tracker (an
# iteration number, for ``iter_%07d``, or ``release``). Our checkpoints written for an engine sit where its tag
# file leads, so the engine and our tools pointed at the same directory find the same checkpoint.
LATEST_UNIVERSAL = "latest_universal"
MEGATRON_TRACKER = "latest_checkpointed_iteration.txt"
ROOT_TAGS = (LATEST, LATEST_UNIVERSAL, MEGATRON_TRACKER)


def read_iteration_tracker(root: str) -> str | None:
    """The folder Megatron-LM's tracker in ``root`` names (``iter_%07d`` or ``release``); None without one."""
    from .errors import CorruptCheckpointError

    path = os.path.join(root, MEGATRON_TRACKER)
    name = read_tag(path, f"{MEGATRON_TRACKER!r} file")
    if name is None or name == "release":
        return name
    if not re.fullmatch(r"[0-9]{1,12}", name):
        raise CorruptCheckpointError(path, f"holds {name[:40]!r}, not an iteration number or 'release'")
    return f"iter_{int(name):07d}"


def read_root_tag(root: str) -> tuple[str, str] | None:
    """(tag file, the directory name it leads to) for the first tag file in ``root``; None without one."""
    for tag_file in (LATEST, LATEST_UNIVERSAL):
        name = read_tag(os.path.join(root, tag_file), f"{tag_file!r} file")
        if name is not None:
            return tag_file, name
    name = read_iteration_tracker(root)
    return (MEGATRON_TRACKER, name) if name is not None else None


def resolve_checkpoint_dir(path: str) -> str:
    """A checkpoint directory, or a root whose tag file (``latest``, ...) names one inside it."""
    from .paths import inside

    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    found = read_root_tag(path)
    if found is not None:
        tag_file, name = found
        target = inside(path, name, os.path.join(path, tag_file))
        if not os.path.isdir(target):
            raise MissingFileError(os.path.join(path, tag_file), f"names {name!r}, which does not exist")
        return target
    return path


def committed_checkpoints(root: str) -> list[tuple[int, str]]:
    """(step, name) of every committed checkpoint under ``root``, oldest first."""
    found = []
    for name in os.listdir(root) if os.path.isdir(root) else []:
        full = os.path.join(root, name)
        if name.endswith((STAGING_SUFFIX, REMOVING_SUFFIX)) or not os.path.isfile(os.path.join(full, MANIFEST)):
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
    """Remove all but the newest ``keep_last`` committed checkpoints; never the one ``latest`` names. Each is renamed
    out of the way first (``.<name>.removing``), so a process killed while deleting leaves no half-deleted checkpoint
    under its own name; such leftovers go at the next prune."""
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1")
    for entry in os.listdir(root) if os.path.isdir(root) else []:
        if entry.startswith(".") and entry.endswith(REMOVING_SUFFIX):
            shutil.rmtree(os.path.join(root, entry), ignore_errors=True)
    protected = read_latest(root)
    ckpts = committed_checkpoints(root)
    removed = []
    for _, name in ckpts[: max(0, len(ckpts) - keep_last)]:
        if name == protected:
            continue
        trash = os.path.join(root, f".{name}{REMOVING_SUFFIX}")
        try:
            os.replace(os.path.join(root, name), trash)
        except OSError:
            continue
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(name)
    if removed:
        log.info("retention (keep_last=%d) removed %s", keep_last, ", ".join(removed))
    return removed


def _is_empty_dir(path: str) -> bool:
    return os.path.isdir(path) and not os.listdir(path)


def check_destination(dst: str, overwrite: bool, src: str | None = None) -> None:
    """Refuse a non-empty ``dst`` without ``overwrite``, and (given the source) a ``dst`` that is the source,
    holds it or lies inside it: replacing it would delete the source before it was read."""
    if src is not None:
        from .paths import containment_root, is_within

        # the source's whole extent: for a Hugging Face cache snapshot its repository, whose blobs/ it links to
        real_src, real_dst = containment_root(src), os.path.realpath(dst)
        if is_within(real_dst, real_src) or is_within(real_src, real_dst):
            raise DestinationExistsError(
                f"{dst}: is the source {src}, contains it or lies inside it; write the output outside the source"
            )
    if os.path.lexists(dst) and not _is_empty_dir(dst) and not overwrite:
        raise DestinationExistsError(f"{dst}: destination exists and is not empty (pass --overwrite to replace it)")
    locking.refuse_if_in_use(dst, dst)  # a running trainer's output directory, or another conversion's target


def destination_lock(dst: str) -> str:
    """The lock file that makes one process at a time write ``dst`` (beside it, removed when released)."""
    return locking._beside(os.path.abspath(dst))


_STAGING = re.compile(r"\.(\d+)" + re.escape(STAGING_SUFFIX) + "$")


def _remove_stale_staging(parent: str, name: str) -> None:
    """Staging directories of conversions into ``name`` whose process died (under the destination's lock)."""
    for entry in os.listdir(parent):
        m = _STAGING.search(entry)
        if m and entry[: m.start()] == f".{name}" and not _alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


@contextlib.contextmanager
def staged_output(dst: str, overwrite: bool = False) -> Iterator[str]:
    """Build an output directory beside ``dst`` and move it into place only when complete, holding the
    destination's lock throughout (a second writer of ``dst`` is refused).

    On any exception the staging directory is removed and ``dst`` is left exactly as it was.
    """
    dst = os.path.abspath(dst)
    parent = os.path.dirname(dst)
    os.makedirs(parent, exist_ok=True)
    with exclusive(destination_lock(dst), dst):
        check_destination(dst, overwrite)
        _remove_stale_staging(parent, os.path.basename(dst))
        staging = os.path.join(parent, f".{os.path.basename(dst)}.{os.getpid()}{STAGING_SUFFIX}")
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        try:
            yield staging
            fsync_tree(staging)
            publish(staging, dst)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
