"""Paths a checkpoint names (in its manifest, an index, a tag file, DCP metadata) stay inside the checkpoint.

A checkpoint is input from wherever it came from: a name like ``../x`` or ``/etc/passwd``, or a symbolic link
leading out of the directory, must not make a reader read, or a converter write, anywhere else. Every such
path goes through ``inside`` before it is opened; ``tree_entries`` walks a checkpoint without following links.
"""

from __future__ import annotations

import os
import stat
from typing import Iterator

from .errors import UnsafePathError


def check_relative(rel: object, where: str | None) -> str:
    """``rel`` if it is a plain relative path (no ``..``, not absolute, no empty or ``.`` parts, no NUL)."""
    if not isinstance(rel, str) or not rel or "\0" in rel or "\\" in rel:
        raise UnsafePathError(where, f"names {rel!r}, which is not a relative path inside the checkpoint")
    parts = rel.split("/")
    if rel.startswith("/") or ".." in parts:
        raise UnsafePathError(where, f"names {rel!r}, which lies outside the checkpoint")
    if any(p in ("", ".") for p in parts):
        raise UnsafePathError(where, f"names {rel!r}, which is not a normalised path inside the checkpoint")
    return rel


def plain_name(name: object, what: str) -> str:
    """``name`` if it can be one path component (a tensor or state key used as a file or folder name by a
    writer): not empty, not ``.``/``..``, no ``/`` or NUL. A name from a checkpoint must not steer a write."""
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\0" in name or "\\" in name:
        raise UnsafePathError(None, f"{what} {name!r} cannot name a file: it would lead outside the output")
    return name


def containment_root(directory: str) -> str:
    """The directory a checkpoint's files may resolve into: the checkpoint itself, or for a snapshot in the
    Hugging Face hub cache (``models--org--name/snapshots/<rev>/``, whose files are links into the repository's
    ``blobs/``) the repository folder."""
    real = os.path.realpath(directory)
    parent = os.path.dirname(real)
    if os.path.basename(parent) == "snapshots" and os.path.basename(os.path.dirname(parent)).startswith(("models--", "datasets--")):
        return os.path.dirname(parent)
    return real


def is_within(path: str, root: str) -> bool:
    """Whether ``path``, with every link resolved, is ``root`` or lies under it (``root`` already resolved)."""
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def inside(directory: str, rel: object, where: str | None = None) -> str:
    """``directory/rel`` after checking that ``rel`` is a plain relative path and that the result, links
    resolved, stays inside the checkpoint. ``where`` names the file that named ``rel`` (for the error)."""
    rel = check_relative(rel, where or directory)
    path = os.path.join(directory, rel)
    root = containment_root(directory)
    if not is_within(path, root):
        raise UnsafePathError(where or path, f"names {rel!r}, which resolves to {os.path.realpath(path)}, outside the checkpoint {root}")
    return path


def tree_entries(directory: str) -> Iterator[tuple[str, os.stat_result]]:
    """(relative path, lstat) of everything under ``directory`` (files, directories, links, anything else),
    links not followed: what a checkpoint holds on disk."""
    for dirpath, dirnames, filenames in os.walk(directory):
        for name in dirnames + filenames:
            full = os.path.join(dirpath, name)
            yield os.path.relpath(full, directory), os.lstat(full)


def describe_entry(directory: str, rel: str, st: os.stat_result) -> str | None:
    """Why the entry at ``rel`` cannot be part of a checkpoint (a link, a device, a pipe), or None for a
    regular file or a directory."""
    if stat.S_ISLNK(st.st_mode):
        target = os.path.realpath(os.path.join(directory, rel))
        where = "inside" if is_within(target, containment_root(directory)) else "outside"
        return f"is a symbolic link to {target}, {where} the checkpoint; a checkpoint holds its own regular files"
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        return "is not a regular file"
    return None


def refuse_escaping_links(directory: str) -> None:
    """Refuse a directory holding a symbolic link that leads outside it (or, for a Hugging Face cache snapshot,
    outside its repository), or a special file (a pipe, a device): whatever reads it by a fixed name would
    read another file, or wait forever."""
    if not os.path.isdir(directory):
        return
    root = containment_root(directory)
    for rel, st in tree_entries(directory):
        path = os.path.join(directory, rel)
        if stat.S_ISLNK(st.st_mode):
            if not is_within(path, root):
                raise UnsafePathError(path, f"is a symbolic link to {os.path.realpath(path)}, outside the checkpoint {root}")
            try:
                st = os.stat(path)
            except FileNotFoundError:
                raise UnsafePathError(path, "is a symbolic link to a file that does not exist") from None
        if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
            raise UnsafePathError(path, "is not a regular file (a pipe, socket or device); a checkpoint holds regular files")
