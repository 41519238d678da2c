"""The manifest: written last, its presence marks a checkpoint committed, and it lists every file.

Two formats share it: ``interop-checkpoint`` (a trainer's save; model and optimizer in the engine's own
layout) and ``interop-universal`` (the portable checkpoint). Field names are stable within a format_version.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from . import digests
from .errors import CheckpointError, CorruptCheckpointError, UncommittedCheckpointError
from .jsonio import read_json
from .paths import check_relative

MANIFEST = "manifest.json"
STAGING_SUFFIX = ".staging"  # a directory being written; never loaded, even once its manifest exists
FORMAT_VERSION = 2  # 2: a large file's digest may be of its blocks (FileRecord.blocks)
CHECKPOINT_FORMAT = "interop-checkpoint"
UNIVERSAL_FORMAT = "interop-universal"
KNOWN_FORMATS = (CHECKPOINT_FORMAT, UNIVERSAL_FORMAT)


@dataclass
class FileRecord:
    bytes: int
    digest: str
    writer: int | None = None
    blocks: list[str] | None = None  # a file larger than one block: each block's digest (interop.digests)
    block_bytes: int | None = None  # and the size of those blocks


@dataclass
class TensorRecord:
    shape: list[int]
    dtype: str
    file: str
    digest: str

# A native component at the top level of its checkpoint: every listed file outside our own folders is the
# engine's. Our pieces live only in these folders, so the engine's files and ours never share a name.
NATIVE_TOP = "."
OUR_FOLDERS = ("components", "ranks", "groups", "nodes")


@dataclass
class ComponentRecord:
    pattern: str
    policy: str
    required: bool = True
    group: str | None = None
    pieces: dict[str, str] = field(default_factory=dict)  # owner -> base path (files: base.json, base.safetensors)
    native: bool = False  # written by the engine itself: every file under pieces["native"] + "/" belongs to it

    @property
    def native_base(self) -> str:
        """Where a native component's files lie: a folder, or ``NATIVE_TOP`` for the checkpoint's top level,
        beside the manifest, where the engine's own loader pointed at the directory finds them."""
        return self.pieces.get("native", "")


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
        data = asdict(self)
        for rec in data["files"].values():
            if rec.get("blocks") is None:
                rec.pop("blocks", None)
                rec.pop("block_bytes", None)
        data[SELF_DIGEST] = _self_digest(data)
        return json.dumps(data, indent=1, sort_keys=False, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict[str, Any], path: str = MANIFEST) -> "Manifest":
        """Validate every field's type and every path it names, then the manifest's own digest: a manifest
        is input like any other file, and the one file no other digest covers."""
        if data.get("format") not in KNOWN_FORMATS:
            raise CorruptCheckpointError(path, f"unknown manifest format {data.get('format')!r}")
        version = data.get("format_version", 0)
        if isinstance(version, int) and version > FORMAT_VERSION:
            raise CorruptCheckpointError(
                path, f"format_version {version} is newer than this interop ({FORMAT_VERSION}); upgrade interop"
            )
        _validate(data, path)
        recorded = data.get(SELF_DIGEST)
        if recorded is not None and _self_digest(data, path) != recorded:
            raise CorruptCheckpointError(path, "the manifest's content does not match its own digest (altered or corrupted)")
        data = {k: v for k, v in data.items() if k != SELF_DIGEST}
        data["tensors"] = {k: TensorRecord(**v) for k, v in data.get("tensors", {}).items()}
        data["components"] = {k: ComponentRecord(**v) for k, v in data.get("components", {}).items()}
        data["files"] = {k: FileRecord(**v) for k, v in data.get("files", {}).items()}
        return cls(**data)


# The manifest's digest of itself: over its other fields in a canonical JSON form, so any change to a value
# (a flipped byte in a digest, a size, a name, a note) is caught. Manifests of earlier versions have none.
SELF_DIGEST = "digest"


