"""CheckpointManager: saves and loads a provider's state components with the commit protocol.

Every rank calls ``save``/``load`` together. Each phase ends with one all-gather of every rank's outcome, so
a failure anywhere becomes the same error everywhere and no rank is left waiting in a collective.
"""

from __future__ import annotations

import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

from . import locking
from .background import PendingCommit, commit_collective, on_staging_thread, staged
from .commit import STAGING_SUFFIX, fsync_path, fsync_tree, prune, publish, resolve_checkpoint_dir, write_latest, write_manifest
from .dist import Collective, agree, default_collective, runtime_topology
from .errors import ComponentError, CorruptCheckpointError, LoadFailedError, ReplicationError, SaveFailedError, TopologyError
from .manifest import CHECKPOINT_FORMAT, NATIVE_TOP, ComponentRecord, FileRecord, Manifest, now_iso, producer_versions, read_manifest
from .pieces import component_files, read_piece, state_fingerprint, write_piece
from .planner import pieces_for, plan_save, resolve_load
from .replication import find_mismatches
from .state import ComponentSpec, NativeLoad, SharingPattern, StateComponent, WorldSizePolicy, components_of, is_native, native_base
from .topology import Topology
from .verify import check_against_manifest, tree_records

log = logging.getLogger(__name__)

_METADATA_FIELDS = ("source", "sharding", "model", "optimizer", "memory", "notes")


@dataclass
class LoadResult:
    path: str
    manifest: Manifest
    notes: list[str] = field(default_factory=list)

    @property
    def step(self) -> int | None:
        return self.manifest.step


def describe_error(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}"


def _replication_domains(spec: ComponentSpec, topology: Topology) -> list[tuple[int, ...]]:
    return [piece.readers for piece in pieces_for(spec, topology)]


