"""One piece of one component on disk: ``<base>.json`` (skeleton) and ``<base>.safetensors`` (tensors)."""

from __future__ import annotations

import binascii
import json
import os
from typing import Any, Container, Iterable

from . import codec
from .commit import durable_write
from .errors import CorruptCheckpointError, MissingFileError
from .jsonio import read_json
from .manifest import NATIVE_TOP, OUR_FOLDERS, ComponentRecord, FileRecord
from .paths import inside
from .safetensors_io import SafetensorsFile, save_tensors
from .tensors import tensor_digest


def write_piece(directory: str, base: str, state: Any, writer: int | None = None) -> dict[str, FileRecord]:
    """Encode ``state`` without pickle and write it under ``directory``; returns the files written."""
    skeleton, tensors = codec.encode(state)
    inside(directory, base + ".json")  # a component key from the source is part of ``base``: it stays in the output
    os.makedirs(os.path.dirname(os.path.join(directory, base)), exist_ok=True)
    records: dict[str, FileRecord] = {}
    if tensors:
        written = save_tensors(os.path.join(directory, base + ".safetensors"), tensors)
        records[base + ".safetensors"] = FileRecord(written.nbytes, written.digest, writer)
    record = durable_write(os.path.join(directory, base + ".json"), json.dumps({"state": skeleton}, allow_nan=False).encode())
    record.writer = writer
    records[base + ".json"] = record
    return records


def piece_files(bases: Iterable[str], listed: Container[str]) -> list[str]:
    """The files of these pieces that exist in a manifest's file list (the .safetensors part is optional)."""
    return [f"{b}{ext}" for b in bases for ext in (".json", ".safetensors") if f"{b}{ext}" in listed]


def is_native_top_file(rel: str) -> bool:
    """Whether listed file ``rel`` belongs to a native component kept at the checkpoint's top level."""
    return rel.split("/", 1)[0] not in OUR_FOLDERS


def component_files(record: ComponentRecord, listed: Iterable[str]) -> list[str]:
    """Every listed file of one component: its pieces' files, or for a native component its whole directory."""
    if record.native:
        if record.native_base == NATIVE_TOP:
            return [f for f in listed if is_native_top_file(f)]
        prefixes = tuple(base + "/" for base in record.pieces.values())
        return [f for f in listed if f.startswith(prefixes)]
    listed = set(listed)
    return piece_files(record.pieces.values(), listed)


def read_piece(directory: str, base: str, lazy: bool = False) -> Any:
    """Decode a piece; with ``lazy`` its tensors come back as LazyTensors (for converters)."""
    path = inside(directory, base + ".json")
    if not os.path.isfile(path):
        raise MissingFileError(path, "component file missing")
    document = read_json(path, "component file")
    if "state" not in document:
        raise CorruptCheckpointError(path, "component file is not valid: no 'state'")
    tensor_path = inside(directory, base + ".safetensors")
    st = SafetensorsFile(tensor_path) if os.path.lexists(tensor_path) else None

    def tensor(name: str) -> Any:
        if st is None or not isinstance(name, str) or name not in st:
            raise CorruptCheckpointError(tensor_path, f"tensor {name!r} named by {base}.json is missing")
        return st.lazy(name) if lazy else st.read(name)

    try:
        return codec.decode(document["state"], tensor)
    except (KeyError, TypeError, ValueError, binascii.Error) as exc:
        raise CorruptCheckpointError(path, f"component file is not valid: {type(exc).__name__}: {exc}") from None


def state_fingerprint(state: Any) -> dict[str, str]:
    """Per-key digests of a state dict: raw bytes for tensors (bf16/fp16 exact), repr for scalars.

    Keys are dotted paths into the state, so a mismatch can be reported as 'key model.layers.0.weight'.
    """
    skeleton, tensors = codec.encode(state)
    prints: dict[str, str] = {}

    def join(path: str, key: Any) -> str:
        return f"{path}.{key}" if path else str(key)

    def walk(node: Any, path: str) -> None:
        if isinstance(node, list):
            for i, v in enumerate(node):
                walk(v, join(path, i))
        elif not isinstance(node, dict):
            prints[path or "<value>"] = repr(node)
        elif "__tensor__" in node or "__ndarray__" in node:
            prints[path or "<value>"] = tensor_digest(tensors[node.get("__tensor__", node.get("__ndarray__"))])
        elif "__tuple__" in node:
            walk(node["__tuple__"], path)
        elif "__dict__" in node:
            for k, v in node["__dict__"]:
                walk(v, join(path, k if isinstance(k, (str, int)) else json.dumps(k)))
        elif any(tag in node for tag in ("__float__", "__bytes__", "__dtype__")):
            prints[path or "<value>"] = json.dumps(node, sort_keys=True)
        else:
            for k, v in node.items():
                walk(v, join(path, k))

    try:
        walk(skeleton, "")
    finally:
        walk = None  # it named itself: a reference cycle that kept the state's host copies until the garbage collector ran
    return prints
