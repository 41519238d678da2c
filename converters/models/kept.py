"""Answers asked of transformers, kept on disk.

Asking transformers costs seconds (importing it, and the model's module), more than a conversion of a GiB takes
otherwise. An answer that depends only on its question and the installed code (what a config's model looks like,
the config.json transformers builds from a checkpoint's sizes) is kept in one small JSON file, named by the
answer's identity: the kind of question, the question itself, this code (interop's version and the kind's
schema) and the installed transformers (its version, read from its metadata without importing it, and the time
its package was last written, which a development install's version string does not change with).
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Callable, TypeVar

log = logging.getLogger(__name__)

CACHE_ENV = "INTEROP_CACHE_DIR"  # where answers are kept; "off": nowhere (every conversion asks transformers)

T = TypeVar("T")


def kept_path(kind: str, schema: int, key: str) -> tuple[str, str] | None:
    """(the file keeping the answer to ``key``, the answer's identity), or None when keeping is off or
    transformers is not installed."""
    from importlib.util import find_spec

    from interop import __version__
    from interop.installed import version

    root = os.environ.get(CACHE_ENV)
    if root == "off":
        return None
    if not root:
        root = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "interop")
    try:
        installed = version("transformers")
        spec = find_spec("transformers")
        written = os.stat(spec.origin).st_mtime_ns if spec is not None and spec.origin else 0
    except (ValueError, OSError):
        return None
    if installed is None:
        return None
    import xxhash  # a cache file's name, not a digest anything is checked against (hashlib: 3 ms of start-up)

    identity = xxhash.xxh3_128_hexdigest(f"{kind}\0{schema}\0{__version__}\0{installed}\0{written}\0{key}".encode())
    return os.path.join(root, "model-facts", f"{identity}.json"), identity


def kept(kind: str, schema: int, key: str, ask: Callable[[], T], to_json: Callable[[T], dict[str, Any]],
         from_json: Callable[[dict[str, Any]], T], keep: Callable[[T], bool] = lambda _: True) -> T:
    """The answer to ``key``: the kept one if there is one (``from_json`` checks every field: a ValueError,
    KeyError or TypeError from it, like a file kept for another question, means it is asked again), else
    ``ask()``'s, kept when ``keep`` says so. Keeping is best effort: an unwritable directory costs the next
    conversion the question again, nothing else."""
    found = kept_path(kind, schema, key)
    path, identity = found if found is not None else (None, None)
    if path is not None and os.path.isfile(path):
        try:
            with open(path, encoding="utf-8") as f:
                raw = json.load(f)
            if not isinstance(raw, dict) or raw.get("identity") != identity:
                raise ValueError("kept for another question, interop or transformers (a copied file)")
            return from_json(raw)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            log.debug("the %s answer kept in %s is unreadable (%s); asking transformers", kind, path, exc)
    answer = ask()
    if path is not None and keep(answer):
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            text = json.dumps({**to_json(answer), "identity": identity})
            tmp = f"{path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, path)
        except (OSError, TypeError, ValueError) as exc:  # unwritable, or an answer JSON cannot hold: asked next time
            log.debug("could not keep the %s answer in %s (%s)", kind, path, exc)
    return answer
