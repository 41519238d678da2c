"""Checks of a committed checkpoint against its manifest: presence, sizes, digests, readable headers."""

from __future__ import annotations

import hashlib
import os
from typing import Iterable

from .errors import CheckpointError, CorruptCheckpointError, MissingFileError
from .manifest import FileRecord, Manifest, read_manifest
from .safetensors_io import FILE_DIGEST_ALGO, SafetensorsFile, safetensors_digest
from .tensors import DIGEST_ALGO

_CHUNK = 8 << 20


def file_digest(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return f"{DIGEST_ALGO}:{h.hexdigest()}"


def digest_as(path: str, recorded: str | None) -> str:
    """The file's digest by the algorithm the manifest recorded it with."""
    if recorded and recorded.startswith(FILE_DIGEST_ALGO + ":"):
        try:
            return safetensors_digest(path)
        except CorruptCheckpointError:
            return ""  # unreadable: it cannot match
    return file_digest(path)


def tree_records(root: str, subdir: str, share: tuple[int, int] = (0, 1)) -> dict[str, FileRecord]:
    """FileRecords (size, digest) of every file under ``root/subdir``, keyed relative to ``root``; each made
    durable. ``share=(rank, world)`` takes every world-th file, so ranks can digest a tree between them."""
    from .commit import fsync_path

    top = os.path.join(root, subdir)
    rels = sorted(
        os.path.relpath(os.path.join(dirpath, n), root) for dirpath, _, names in os.walk(top) for n in names
    )
    records = {}
    rank, world = share
    for rel in rels[rank::world]:
        path = os.path.join(root, rel)
        fsync_path(path)
        records[rel] = FileRecord(os.path.getsize(path), file_digest(path))
    for d in {os.path.dirname(os.path.join(root, rel)) for rel in rels}:
        fsync_path(d)
    return records


def check_file(directory: str, rel: str, record: FileRecord, digest: bool = False) -> None:
    """Raise naming the file when it is missing, of the wrong size, or (with ``digest``) altered."""
    path = os.path.join(directory, rel)
    if not os.path.isfile(path):
        raise MissingFileError(path, "listed in the manifest but missing")
    size = os.path.getsize(path)
    if size != record.bytes:
        raise CorruptCheckpointError(path, f"size {size} bytes, manifest says {record.bytes} (truncated or replaced)")
    if digest and digest_as(path, record.digest) != record.digest:
        raise CorruptCheckpointError(path, "content digest differs from the manifest (the file was altered or corrupted)")


def check_files(directory: str, manifest: Manifest, rels: Iterable[str], digest: bool = False) -> None:
    for rel in rels:
        record = manifest.files.get(rel)
        if record is None:
            raise CorruptCheckpointError(os.path.join(directory, rel), "not listed in the manifest")
        check_file(directory, rel, record, digest)


def verify_checkpoint(directory: str, digests: bool = True, progress=None) -> tuple[Manifest | None, list[str]]:
    """Every problem found, one line each; an empty list means the checkpoint is complete and intact."""
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return None, [str(exc)]
    problems: list[str] = []
    items = list(manifest.files.items())
    for rel, record in progress(items, desc="verify", unit="file") if progress else items:
        try:
            check_file(directory, rel, record, digests)
            if rel.endswith(".safetensors"):
                SafetensorsFile(os.path.join(directory, rel))
        except CheckpointError as exc:
            problems.append(str(exc))
    for name, tensor in manifest.tensors.items():
        if tensor.file not in manifest.files:
            problems.append(f"{os.path.join(directory, tensor.file)}: holds tensor {name!r} but is not listed in the manifest")
    for key, comp in manifest.components.items():
        if comp.native:
            if not any(rel.startswith(tuple(b + "/" for b in comp.pieces.values())) for rel in manifest.files):
                problems.append(f"{directory}: native component {key!r} has no files listed in the manifest")
            continue
        for base in comp.pieces.values():
            if base + ".json" not in manifest.files:
                problems.append(f"{os.path.join(directory, base)}.json: piece of component {key!r} not listed in the manifest")
    return manifest, problems
