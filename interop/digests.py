"""Digests a manifest records for files and tensors, and recomputing them by the algorithm that wrote them.

A digest is ``<algorithm>:<hex>``. New checkpoints use BLAKE3: cryptographic like sha256, about four times
faster here (5-6 GB/s on one core against 1.1-1.5 GB/s), and it releases the GIL, so hashing beside a write
or spread over threads keeps up with the disk and verifying a checkpoint on resume is cheap. Digests written
by earlier versions (``sha256``) are still checked by their own algorithm.

A safetensors file's digest (``<algorithm>-st:``) is the hash of its header (length prefix and JSON, padding
included) followed by the raw digest of each tensor's bytes in file order, so a writer hashes every byte once
and gets the file's and every tensor's digest together.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Callable

from .errors import CorruptCheckpointError

ALGO = "blake3"
COMPOSITE_SUFFIX = "-st"


def _blake3() -> Any:
    import blake3

    return blake3.blake3()


_HASHERS: dict[str, Callable[[], Any]] = {"blake3": _blake3, "sha256": hashlib.sha256}
_HEX_LENGTH = {"blake3": 64, "sha256": 64}
_FORMAT = re.compile(r"^([a-z0-9]+)(-st)?:([0-9a-f]+)$")


def hasher(algo: str = ALGO) -> Any:
    """A fresh hash object (``update``, ``digest``, ``hexdigest``) of ``algo``."""
    try:
        return _HASHERS[algo]()
    except KeyError:
        raise ValueError(f"unknown digest algorithm {algo!r} (known: {', '.join(_HASHERS)})") from None


def parse(digest: str, where: str = "") -> tuple[str, bool]:
    """(algorithm, composite) of a recorded digest; a malformed one is a corrupt manifest entry."""
    m = _FORMAT.match(digest) if isinstance(digest, str) else None
    if m is None or m.group(1) not in _HASHERS or len(m.group(3)) != _HEX_LENGTH[m.group(1)]:
        raise CorruptCheckpointError(where or None, f"malformed digest {digest!r} (expected <algorithm>:<hex>, one of {', '.join(_HASHERS)})")
    return m.group(1), m.group(2) is not None


def label(algo: str, hexdigest: str, composite: bool = False) -> str:
    return f"{algo}{COMPOSITE_SUFFIX if composite else ''}:{hexdigest}"


def of_bytes(data: bytes | memoryview, algo: str = ALGO) -> str:
    h = hasher(algo)
    h.update(data)
    return label(algo, h.hexdigest())


_CHUNK = 8 << 20


def of_file(path: str, algo: str = ALGO) -> str:
    """The plain digest of a whole file's bytes."""
    h = hasher(algo)
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return label(algo, h.hexdigest())
