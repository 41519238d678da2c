"""An interop checkpoint around an engine's own files: what our engine trainers save and resume from, and what
``interop convert --to <engine>`` writes. The engine's files are where its own loader, pointed at the output
directory, looks for them: at the top level (accelerate, Trainer, DCP), or in the folder the engine's tag file
names (DeepSpeed's ``latest``, ``latest_universal``, Megatron's tracker). Our manifest and the source's other
components (data position, trainer state, RNG, ...) sit beside the engine's files, which engines ignore;
everything is staged, listed and digested in the manifest, and published at once."""

from __future__ import annotations

import collections
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, TypeVar

from interop.written_digests import digesting_as_written
from interop.commit import fsync_path, staged_output, write_manifest
from interop.errors import ConversionError, UnknownFormatError
from interop.logical import ComponentSource, LogicalCheckpoint
from interop.pieces import read_piece
from interop.manifest import CHECKPOINT_FORMAT, MANIFEST, NATIVE_TOP, ComponentRecord, FileRecord, Manifest, now_iso, producer_versions
from interop.sharding import ShardingMetadata
from interop.planner import pieces_for
from interop.state import ComponentSpec, SharingPattern, WorldSizePolicy
from interop.topology import Topology
from interop.universal import copy_components
from interop.verify import open_checkpoint, tree_records

from .detection import committed_manifest, holds_component, holds_native  # noqa: F401 - theirs, for the readers

log = logging.getLogger(__name__)
T = TypeVar("T")

RNG = "rng"  # the per-rank generators' component, in every format that keeps them


def native_dir(directory: str, manifest: Manifest, key: str) -> str:
    """Where our checkpoint at ``directory`` keeps native component ``key``'s files."""
    if key not in manifest.components or not manifest.components[key].native:
        raise UnknownFormatError(directory, f"holds no {key!r} files (its components: {sorted(manifest.components)})")
    return os.path.normpath(os.path.join(directory, manifest.components[key].native_base))


def owning_checkpoint(directory: str, key: str, verify_digests: bool = True) -> tuple[Manifest | None, str]:
    """(manifest, checkpoint directory) of our checkpoint whose native ``key`` files lie at ``directory``:
    beside its manifest, or (older checkpoints) in its ``key/`` folder; every file checked against the
    manifest. (None, directory) for an engine's own bare directory."""
    if os.path.isfile(os.path.join(directory, MANIFEST)):
        manifest = open_checkpoint(directory, verify_digests)
        native_dir(directory, manifest, key)  # refuses our checkpoint around another engine's files
        return manifest, directory
    parent = os.path.dirname(directory)
    if os.path.basename(directory) != key or not os.path.isfile(os.path.join(parent, MANIFEST)):
        return None, directory
    return open_checkpoint(parent, verify_digests), parent


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


def rank_rng_states(ckpt: LogicalCheckpoint, world: int) -> list[dict[str, Any]] | None:
    """Each target rank's RNG state when the source has one per rank at this world size; None otherwise."""
    if RNG in ckpt.rank_state:  # read from an engine's files
        states = ckpt.rank_state[RNG]
        return states if len(states) == world else None
    comp = ckpt.components.get(RNG)
    if comp is None or comp.record.pattern != SharingPattern.PER_RANK.value or len(comp.record.pieces) != world:
        return None
    spec = ComponentSpec(RNG, SharingPattern.PER_RANK)
    return [read_piece(comp.directory, comp.record.pieces[p.owner]) for p in pieces_for(spec, Topology.uniform(world))]


def per_rank_notes(components: dict[str, ComponentRecord], topology: dict | None, world_size: int) -> list[str]:
    """One line per carried per-rank component that a run on ``world_size`` ranks cannot restore as saved."""
    saved = Topology.from_json(topology).world_size if topology else None
    if saved is None or saved == world_size:
        return []
    return [f"{key}: per-rank state saved by {saved} ranks cannot follow onto {world_size}; the resumed run "
            f"applies its policy '{rec.policy}'" + (" (fresh streams per rank)" if rec.policy == WorldSizePolicy.RESEED.value else "")
            for key, rec in components.items() if rec.pattern == SharingPattern.PER_RANK.value and not rec.native]


WRITERS = min(4, os.cpu_count() or 1)  # an engine's files written at once: one pickled while others go to the disk


