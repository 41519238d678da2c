"""Checks of a committed checkpoint against its manifest: what is on disk is exactly what the manifest lists
(no extra files, no links), every size and digest matches, tensors are the manifest's (none missing, extra or
renamed, each with its shape, dtype and digest), and every index names what its shards hold.

``open_checkpoint`` is what every reader calls before it uses a byte; ``verify_checkpoint`` is ``interop
verify``: every problem, one line each.
"""

from __future__ import annotations

import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from . import digests
from .written_digests import WrittenDigests
from .errors import CheckpointError, CorruptCheckpointError, MissingFileError
from .logical import stored_name
from .manifest import MANIFEST, NATIVE_TOP, FileRecord, Manifest, read_manifest
from .paths import describe_entry, inside, tree_entries
from .pieces import component_files, is_native_top_file
from .ranged import defer, forget
from .safetensors_io import SafetensorsFile, composite_digest, safetensors_digests

HASH_THREADS = 4  # hashing and reading release the GIL: files are digested side by side


def digest_as(path: str, recorded: str | None, block_bytes: int | None = None) -> str:
    """The file's digest by the algorithm (and, for safetensors, the composite form; for a large file, the blocks
    of ``block_bytes``) the manifest recorded."""
    algo, kind = digests.parse(recorded, path) if recorded else (digests.ALGO, digests.PLAIN)
    if kind == digests.COMPOSITE:
        try:
            return safetensors_digests(path, algo)[0]
        except CorruptCheckpointError:
            return ""  # unreadable: it cannot match
    if kind == digests.BLOCKS:
        try:
            return digests.of_files([path], algo, blocked=True, block_bytes=block_bytes)[path].digest
        except CorruptCheckpointError:
            return ""  # changed while it was read: it cannot match
    return digests.of_file(path, algo)


def tree_records(root: str, subdir: str, share: tuple[int, int] = (0, 1), ahead: WrittenDigests | None = None) -> dict[str, FileRecord]:
    """FileRecords (size, digest) of every file under ``root/subdir``, keyed relative to ``root``; each made
    durable. ``share=(rank, world)`` takes this rank's share of the bytes, so ranks digest a tree between them.
    ``subdir`` ``NATIVE_TOP`` is an engine's files at the top level: everything outside our own folders.
    ``ahead``: digests taken as the files were finished (:mod:`interop.written_digests`), used where still current."""
    from .commit import fsync_paths

    top = os.path.join(root, subdir)
    rels = sorted(os.path.relpath(os.path.join(dirpath, n), root) for dirpath, _, names in os.walk(top) for n in names)
    if subdir == NATIVE_TOP:
        rels = [r for r in rels if is_native_top_file(r) and r != MANIFEST]
    rank, world = share
    mine = balanced_share(rels, [os.path.getsize(os.path.join(root, r)) for r in rels], world)[rank]
    fsync_paths(os.path.join(root, rel) for rel in mine)
    taken = {rel: ahead.digest(os.path.join(root, rel)) for rel in mine} if ahead is not None else {}
    hashed = digests.of_files([os.path.join(root, rel) for rel in mine if taken.get(rel) is None])
    hashed.update({os.path.join(root, rel): d for rel, d in taken.items() if d is not None})
    records = {}
    for rel in mine:
        found = hashed[os.path.join(root, rel)]
        records[rel] = FileRecord(os.path.getsize(os.path.join(root, rel)), found.digest, blocks=found.blocks,
                                  block_bytes=found.block_bytes)
    fsync_paths({os.path.dirname(os.path.join(root, rel)) for rel in rels} | {top})
    return records


