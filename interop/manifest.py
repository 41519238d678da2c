"""The manifest: written last, its presence marks a checkpoint committed, and it lists every file.

Two formats share it: ``interop-checkpoint`` (a trainer's save; model and optimizer in the engine's own
layout) and ``interop-universal`` (the portable checkpoint). Field names are stable within a format_version.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

from .errors import CorruptCheckpointError, UncommittedCheckpointError

MANIFEST = "manifest.json"
STAGING_SUFFIX = ".staging"  # a directory being written; never loaded, even once its manifest exists
FORMAT_VERSION = 1
CHECKPOINT_FORMAT = "interop-checkpoint"
UNIVERSAL_FORMAT = "interop-universal"
KNOWN_FORMATS = (CHECKPOINT_FORMAT, UNIVERSAL_FORMAT)


@dataclass
class FileRecord:
    bytes: int
    digest: str
    writer: int | None = None


@dataclass
class TensorRecord:
    shape: list[int]
    dtype: str
    file: str
    digest: str


@dataclass
class ComponentRecord:
    pattern: str
    policy: str
    required: bool = True
    group: str | None = None
    pieces: dict[str, str] = field(default_factory=dict)  # owner -> base path (files: base.json, base.safetensors)
    native: bool = False  # written by the engine itself: every file under pieces["native"] + "/" belongs to it


@dataclass
class Manifest:
    format: str
    topology: dict[str, Any]
    format_version: int = FORMAT_VERSION
    committed_at: str = ""
    producer: dict[str, str] = field(default_factory=dict)
    step: int | None = None
    source: dict[str, Any] = field(default_factory=dict)
    sharding: dict[str, Any] | None = None
    model: dict[str, Any] | None = None
    optimizer: dict[str, Any] | None = None
    memory: dict[str, Any] | None = None  # the trainer's cross-rank memory statistics at save time
    tensors: dict[str, TensorRecord] = field(default_factory=dict)
    components: dict[str, ComponentRecord] = field(default_factory=dict)
    files: dict[str, FileRecord] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=1, sort_keys=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = MANIFEST) -> "Manifest":
        try:
            if data.get("format") not in KNOWN_FORMATS:
                raise CorruptCheckpointError(path, f"unknown manifest format {data.get('format')!r}")
            if int(data.get("format_version", 0)) > FORMAT_VERSION:
                raise CorruptCheckpointError(
                    path, f"format_version {data['format_version']} is newer than this interop ({FORMAT_VERSION}); upgrade interop"
                )
            data = dict(data)
            data["tensors"] = {k: TensorRecord(**v) for k, v in data.get("tensors", {}).items()}
            data["components"] = {k: ComponentRecord(**v) for k, v in data.get("components", {}).items()}
            data["files"] = {k: FileRecord(**v) for k, v in data.get("files", {}).items()}
            known = set(cls.__dataclass_fields__)
            return cls(**{k: v for k, v in data.items() if k in known})
        except (TypeError, KeyError, ValueError) as exc:
            raise CorruptCheckpointError(path, f"malformed manifest: {exc}") from None


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def producer_versions(**extra: str) -> dict[str, str]:
    import torch

    from . import __version__

    versions = {"interop": __version__, "torch": torch.__version__.split("+")[0]}
    versions.update({k: v for k, v in extra.items() if v})
    return versions


def read_manifest(directory: str | os.PathLike) -> Manifest:
    """Read and validate ``directory/manifest.json``; refuse a directory without one as uncommitted."""
    directory = os.fspath(directory)
    path = os.path.join(directory, MANIFEST)
    if not os.path.isdir(directory):
        raise UncommittedCheckpointError(directory, "no such checkpoint directory")
    if os.path.normpath(directory).endswith(STAGING_SUFFIX):
        raise UncommittedCheckpointError(
            directory, "is the staging directory of an unfinished save; only the published directory is committed"
        )
    if not os.path.isfile(path):
        raise UncommittedCheckpointError(
            directory, f"no {MANIFEST}: the save never committed (or this is not an interop checkpoint)"
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(path, f"manifest is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CorruptCheckpointError(path, "manifest is not a JSON object")
    return Manifest.from_dict(data, path)
