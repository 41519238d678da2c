"""JSON read from checkpoints, strictly: every problem is one CorruptCheckpointError naming the file.

Python's ``json`` accepts what a checkpoint must not hold and fails in ways a user cannot act on: ``NaN`` and
``Infinity`` (not JSON; a NaN step or size would flow into arithmetic), duplicate keys (the last silently
wins, so two readers can see two different files), and deep nesting (RecursionError, here or later in
whatever walks the value). This module refuses all of them up front.
"""

from __future__ import annotations

import json
import os
from typing import Any

from .errors import CorruptCheckpointError

MAX_DEPTH = 64  # our manifests and pieces nest a handful of levels; engines' JSON a few more
MAX_BYTES = 1 << 30


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"duplicate key {dup!r}")
    return out


def _depth_ok(value: Any) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            return False
        if isinstance(node, dict):
            stack.extend((v, depth + 1) for v in node.values())
        elif isinstance(node, list):
            stack.extend((v, depth + 1) for v in node)
    return True


def loads(raw: bytes | str, where: str | os.PathLike | None, what: str = "JSON") -> Any:
    """Parse ``raw`` strictly; ``where`` names the file in the error, ``what`` says what it should have been."""
    try:
        text = raw.decode("utf-8") if isinstance(raw, (bytes, bytearray, memoryview)) else raw
        value = json.loads(text, parse_constant=_no_constant, object_pairs_hook=_unique)
    except UnicodeDecodeError as exc:
        raise CorruptCheckpointError(where, f"{what} is not UTF-8 text (byte {exc.start})") from None
    except RecursionError:
        raise CorruptCheckpointError(where, f"{what} is nested too deeply") from None
    except ValueError as exc:  # JSONDecodeError, NaN, duplicate keys
        raise CorruptCheckpointError(where, f"{what} is not valid: {exc}") from None
    if not _depth_ok(value):
        raise CorruptCheckpointError(where, f"{what} is nested deeper than {MAX_DEPTH} levels")
    return value


def _kind(value: Any) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")


def read_json(path: str | os.PathLike, what: str = "JSON", expect: type | None = dict) -> Any:
    """Parse the JSON file at ``path``; with ``expect`` (default ``dict``), refuse any other top-level type."""
    path = os.fspath(path)
    if os.path.exists(path) and not os.path.isfile(path):
        raise CorruptCheckpointError(path, f"is not a regular file, expected {what}")
    try:
        size = os.path.getsize(path)
        if size > MAX_BYTES:
            raise CorruptCheckpointError(path, f"{what} is {size} bytes; refusing to parse more than {MAX_BYTES}")
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        from .errors import MissingFileError

        raise MissingFileError(path, f"{what} not found") from None
    value = loads(raw, path, what)
    if expect is not None and not isinstance(value, expect):
        names = {dict: "an object", list: "an array", str: "a string"}
        raise CorruptCheckpointError(path, f"{what} is {_kind(value)}, expected {names.get(expect, expect.__name__)}")
    return value
