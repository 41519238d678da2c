"""An interop checkpoint around an engine's own files (``deepspeed/``, ``accelerate/``): what our engine trainers
save and resume from, and what ``interop convert --to deepspeed|accelerate`` writes. The engine's directory is
a native component; the source's other components (data position, trainer state, RNG, ...) are carried beside
it; everything is staged, listed and digested in the manifest, and published at once."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

from interop.commit import fsync_path, resolve_checkpoint_dir, staged_output, write_manifest
from interop.errors import ConversionError
from interop.logical import ComponentSource, LogicalCheckpoint
from interop.pieces import read_piece
from interop.manifest import CHECKPOINT_FORMAT, MANIFEST, ComponentRecord, FileRecord, Manifest, now_iso, producer_versions, read_manifest
from interop.sharding import ShardingMetadata
from interop.state import SharingPattern, WorldSizePolicy
from interop.topology import Topology
from interop.universal import copy_components
from interop.verify import open_checkpoint, tree_records

log = logging.getLogger(__name__)


def committed_manifest(path: str) -> Manifest | None:
    """The manifest of the interop checkpoint at ``path`` (or its ``latest``), or None: for detection, which
    never raises (reading does)."""
    try:
        directory = resolve_checkpoint_dir(path)
        if not os.path.isfile(os.path.join(directory, MANIFEST)):
            return None
        return read_manifest(directory)
    except Exception:  # noqa: BLE001
        return None


def holds_native(path: str, key: str) -> bool:
    """Whether ``path`` is one of our checkpoints (or its root) around the engine's own ``key/`` directory:
    detected by its manifest, so a damaged engine directory is reported by the reader, not as 'unknown'."""
    manifest = committed_manifest(path)
    return manifest is not None and key in manifest.components and manifest.components[key].native


def enclosing_manifest(directory: str, key: str, verify_digests: bool = True) -> Manifest | None:
    """The manifest of our checkpoint around ``directory`` when it is that checkpoint's native ``key/``
    directory, with every file checked against it; None for an engine's own bare directory."""
    parent = os.path.dirname(directory)
    if os.path.basename(directory) != key or not os.path.isfile(os.path.join(parent, MANIFEST)):
        return None
    return open_checkpoint(parent, verify_digests)


def carried_components(directory: str, manifest: Manifest | None, key: str) -> dict[str, ComponentSource]:
    """What our checkpoint at ``directory`` keeps beside the engine's files: every component but ``key``."""
    if manifest is None:
        return {}
    return {k: ComponentSource.from_manifest(directory, manifest, k) for k in manifest.components if k != key}


def component_state(ckpt: LogicalCheckpoint, key: str) -> Any:
    """A GLOBAL component's state (a scheduler, carried extra state), from the reader's memory or from the
    source's files (a universal checkpoint keeps it as a component)."""
    if key in ckpt.extra_state:
        return ckpt.extra_state[key]
    comp = ckpt.components.get(key)
    if comp is None:
        return None
    if comp.record.pattern not in ("GLOBAL", "REPLICATED") or comp.record.native:
        raise ConversionError(f"component {key!r} is {comp.record.pattern}; the target keeps one copy")
    return read_piece(comp.directory, comp.record.pieces["global"])


def per_rank_notes(components: dict[str, ComponentRecord], topology: dict | None, world_size: int) -> list[str]:
    """One line per carried per-rank component that a run on ``world_size`` ranks cannot restore as saved."""
    saved = Topology.from_json(topology).world_size if topology else None
    if saved is None or saved == world_size:
        return []
    return [f"{key}: per-rank state saved by {saved} ranks cannot follow onto {world_size}; the resumed run "
            f"applies its policy '{rec.policy}'" + (" (fresh streams per rank)" if rec.policy == WorldSizePolicy.RESEED.value else "")
            for key, rec in components.items() if rec.pattern == SharingPattern.PER_RANK.value and not rec.native]


def write_engine_checkpoint(
    ckpt: LogicalCheckpoint,
    dst: str,
    key: str,
    write_files: Callable[[str], list[str] | None],
    sharding: ShardingMetadata,
    producer: dict[str, str],
    optimizer: dict | None,
    overwrite: bool = False,
    consumed: frozenset[str] = frozenset(),
) -> Manifest:
    """``write_files(directory)`` writes the engine's files (and may return notes); ``consumed`` names the
    source components those files already hold, which are therefore not carried beside them."""
    with staged_output(dst, overwrite) as out:
        notes = write_files(os.path.join(out, key)) or []
        files: dict[str, FileRecord] = tree_records(out, key)
        carried = ckpt
        if consumed:
            carried = LogicalCheckpoint(
                model={}, components={k: v for k, v in ckpt.components.items() if k not in consumed},
                extra_state={k: v for k, v in ckpt.extra_state.items() if k not in consumed},
                rank_state={k: v for k, v in ckpt.rank_state.items() if k not in consumed},
            )
        components = copy_components(carried, out, files)
        notes += per_rank_notes(components, ckpt.topology, sharding.world_size)
        components[key] = ComponentRecord(
            pattern=SharingPattern.PER_RANK.value, policy=WorldSizePolicy.RESHARD.value, pieces={"native": key}, native=True
        )
        for d in {os.path.dirname(os.path.join(out, rel)) for rel in files}:
            fsync_path(d)
        manifest = Manifest(
            format=CHECKPOINT_FORMAT,
            topology=ckpt.topology or Topology.uniform(sharding.world_size).to_json(),  # what the carried pieces are for
            committed_at=now_iso(),
            producer=producer_versions(**producer),
            step=ckpt.step,
            source=ckpt.source,
            sharding=sharding.to_json(),
            model={"family": (ckpt.config or {}).get("model_type"), "config": ckpt.config, "tied": ckpt.tied, "frozen": ckpt.frozen},
            optimizer=optimizer,
            components=components,
            files=dict(sorted(files.items())),
            notes=list(ckpt.notes) + notes,
        )
        write_manifest(out, manifest)
    for note in notes:
        log.info("%s", note)
    return manifest