def balanced_share(names: list[str], sizes: list[int], world: int) -> list[list[str]]:
    """``names`` split over ``world`` ranks with their byte totals near equal (largest first, each to the least
    loaded rank; ties by position, so every rank computes the same split). Taking every world-th name instead
    gave one rank of a 2-rank ZeRO run both optimizer files: 3 GB to digest while the other waited."""
    loads = [0] * world
    out: list[list[str]] = [[] for _ in range(world)]
    for i in sorted(range(len(names)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        loads[r] += sizes[i]
        out[r].append(names[i])
    return out


def checked_path(directory: str, rel: str, record: FileRecord) -> str:
    """The path of listed file ``rel``, after checking it stays inside the checkpoint, is a regular file
    (not a link) and has the recorded size."""
    path = inside(directory, rel, os.path.join(directory, MANIFEST))
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise MissingFileError(path, "listed in the manifest but missing") from None
    problem = describe_entry(directory, rel, st)
    if problem:
        raise CorruptCheckpointError(path, problem)
    if st.st_size != record.bytes:
        raise CorruptCheckpointError(path, f"size {st.st_size} bytes, manifest says {record.bytes} (truncated or replaced)")
    return path


def check_files(directory: str, manifest: Manifest, rels: Iterable[str], digest: bool = False) -> None:
    """Check each listed file (digests side by side on threads); raise on the first problem, in ``rels`` order."""
    rels = list(rels)
    for rel in rels:
        if rel not in manifest.files:
            raise CorruptCheckpointError(os.path.join(directory, rel), "not listed in the manifest")
        checked_path(directory, rel, manifest.files[rel])
    if digest:
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            for rel, error in zip(rels, pool.map(lambda r: _digest_problem(directory, r, manifest.files[r]), rels)):
                if error:
                    raise error


def _digest_problem(directory: str, rel: str, record: FileRecord) -> CheckpointError | None:
    path = os.path.join(directory, rel)
    if digest_as(path, record.digest, record.block_bytes) != record.digest:
        return CorruptCheckpointError(path, "content digest differs from the manifest (the file was altered or corrupted)")
    return None


def unlisted(directory: str, manifest: Manifest) -> list[CheckpointError]:
    """What lies in the checkpoint directory that the manifest does not list: extra files, links, devices."""
    holding: set[str] = set()  # every directory a listed file lies in, at any depth
    for rel in manifest.files:
        d = os.path.dirname(rel)
        while d and d not in holding:
            holding.add(d)
            d = os.path.dirname(d)
    problems: list[CheckpointError] = []
    for rel, st in tree_entries(directory):
        path = os.path.join(directory, rel)
        why = describe_entry(directory, rel, st)
        if why:
            problems.append(CorruptCheckpointError(path, why))
        elif stat.S_ISDIR(st.st_mode):
            if rel not in holding:
                problems.append(CorruptCheckpointError(path, "is a directory the manifest does not list"))
        elif rel not in manifest.files and rel != MANIFEST:
            problems.append(CorruptCheckpointError(path, "is not listed in the manifest (an extra file; a reader or engine could pick it up)"))
    return problems


def check_against_manifest(directory: str, manifest: Manifest, digests_checked: bool = True,
                           skip_digests: Iterable[str] = (), share: tuple[int, int] = (0, 1),
                           ranged: Callable[[str], bool] | None = None) -> None:
    """Raise on the first thing at ``directory`` that is not as ``manifest`` says: something on disk it does not
    list, a listed file missing, a link or of another size, and (``digests_checked``) a digest that differs.
    ``share=(rank, world)`` digests this rank's share of the bytes (:func:`balanced_share`), so ranks check a checkpoint between them.
    ``ranged``: which files (by listed name) a reader will read only through ranges it checks
    (:mod:`interop.ranged`); those recorded block by block are registered there rather than hashed whole here."""
    extra = unlisted(directory, manifest)
    if extra:
        raise extra[0]
    check_files(directory, manifest, manifest.files)
    if digests_checked:
        skip = set(skip_digests)
        for rel, record in manifest.files.items():
            if rel in skip or record.blocks is None:
                continue
            if ranged is not None and ranged(rel):
                defer(os.path.join(directory, rel), record)
                skip.add(rel)
            else:
                forget(os.path.join(directory, rel))  # hashed whole below: an earlier registration is stale
        rank, world = share
        names = [r for r in sorted(manifest.files) if r not in skip]
        check_files(directory, manifest, balanced_share(names, [manifest.files[r].bytes for r in names], world)[rank], digest=True)
    for problem in index_problems(directory, manifest):
        raise problem


def open_checkpoint(directory: str, digests_checked: bool = True, by_tensor: bool = True,
                    ranged: Callable[[str], bool] | None = None) -> Manifest:
    """The manifest of the committed checkpoint at ``directory``, once everything a reader may use has been
    checked against it (``check_against_manifest``). With ``by_tensor``, files holding the manifest's tensors
    are checked here by their headers (the tensors, shapes and dtypes the manifest lists) and their bytes are
    the reader's to check tensor by tensor as it loads them (``LazyTensor.digest``), so no byte is read twice;
    without, they are hashed whole like every other file (for a reader that does not know the manifest's
    tensors). ``ranged``: see :func:`check_against_manifest`."""
    manifest = read_manifest(directory)
    by_tensor_files = set(tensors_by_file(manifest)) if by_tensor else set()
    check_against_manifest(directory, manifest, digests_checked, skip_digests=by_tensor_files, ranged=ranged)
    for problem in tensor_problems(directory, manifest, by_tensor_files, hashed=False):
        raise problem
    return manifest


def tensors_by_file(manifest: Manifest) -> dict[str, dict[str, str]]:
    """file -> {name stored in it: logical key} for the manifest's tensors."""
    out: dict[str, dict[str, str]] = {}
    for key, rec in manifest.tensors.items():
        out.setdefault(rec.file, {})[stored_name(key)] = key
    return out


def tensor_problems(directory: str, manifest: Manifest, files: Iterable[str], hashed: bool) -> list[CheckpointError]:
    """For each safetensors file in ``files`` that holds manifest tensors: its header holds exactly those tensors
    with their shapes and dtypes, and (``hashed``) the file digest and every tensor's digest match."""
    expected_by_file = tensors_by_file(manifest)
    rels = [rel for rel in sorted(set(files)) if rel in expected_by_file]
    with ThreadPoolExecutor(HASH_THREADS) as pool:
        found = pool.map(lambda rel: _tensor_file_problems(directory, rel, manifest, expected_by_file[rel], hashed), rels)
        return [p for problems in found for p in problems]


def _tensor_file_problems(directory: str, rel: str, manifest: Manifest, expected: dict[str, str], hashed: bool) -> list[CheckpointError]:
    path = os.path.join(directory, rel)
    problems: list[CheckpointError] = []
    try:
        st = SafetensorsFile(path)
        found = set(st.keys())
        for name in sorted(found - set(expected)):
            problems.append(CorruptCheckpointError(path, f"holds tensor {name!r}, which the manifest does not list in this file"))
        for name in sorted(set(expected) - found):
            problems.append(CorruptCheckpointError(path, f"lacks tensor {name!r} that the manifest lists (missing or renamed)"))
        for name in sorted(found & set(expected)):
            rec, spec = manifest.tensors[expected[name]], st.spec(name)
            if list(spec.shape) != rec.shape or spec.dtype_name != rec.dtype:
                problems.append(CorruptCheckpointError(path, f"tensor {name!r} is {spec.describe()}, the manifest says {rec.dtype}{rec.shape}"))
        recorded = manifest.files[rel].digest
        algo = digests.parse(recorded, path)[0]
        if hashed:
            file_digest_, tensor_digests = safetensors_digests(path, algo)
            for name in sorted(found & set(expected)):
                want = manifest.tensors[expected[name]].digest
                if want is not None and tensor_digests[name] != want:  # one writer hashed both: one algorithm
                    problems.append(CorruptCheckpointError(path, f"tensor {name!r} differs from the digest the manifest records for it"))
        elif not problems:  # the header's every byte, from the recorded tensor digests: no tensor read twice
            recorded_tensors = {name: manifest.tensors[expected[name]].digest or "" for name in found}
            usable = all(d.startswith(algo + ":") for d in recorded_tensors.values())
            file_digest_ = composite_digest(st, recorded_tensors, algo) if usable else safetensors_digests(path, algo)[0]
        else:
            file_digest_ = recorded
        if file_digest_ != recorded:
            problems.append(CorruptCheckpointError(path, "content digest differs from the manifest (the file was altered or corrupted)"))
    except CheckpointError as exc:
        problems.append(exc)
    return problems


def index_problems(directory: str, manifest: Manifest, rels: Iterable[str] | None = None) -> list[CheckpointError]:
    """Every weight index (``*.index.json``) among ``rels`` (default: every listed file) names only listed
    files inside the checkpoint, and a safetensors index exactly the tensors its shards hold: an engine that
    loads through the index (transformers does) reads what the manifest vouches for, nothing else."""
    from .jsonio import read_json
    from .safetensors_io import read_index

    problems: list[CheckpointError] = []
    for rel in manifest.files if rels is None else rels:
        if not rel.endswith(".index.json"):
            continue
        path, folder = os.path.join(directory, rel), os.path.join(directory, os.path.dirname(rel))
        try:
            if rel.endswith(".safetensors.index.json"):
                read_index(path, folder, listed=manifest.files, root=directory)
                continue
            weight_map = read_json(path, "weight index").get("weight_map")
            for fname in set(weight_map.values()) if isinstance(weight_map, dict) else [None]:
                if os.path.relpath(inside(folder, fname, path), directory) not in manifest.files:
                    raise CorruptCheckpointError(path, f"names {fname!r}, which the manifest does not list")
        except CheckpointError as exc:
            problems.append(exc)
    return problems


def verify_checkpoint(directory: str, digests: bool = True, progress: Callable | None = None) -> tuple[Manifest | None, list[str]]:
    """Every problem found, one line each; an empty list means the checkpoint is complete and intact."""
    try:
        manifest = read_manifest(directory)
    except CheckpointError as exc:
        return None, [str(exc)]
    problems: list[CheckpointError] = unlisted(directory, manifest)
    tensor_files = set(tensors_by_file(manifest))
    items = list(manifest.files.items())
    present = []
    for rel, record in progress(items, desc="verify", unit="file") if progress else items:
        try:
            checked_path(directory, rel, record)
            if rel.endswith(".safetensors"):
                SafetensorsFile(os.path.join(directory, rel))
            present.append(rel)
        except CheckpointError as exc:
            problems.append(exc)
    if digests:
        with ThreadPoolExecutor(HASH_THREADS) as pool:
            plain = [r for r in present if r not in tensor_files]
            problems += [p for p in pool.map(lambda r: _digest_problem(directory, r, manifest.files[r]), plain) if p]
    problems += tensor_problems(directory, manifest, [r for r in present if r in tensor_files], hashed=digests)
    problems += index_problems(directory, manifest, present)
    for name, tensor in manifest.tensors.items():
        if tensor.file not in manifest.files:
            problems.append(CorruptCheckpointError(os.path.join(directory, tensor.file), f"holds tensor {name!r} but is not listed in the manifest"))
    for key, comp in manifest.components.items():
        if comp.native:
            if not component_files(comp, manifest.files):
                problems.append(CorruptCheckpointError(directory, f"native component {key!r} has no files listed in the manifest"))
            continue
        for base in comp.pieces.values():
            if base + ".json" not in manifest.files:
                problems.append(CorruptCheckpointError(os.path.join(directory, base) + ".json", f"piece of component {key!r} not listed in the manifest"))
    named = ((manifest.model or {}).get("config"), ((manifest.model or {}).get("adapter") or {}).get("config"),
             (manifest.optimizer or {}).get("groups"))
    for key in named:
        if isinstance(key, str) and key not in manifest.files:
            problems.append(CorruptCheckpointError(os.path.join(directory, key), "named by the manifest but not listed in its files"))
    return manifest, list(dict.fromkeys(str(p) for p in problems))


def enclosing_checkpoint(path: str, levels: int = 3) -> str | None:
    """The committed checkpoint (a directory with a manifest) that ``path`` lies strictly inside, if any: a
    reader pointed at a part of one (``ckpt/model`` as a Hugging Face directory, ``ckpt/deepspeed``) must
    still have that checkpoint's files checked against its manifest."""
    current = os.path.realpath(path)
    for _ in range(levels):
        parent = os.path.dirname(current)
        if parent == current:
            return None
        if os.path.isfile(os.path.join(parent, MANIFEST)):
            return parent
        current = parent
    return None
