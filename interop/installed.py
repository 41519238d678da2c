"""An installed package's version, without importing the package or importlib.metadata.

Every command asks for a version or two (the producer versions a manifest records, transformers' for the answers
kept about a model), and ``import importlib.metadata`` alone costs 25-35 ms here (email, zipfile, csv ...), a
tenth of a small conversion's start-up. The version is the ``Version:`` line of the package's ``.dist-info``
beside it, which is where importlib.metadata reads it too; where that is not plain (no dist-info beside the
package, as in a development install, or several of them) importlib.metadata answers as before.
"""

from __future__ import annotations

import os
from importlib.util import find_spec


def version(name: str) -> str | None:
    """The installed version of distribution ``name`` (imported under the same name: torch, transformers,
    deepspeed), or None where it is not installed."""
    found = _beside_package(name)
    if found is not None:
        return found
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as metadata_version

    try:
        return metadata_version(name)
    except PackageNotFoundError:
        return None


def _beside_package(name: str) -> str | None:
    try:
        spec = find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.submodule_search_locations:
        return None
    parent = os.path.dirname(os.path.dirname(spec.origin))
    prefix = name.lower().replace("-", "_") + "-"
    try:
        infos = [e for e in os.listdir(parent) if e.lower().startswith(prefix) and e.endswith(".dist-info")]
        if len(infos) != 1:
            return None
        with open(os.path.join(parent, infos[0], "METADATA"), encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    break  # the headers end at the first blank line
                if line.startswith("Version:"):
                    return line.split(":", 1)[1].strip() or None
    except OSError:
        return None
    return None