class CheckpointManager:
    """Saves ``provider``'s components under ``root/<name_format>`` and loads them back.

    The provider implements ``get_state_components()`` (and ``get_process_groups()`` for PER_GROUP), or the
    legacy ``get_statefuls_for_save()/get_statefuls_for_load()``. An optional ``get_checkpoint_metadata()``
    returns manifest sections (model, sharding, source, optimizer, notes).
    """

    def __init__(
        self,
        root: str,
        provider: Any,
        collective: Collective | None = None,
        keep_last: int | None = None,
        name_format: str = "checkpoint-{step}",
    ):
        self.root = os.path.abspath(root)
        self.provider = provider
        self.collective = collective or default_collective()
        self.keep_last = keep_last
        self.name_format = name_format
        # what the last load could not restore ("rng: saved for 2 ranks, now 4: ... reseeded"): every later
        # manifest of this run records it, so a checkpoint says what its history lost
        self.resume_notes: list[str] = []
        self.claimed = False
        self._pending: PendingCommit | None = None  # a save(wait=False) whose commit is running
        self._commit_group: Collective | None = None  # the background commit's collectives (a group of their own)

    def lock_path(self) -> str:
        return os.path.join(self.root, locking.RUN_LOCK)

    def claim(self) -> None:
        """Make this run the only writer of ``root`` (collective; rank 0 holds the lock until the process
        ends). A second run into the same directory would publish over this one's checkpoints: it is refused."""
        def take() -> None:
            locking.refuse_if_in_use(self.root, self.root)  # a conversion writing it, a run around it
            os.makedirs(self.root, exist_ok=True)
            locking.claim(self.lock_path(), self.root)

        if not self.claimed:
            self.on_rank_zero(take, what=f"claiming {self.root}", failure=SaveFailedError)
        self.claimed = True

    # ------------------------------------------------------------------------------------------------
    def path_for(self, step: int) -> str:
        """Where checkpoint ``step`` is (or will be) committed."""
        return os.path.join(self.root, self.name_format.format(step=step))

    def topology(self) -> Topology:
        return runtime_topology(self.collective, getattr(self.provider, "get_process_groups", None))

    def agree(self, error: str | None, payload: Any = None, failure=SaveFailedError, what: str = "save",
              own: BaseException | None = None, collective: Collective | None = None) -> list[Any]:
        """All-gather (error, payload) and return the payloads; if any rank failed, every rank raises: ``failure``
        naming the first failed rank, or, on a rank that failed itself, its own exception ``own`` (chained to
        that; unchained in a single process). A collective step for work one rank may do for all."""
        return agree(collective or self.collective, error, payload, failure, what, own)

    def on_rank_zero(self, work, what: str, failure=LoadFailedError) -> None:
        """Rank 0 runs ``work()`` (a conversion into a scratch directory, say) while the others wait; every
        rank raises if it failed, so none is left waiting in a collective of its own."""
        error = own = None
        if self.collective.rank == 0:
            try:
                work()
            except Exception as exc:  # noqa: BLE001 - reported to every rank
                error, own = describe_error(exc), exc
        self.agree(error, failure=failure, what=what, own=own)

    # ------------------------------------------------------------------------------------------------
    def save(self, step: int, metadata: dict[str, Any] | None = None, wait: bool = True, stage: bool = False) -> str:
        """Save every component as checkpoint ``step``; returns its directory on every rank.

        ``wait`` (the default): returns once the checkpoint is committed. ``wait=False``: returns once every rank's
        files are written, or with ``stage`` once the state is copied in memory (the files are then written on the
        background thread too; a native component through its ``stage_native`` where it has one). fsync, digests,
        the manifest, publication, ``latest`` and retention finish on a background thread; the next save or load,
        or :meth:`wait`, waits for them and raises if they failed. Until then ``latest`` names the previous one.
        """
        self.wait()
        if not self.claimed:
            self.claim()
        rank = self.collective.rank
        final = self.path_for(step)
        name = os.path.basename(final)
        staging = final + STAGING_SUFFIX
        what = f"save of {name}"

        # 1. declare, plan, and capture the state each rank needs (to write or to validate)
        error, components, specs, states, prints, native = None, [], [], {}, {}, []
        topology = self.topology()
        try:
            components = components_of(self.provider)
            specs = [c.resolve() for c in components]
            native = [c for c in components if is_native(c.stateful)]
            if sum(native_base(c) == NATIVE_TOP for c in native) > 1:
                raise ComponentError(f"components {[c.key for c in native]} all write at the checkpoint's top level; at most one may")
            plan = plan_save([s for c, s in zip(components, specs) if c not in native], topology)
            writes = {p.component for p in plan.writes_of(rank)}
            for comp, spec in zip(components, specs):
                if comp in native:
                    continue
                if spec.validate_replication or comp.key in writes:
                    states[comp.key] = comp.stateful.state_dict()
                if spec.validate_replication:
                    prints[comp.key] = state_fingerprint(states[comp.key])
            metadata = self._metadata(metadata)  # read from the live trainer here, not on the commit's thread
            if stage:  # later steps change the live tensors: what is written later must be a copy
                states = {k: staged(v) if k in writes else v for k, v in states.items()}
        except Exception as exc:  # noqa: BLE001 - every failure must reach every rank
            error = describe_error(exc)
        gathered = self.agree(error, prints, what=what)
        for spec in specs:
            if spec.validate_replication:
                message = find_mismatches(
                    spec.key, {r: g[spec.key] for r, g in enumerate(gathered)}, _replication_domains(spec, topology)
                )
                if message:
                    raise ReplicationError(message)

        # 2. every rank writes its pieces into the shared staging directory; the engines save (collectively) now,
        # or, staged, into memory, their files written with the pieces by ``write_pieces`` on the background thread
        if rank == 0:
            shutil.rmtree(staging, ignore_errors=True)
            os.makedirs(staging)
        self.collective.barrier()

        def write_pieces() -> tuple[str | None, dict[str, FileRecord]]:
            """This rank's pieces, then the staged engine files, each file made durable. A staged writer may run
            collectives (DCP's over the commit group): every rank runs its writers whatever its pieces did."""
            records: dict[str, FileRecord] = {}
            failed = None
            try:
                for base, state in pieces:
                    records.update(write_piece(staging, base, state, writer=rank))
                for d in {os.path.dirname(os.path.join(staging, rel)) for rel in records}:
                    fsync_path(d)
            except Exception as exc:  # noqa: BLE001
                failed = describe_error(exc)
            for writer in writers:
                try:
                    writer()
                except Exception as exc:  # noqa: BLE001
                    failed = failed or describe_error(exc)
            pieces.clear()  # written: the staged copies go (their memory stays for the next save's: see on_staging_thread)
            writers.clear()
            return failed, records

        if not wait and self._commit_group is None:
            self._commit_group = commit_collective(self.collective)  # collective: every rank saves together
        pieces = [(piece.base, states[piece.component]) for piece in plan.writes_of(rank)]
        writers: list[Callable[[], None]] = []
        # our pieces first: fsyncing a small file after an engine wrote gigabytes makes ext4 write those out first
        # (one journal commit), which put the engine's whole flush back into the blocking part
        written = (None, {}) if stage else write_pieces()
        error = None
        try:
            for comp in native:  # collective: the engine's own save, on every rank (whatever this rank's pieces did)
                target = os.path.normpath(os.path.join(staging, native_base(comp)))
                stage_native = getattr(comp.stateful, "stage_native", None) if stage else None
                if stage_native is not None:  # its writer may use the commit's process group (a staged DCP save)
                    # the engine's whole staged save on the staging thread: host memory it allocates itself (accelerate
                    # FSDP2's cpu_offload state dicts, on a GPU the copy that is written) lies apart from training's too
                    writers.append(on_staging_thread(stage_native, target, getattr(self._commit_group, "group", None)))
                else:
                    if stage:
                        log.info("component %r has no staged save: the engine writes its files before the save returns; "
                                 "the commit runs in the background", comp.key)
                    comp.stateful.save_native(target)
        except Exception as exc:  # noqa: BLE001
            error = describe_error(exc)

        if error is not None and written[0] is None:
            written = (error, written[1])

        def finish(collective: Collective) -> str:
            outcome = written
            if stage:  # every rank staged, or none writes: a writer's collectives need every rank
                try:
                    self.agree(error, what=what, collective=collective)
                except SaveFailedError:
                    pieces.clear()  # nothing is written: the staged copies go now, not with this error's traceback
                    writers.clear()
                    if collective.rank == 0:
                        shutil.rmtree(staging, ignore_errors=True)
                    raise
                outcome = write_pieces()
            self._commit(collective, step, final, staging, specs, topology, plan, outcome, metadata, native, what)
            return final

        if wait:
            return finish(self.collective)
        self._pending = PendingCommit(lambda: finish(self._commit_group), name)
        return final

    def _commit(self, collective: Collective, step, final, staging, specs, topology, plan, written, metadata, native, what) -> None:
        """After the writes: every rank's records gathered, the engines' files digested (a share per rank), and rank 0
        commits: manifest, publish, latest, retention. Every collective on ``collective``."""
        rank = collective.rank
        try:
            all_records = self.agree(*written, what=what, collective=collective)
            if native:
                all_records.extend(self.agree(*self._native_records(staging, native, collective), what=what, collective=collective))
        except SaveFailedError:
            if rank == 0:
                shutil.rmtree(staging, ignore_errors=True)
            raise
        error = None
        if rank == 0:
            try:
                manifest = self._manifest(step, specs, topology, plan, all_records, metadata, {c.key: native_base(c) for c in native})
                fsync_tree(staging)  # every directory's entries (ranks/, components/, the engine's) are durable
                write_manifest(staging, manifest)
                publish(staging, final)
                write_latest(self.root, os.path.basename(final))
                if self.keep_last:
                    prune(self.root, self.keep_last)
            except Exception as exc:  # noqa: BLE001
                error = describe_error(exc)
                shutil.rmtree(staging, ignore_errors=True)
        self.agree(error, what=what, collective=collective)
        log.info("saved %s (%d files)", final, sum(len(r) for r in all_records))

    def running(self) -> bool:
        """Whether a background commit (``save(wait=False)``) is still running on this rank (without waiting)."""
        return self._pending is not None and not self._pending.done()

    def wait(self) -> str | None:
        """Wait for the pending background commit (``save(wait=False)``), raising if it failed; its directory, or
        None when nothing was pending. Every rank calls it together."""
        pending, self._pending = self._pending, None
        if pending is None:
            return None
        return pending.wait()

    def _native_records(self, staging: str, native: list[StateComponent], collective: Collective) -> tuple[str | None, dict[str, FileRecord]]:
        """List what the engines wrote and digest it, each rank a share of the bytes (after every rank wrote)."""
        share = (collective.rank, collective.world_size)
        records: dict[str, FileRecord] = {}
        try:
            for comp in native:
                base = native_base(comp)
                found = tree_records(staging, base, share) if os.path.isdir(os.path.join(staging, base)) else {}
                if not found and share[0] == 0:
                    raise ComponentError(f"native component {comp.key!r} wrote nothing into {os.path.normpath(os.path.join(staging, base))}")
                records.update(found)
        except Exception as exc:  # noqa: BLE001
            return describe_error(exc), records
        return None, records

    def _metadata(self, metadata: dict[str, Any] | None) -> dict[str, Any]:
        """The manifest sections the caller and the provider give (``get_checkpoint_metadata``), read now."""
        meta = dict(metadata or {})
        extra = getattr(self.provider, "get_checkpoint_metadata", None)
        if extra is not None:
            meta = {**(extra() or {}), **meta}
        return meta

    def _manifest(self, step, specs, topology, plan, all_records, meta: dict[str, Any], native: dict[str, str]) -> Manifest:
        meta = dict(meta)
        if self.resume_notes:
            meta["notes"] = list(dict.fromkeys(list(meta.get("notes") or []) + self.resume_notes))
        unknown = set(meta) - set(_METADATA_FIELDS)
        if unknown:
            raise ComponentError(f"checkpoint metadata has unknown sections {sorted(unknown)}; allowed: {_METADATA_FIELDS}")
        files: dict[str, FileRecord] = {}
        for records in all_records:
            files.update(records)
        components = {
            spec.key: ComponentRecord(
                pattern=spec.pattern.value,
                policy=spec.policy.value,
                required=spec.required,
                group=spec.group,
                pieces={"native": native[spec.key]} if spec.key in native else {p.owner: p.base for p in plan.pieces if p.component == spec.key},
                native=spec.key in native,
            )
            for spec in specs
        }
        return Manifest(
            format=CHECKPOINT_FORMAT,
            topology=topology.to_json(),
            committed_at=now_iso(),
            producer=producer_versions(),
            step=step,
            components=components,
            files=dict(sorted(files.items())),
            **meta,
        )

    # ------------------------------------------------------------------------------------------------
    def load(self, path: str | None = None, verify: bool = True, shown_as: str | None = None) -> LoadResult:
        """Load the checkpoint at ``path`` (or ``root``'s ``latest``) into the provider's components.

        First, on every rank together, the checkpoint is checked against its manifest: nothing on disk it does
        not list, every file's size, and (``verify``, the default) every file's digest, the ranks hashing a
        share each. Only when every rank found it intact does any state (or an engine) read a byte of it.
        ``verify=False`` checks sizes only; the run's later manifests say so.
        """
        self.wait()  # a checkpoint still being committed is not loaded half-done (nor is latest read before it)
        rank = self.collective.rank
        topology = self.topology()
        error, own_exc, directory, manifest = None, None, None, None
        try:
            directory = resolve_checkpoint_dir(os.path.abspath(path or self.root))
            manifest = read_manifest(directory)
            check_against_manifest(directory, manifest, verify, share=(rank, self.collective.world_size))
            accepts = getattr(self.provider, "check_checkpoint", None)  # the trainer's own say (the model it built)
            if accepts is not None:
                accepts(directory, manifest, shown_as or directory)
        except Exception as exc:  # noqa: BLE001
            error, own_exc = describe_error(exc), exc
        self.agree(error, failure=LoadFailedError, what="load", own=own_exc)
        assert directory is not None and manifest is not None

        error, notes, result, scratch = None, [], None, None
        try:
            saved = Topology.from_json(manifest.topology)
            scratch = self._scratch(directory)
            for comp in components_of(self.provider, for_load=True):
                note = self._load_component(directory, manifest, comp, saved, topology, rank, scratch)
                if note:
                    notes.append(note)
            result = LoadResult(directory, manifest, notes)
            step = f" at step {manifest.step}" if manifest.step is not None else ""
            unverified = [] if verify else ["loaded without checking file digests (--no-verify): only sizes were checked"]
            origin = shown_as or directory  # a converted copy in scratch space is named by what it was converted from
            self.resume_notes = list(manifest.notes) + [f"resumed from {origin}{step}: {n}" for n in unverified + notes]
        except Exception as exc:  # noqa: BLE001
            error, own_exc = describe_error(exc), exc

        try:
            self.agree(error, failure=LoadFailedError, what="load", own=own_exc)  # every rank is done with the scratch space
        finally:
            if rank == 0 and scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
        for note in notes:
            log.warning("%s", note)
        return result  # type: ignore[return-value]

    def _scratch(self, directory: str) -> str:
        """Where a native load may write a converted copy: beside the checkpoints, removed after the load."""
        return os.path.join(self.root, f".{os.path.basename(directory)}.load")

    def _load_component(self, directory, manifest, comp: StateComponent, saved, current, rank, scratch) -> str | None:
        record = manifest.components.get(comp.key)
        if record is None and comp.required and not manifest.step and not is_native(comp.stateful):
            # a checkpoint at step 0 (weights converted from a model, no training yet): what it lacks starts fresh
            return f"component {comp.key!r} is not in {directory} (a checkpoint before any training step); it starts fresh"
        if record is None:
            if comp.required:
                raise ComponentError(
                    f"{directory}: checkpoint has no component {comp.key!r} (it has {sorted(manifest.components)})"
                )
            log.info("component %r not in %s; not required, skipped", comp.key, directory)
            return None
        policy = comp.on_world_size_change or WorldSizePolicy(record.policy)
        if record.native:
            return self._load_native(directory, manifest, comp, record, policy, saved, current, rank, scratch)
        if is_native(comp.stateful):
            raise ComponentError(f"{directory}: component {comp.key!r} was not saved by the engine itself; load it with the trainer that wrote it")
        spec = ComponentSpec(comp.key, SharingPattern(record.pattern), record.group, policy, record.required)
        action = resolve_load(spec, saved, current, rank)
        missing = [f"{b}.json" for b in action.bases if f"{b}.json" not in manifest.files]
        if missing:
            raise CorruptCheckpointError(os.path.join(directory, missing[0]), f"piece of component {comp.key!r} is not in the manifest")
        stateful = comp.stateful
        if action.kind == "load":
            stateful.load_state_dict(read_piece(directory, action.bases[0]))
        elif action.kind == "reshard":
            reshard = getattr(stateful, "load_resharded", None)
            if reshard is None:
                raise ComponentError(f"component {comp.key!r} has policy 'reshard' but its stateful has no load_resharded()")
            reshard([read_piece(directory, b) for b in action.bases], saved.world_size, current.world_size)
        elif action.kind == "reseed":
            reseed = getattr(stateful, "reseed", None)
            if reseed is None:
                raise ComponentError(f"component {comp.key!r} has policy 'reseed' but its stateful has no reseed()")
            import hashlib

            seed = int.from_bytes(hashlib.sha256(f"{manifest.step}:{rank}".encode()).digest()[:7], "little")
            reseed(seed)
        return action.note or None

    def _load_native(self, directory, manifest, comp, record, policy, saved, current, rank, scratch) -> str | None:
        if not is_native(comp.stateful):
            raise ComponentError(
                f"{directory}: component {comp.key!r} holds the engine's own files; this trainer's stateful has no load_native()"
            )
        if not component_files(record, manifest.files):
            raise CorruptCheckpointError(directory, f"native component {comp.key!r} lists no files")
        note = None
        # the engine's files are for the layout the sharding section names (a conversion writes them for its
        # target), which may differ from the topology the carried per-rank pieces came from
        written_for = int((manifest.sharding or {}).get("world_size") or saved.world_size)
        if written_for != current.world_size and not (manifest.sharding or {}).get("any_world_size"):
            if policy is WorldSizePolicy.REFUSE:
                raise TopologyError(
                    f"{directory}: component {comp.key!r} was saved by {written_for} ranks and its policy is 'refuse'; "
                    f"this run has {current.world_size}. Convert it first: interop convert {directory} --to <format> --world-size {current.world_size}"
                )
            if policy is WorldSizePolicy.DROP:
                return f"component {comp.key!r}: saved by {written_for} ranks, now {current.world_size}; not loaded (policy 'drop')"
            note = f"component {comp.key!r}: saved by {written_for} ranks, loaded onto {current.world_size} (policy '{policy.value}')"
        where = os.path.normpath(os.path.join(directory, record.native_base))
        comp.stateful.load_native(NativeLoad(where, saved, current, rank, manifest, scratch))
        return note