def _self_digest(data: dict[str, Any], where: str = "") -> str:
    body = {k: v for k, v in data.items() if k != SELF_DIGEST}
    algo = digests.parse(data[SELF_DIGEST], where)[0] if isinstance(data.get(SELF_DIGEST), str) else digests.ALGO
    return digests.of_bytes(json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False).encode(), algo)


# --- the schema -------------------------------------------------------------------------------------------
_HEX = re.compile(r"^[0-9a-f]+$")
MAX_BLOCK_BYTES = 1 << 30  # a block is read into memory whole to be checked
_KEY = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # component keys name directories: one plain path part
_INT_FIELDS = ("world_size", "dp", "tp", "pp", "zero_stage", "step", "scheduler_steps_per_step")  # values arithmetic uses


def _validate(data: dict[str, Any], path: str) -> None:
    from .state import SharingPattern, WorldSizePolicy

    def fail(problem: str) -> None:
        raise CorruptCheckpointError(path, f"malformed manifest: {problem}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    def strs(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    def mapping(name: str, v: Any, optional: bool = True) -> dict:
        if v is None and optional:
            return {}
        if not isinstance(v, dict):
            fail(f"{name} is not an object")
        return v

    def ints_of(name: str, section: dict) -> None:
        for key in _INT_FIELDS:
            if section.get(key) is not None and not is_int(section[key]):
                fail(f"{name}.{key} is {section[key]!r}, not a non-negative integer")

    unknown = set(data) - set(Manifest.__dataclass_fields__) - {SELF_DIGEST}
    if unknown:
        fail(f"unknown fields {sorted(unknown)}")
    if not is_int(data.get("format_version", 1)) or data.get("format_version", 1) < 1:
        fail(f"format_version is {data.get('format_version')!r}")
    if not isinstance(data.get("committed_at", ""), str) or not isinstance(data.get(SELF_DIGEST, ""), str):
        fail("committed_at and digest must be strings")
    if data.get("step") is not None and not is_int(data["step"]):
        fail(f"step is {data['step']!r}, not a non-negative integer")
    producer = mapping("producer", data.get("producer"))
    if not all(isinstance(v, str) for v in producer.values()):
        fail("producer versions must be strings")
    for name in ("source", "sharding", "optimizer", "memory"):
        ints_of(name, mapping(name, data.get(name)))
    topology = mapping("topology", data.get("topology"), optional=False)
    try:
        from .topology import Topology

        if not is_int(topology.get("world_size")) or topology["world_size"] < 1:
            fail(f"topology.world_size is {topology.get('world_size')!r}")
        Topology.from_json(topology)
    except CheckpointError:
        raise
    except Exception as exc:  # noqa: BLE001 - TopologyError, TypeError, ...: one line naming the manifest
        fail(f"topology: {exc}")
    model = mapping("model", data.get("model"))
    if not all(isinstance(g, list) and strs(g) for g in model.get("tied") or []) or not strs(model.get("frozen") or []):
        fail("model.tied must be lists of names and model.frozen a list of names")
    adapter = mapping("model.adapter", model.get("adapter"))
    if adapter and (not isinstance(adapter.get("name"), str) or not isinstance(adapter.get("config"), (str, dict))):
        fail("model.adapter must name the adapter and its config (a path or an object)")
    if isinstance(adapter.get("config"), str):
        check_relative(adapter["config"], path)
    if isinstance(model.get("config"), str):
        check_relative(model["config"], path)
    elif model.get("config") is not None and not isinstance(model.get("config"), dict):
        fail("model.config must be a path or an object")
    optimizer = mapping("optimizer", data.get("optimizer"))
    if not isinstance(optimizer.get("class", ""), str):
        fail(f"optimizer.class is {optimizer['class']!r}, not the name of an optimizer class")
    if optimizer.get("groups") is not None:
        check_relative(optimizer["groups"], path)
    if not isinstance(data.get("notes", []), list) or not strs(data.get("notes", [])):
        fail("notes must be a list of strings")
    for rel, rec in mapping("files", data.get("files")).items():
        check_relative(rel, path)
        if not isinstance(rec, dict) or set(rec) - {"bytes", "digest", "writer", "blocks", "block_bytes"} or not is_int(rec.get("bytes")):
            fail(f"files[{rel!r}] needs bytes (a non-negative integer) and digest")
        if rec.get("writer") is not None and not is_int(rec["writer"]):
            fail(f"files[{rel!r}].writer is {rec['writer']!r}")
        kind = digests.parse(rec["digest"], path) if rec.get("digest") else None
        blocks = rec.get("blocks")
        if (kind is not None and kind[1] == digests.BLOCKS) != (blocks is not None):
            fail(f"files[{rel!r}] has block digests only where its digest is of blocks")
        size = rec.get("block_bytes")
        if (blocks is None) != (size is None) or (size is not None and (not is_int(size) or not 1 <= size <= MAX_BLOCK_BYTES)):
            fail(f"files[{rel!r}] has block digests without a block size, or a block size of {size!r}")
        if blocks is not None and (
            not isinstance(blocks, list) or len(blocks) != digests.block_count(rec["bytes"], size)
            or not all(isinstance(b, str) and _HEX.match(b) and len(b) == len(rec["digest"].split(":")[1]) for b in blocks)
            or digests.of_blocks(blocks, kind[0]) != rec["digest"]
        ):
            fail(f"files[{rel!r}].blocks are not the {digests.block_count(rec['bytes'], size)} block digests its digest is of")
    for name, rec in mapping("tensors", data.get("tensors")).items():
        if not isinstance(rec, dict) or set(rec) != {"shape", "dtype", "file", "digest"}:
            fail(f"tensors[{name!r}] needs shape, dtype, file and digest")
        if not isinstance(rec["shape"], list) or not all(is_int(d) for d in rec["shape"]) or not isinstance(rec["dtype"], str):
            fail(f"tensors[{name!r}] has shape {rec['shape']!r} and dtype {rec['dtype']!r}")
        check_relative(rec["file"], path)
        if rec["digest"] is not None:
            digests.parse(rec["digest"], path)
    patterns, policies = {p.value for p in SharingPattern}, {p.value for p in WorldSizePolicy}
    for key, rec in mapping("components", data.get("components")).items():
        if not _KEY.match(key):
            fail(f"component key {key!r} is not a plain name")
        if not isinstance(rec, dict) or set(rec) - set(ComponentRecord.__dataclass_fields__):
            fail(f"components[{key!r}] has unknown fields")
        if rec.get("pattern") not in patterns or rec.get("policy") not in policies:
            fail(f"components[{key!r}] has pattern {rec.get('pattern')!r} and policy {rec.get('policy')!r}")
        if not isinstance(rec.get("required", True), bool) or not isinstance(rec.get("native", False), bool):
            fail(f"components[{key!r}].required and .native must be booleans")
        if rec.get("group") is not None and not isinstance(rec["group"], str):
            fail(f"components[{key!r}].group must be a name")
        for owner, base in mapping(f"components[{key!r}].pieces", rec.get("pieces")).items():
            if not (rec.get("native") and base == NATIVE_TOP):
                check_relative(base, path)


def now_iso() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def producer_versions(**extra: str) -> dict[str, str]:
    from . import __version__
    from .installed import version

    torch_version = version("torch")  # without importing torch
    if torch_version is None:  # torch on a path of its own, without install metadata
        import torch

        torch_version = torch.__version__
    versions = {"interop": __version__, "torch": torch_version.split("+")[0]}
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
    if os.path.islink(path):
        raise CorruptCheckpointError(path, "the manifest is a symbolic link; a checkpoint holds its own regular files")
    return Manifest.from_dict(read_json(path, "manifest"), path)