def at_once(work: Callable[..., T], items: list[tuple], name: str) -> Iterator[T]:
    """``work(*item)`` for each item on up to :data:`WRITERS` threads, the results in the items' order (progress is
    reported by the caller, on its own thread). A failure, or Ctrl-C, cancels the items not started instead of
    writing every one of them before the error is seen."""
    threads = max(1, min(WRITERS, len(items)))
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    pending: collections.deque = collections.deque()
    try:
        for item in items:
            pending.append(pool.submit(work, *item))
            if len(pending) > threads:  # a window of work ahead, not every item queued at once
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


@dataclass
class Written:
    """What an engine writer put in the output: ``at`` is the folder (named by the engine's tag file it wrote at
    the output's top) that holds the checkpoint, "" for the output itself; ``notes`` what it could not keep."""

    at: str = ""
    notes: list[str] = field(default_factory=list)


def trained_though_built_frozen(ckpt: LogicalCheckpoint, optimizer: dict | None) -> list[str]:
    """A note for parameters the engine's files train that the model's own modules build frozen: from_pretrained
    makes every loaded weight trainable, these too (transformers sets ``requires_grad`` anew as it loads), so a
    model loaded that way trains them, and one built from its config does not: a loader that places optimizer
    entries by position (ZeRO's flat groups, optimizer.bin, optimizer.pt) then finds one group too short."""
    from .models.facts import built_frozen

    trained = {n for g in (optimizer or {}).get("param_names") or [] for n in g}
    names = [n for n in built_frozen(ckpt.config) if n in trained]
    if not names:
        return []
    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
    return [f"optimizer: {names[0]}{more} trained, as after from_pretrained (which makes every loaded weight trainable), "
            "though the model's modules build them frozen: a model built from its config needs requires_grad_(True) on "
            "them before loading these files"]


def write_engine_checkpoint(
    ckpt: LogicalCheckpoint,
    dst: str,
    key: str,
    write_files: Callable[[str], Written | list[str] | None],
    sharding: ShardingMetadata,
    producer: dict[str, str],
    optimizer: dict | None,
    overwrite: bool = False,
    consumed: frozenset[str] = frozenset(),
) -> Manifest:
    """``write_files(out)`` writes the engine's files as the engine would save them into ``out`` (the staged
    ``dst``); ``consumed`` names the source components those files already hold, which are not carried beside.
    ``sharding.any_world_size``: the engine's files load on any number of ranks (DCP), so no world size is the
    target's and the carried per-rank state is judged by the run that loads it, not here."""
    with staged_output(dst, overwrite) as out, digesting_as_written() as ahead:
        written = write_files(out)  # each file hashed as it is finished (save_torch says so), beside the next ones
        if not isinstance(written, Written):
            written = Written(notes=list(written or []))
        notes = list(written.notes) + trained_though_built_frozen(ckpt, optimizer)
        at = os.path.join(out, written.at) if written.at else out
        files: dict[str, FileRecord] = tree_records(at, NATIVE_TOP, ahead=ahead)
        carried = ckpt
        if consumed:
            carried = LogicalCheckpoint(
                model={}, components={k: v for k, v in ckpt.components.items() if k not in consumed},
                extra_state={k: v for k, v in ckpt.extra_state.items() if k not in consumed},
                rank_state={k: v for k, v in ckpt.rank_state.items() if k not in consumed},
            )
        components = copy_components(carried, at, files)
        if not sharding.any_world_size:
            notes += per_rank_notes(components, ckpt.topology, sharding.world_size)
        components[key] = ComponentRecord(
            pattern=SharingPattern.PER_RANK.value, policy=WorldSizePolicy.RESHARD.value, pieces={"native": NATIVE_TOP}, native=True
        )
        for d in {os.path.dirname(os.path.join(at, rel)) for rel in files}:
            fsync_path(d)
        manifest = Manifest(
            format=CHECKPOINT_FORMAT,
            topology=ckpt.topology or Topology.uniform(sharding.world_size).to_json(),  # what the carried pieces are for
            committed_at=now_iso(),
            producer=producer_versions(**producer),
            step=ckpt.step,
            source=ckpt.source,
            sharding=sharding.to_json(),
            model={"family": (ckpt.config or {}).get("model_type"), "config": ckpt.config, "tied": ckpt.tied, "frozen": ckpt.frozen,
                   **({"adapter": {"config": ckpt.adapter.config, "name": ckpt.adapter.name}} if ckpt.adapter else {})},
            optimizer=optimizer,
            components=components,
            files=dict(sorted(files.items())),
            notes=list(ckpt.notes) + notes,
        )
        write_manifest(at, manifest)
    for note in notes:
        log.info("%s", note)
    return manifest
