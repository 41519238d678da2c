"""The universal checkpoint, format v1: safetensors + JSON, no pickle, streamed tensor by tensor.

    ckpt/
      model/                    a Hugging Face model directory (config.json, model*.safetensors [+ index])
      optimizer/<key>*.safetensors [+ <key>.safetensors.index.json]   one state key each, canonical names
      optimizer/state.json      optimizer class, param groups (names), 0-dim per-param state (step)
      components/ ranks/ groups/ nodes/   the other components, as the trainer saved them
      manifest.json             written last; every file with size and digest, every tensor with digest
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from . import codec
from .commit import durable_write, fsync_path, staged_output, write_manifest
from .dtypes import dtype_from_name, dtype_name
from .errors import ConversionError, CorruptCheckpointError, MissingFileError
from .logical import ComponentSource, LogicalCheckpoint, OptimizerState, optim_key
from .manifest import UNIVERSAL_FORMAT, ComponentRecord, FileRecord, Manifest, TensorRecord, now_iso, producer_versions, read_manifest
from .pieces import write_piece
from .planner import pieces_for
from .safetensors_io import SafetensorsFile, TensorEntry, write_safetensors
from .tensors import LazyTensor, tensor_digest
from .state import ComponentSpec, SharingPattern, WorldSizePolicy
from .topology import Topology
from .verify import check_files, digest_as

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3  # Hugging Face's default
STATE_JSON = "optimizer/state.json"


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    for suffix, mult in (("GIB", 1024**3), ("MIB", 1024**2), ("KIB", 1024), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(suffix):
            return int(float(s[: -len(suffix)]) * mult)
    return int(s)


@dataclass
class WriteResult:
    files: dict[str, FileRecord] = field(default_factory=dict)  # relative to the checkpoint root
    tensors: dict[str, TensorRecord] = field(default_factory=dict)  # logical key -> record


def shard_groups(entries: list[TensorEntry], max_shard_size: int) -> list[list[TensorEntry]]:
    """Greedy, order-preserving split into shards of at most ``max_shard_size`` bytes (a larger tensor alone)."""
    shards: list[list[TensorEntry]] = [[]]
    size = 0
    for entry in entries:
        if shards[-1] and size + entry.spec.nbytes > max_shard_size:
            shards.append([])
            size = 0
        shards[-1].append(entry)
        size += entry.spec.nbytes
    return shards if shards[0] else []


def write_sharded(
    root: str,
    subdir: str,
    stem: str,
    tensors: dict[str, LazyTensor],
    max_shard_size: int,
    key_of: Callable[[str], str] = lambda name: name,
    progress: Callable[[TensorEntry], None] | None = None,
    digests: bool = True,
) -> WriteResult:
    """``<stem>.safetensors`` or ``<stem>-0000i-of-0000n.safetensors`` + ``<stem>.safetensors.index.json``.

    Without ``digests`` (an export no manifest will describe) nothing is hashed, unless a source tensor has
    a known digest: then it is checked, so a corrupted universal checkpoint is not exported silently."""
    digests = digests or any(t.digest is not None for t in tensors.values())
    entries = [TensorEntry(name, t.spec, t.load, t.mapped_pieces) for name, t in tensors.items()]
    shards = shard_groups(entries, max_shard_size)
    result = WriteResult()
    os.makedirs(os.path.join(root, subdir), exist_ok=True)
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        rel = f"{subdir}/{fname}" if subdir else fname
        written = write_safetensors(os.path.join(root, rel), shard, {"format": "pt"}, progress, digests)
        result.files[rel] = FileRecord(written.nbytes, written.digest)
        for entry in shard:
            expected = tensors[entry.name].digest
            if expected is not None and expected != written.tensor_digests[entry.name]:
                raise CorruptCheckpointError(
                    tensors[entry.name].origin, "tensor bytes differ from the digest in the source manifest (corrupted)"
                )
            weight_map[entry.name] = fname
            result.tensors[key_of(entry.name)] = TensorRecord(
                list(entry.spec.shape), dtype_name(entry.spec.dtype), rel, written.tensor_digests.get(entry.name)
            )
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.spec.nbytes for e in entries)}, "weight_map": weight_map}
        rel = f"{subdir}/{stem}.safetensors.index.json" if subdir else f"{stem}.safetensors.index.json"
        result.files[rel] = _write_json(root, rel, index)
    return result


def _write_json(root: str, rel: str, data: Any) -> FileRecord:
    path = os.path.join(root, rel)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    return durable_write(path, json.dumps(data, indent=2, allow_nan=False).encode())


def model_entries(ckpt: LogicalCheckpoint) -> dict[str, LazyTensor]:
    """The model tensors to write: tied targets are left out (as save_pretrained does) once shown equal."""
    model = dict(ckpt.model)
    for group in ckpt.tied:
        target, *sources = group
        source = next((s for s in sources if s in model), None)
        if target in model and source is not None:
            if tensor_digest(model[target].load()) != tensor_digest(model[source].load()):
                raise ConversionError(
                    f"{target} and {source} are declared tied but hold different values; "
                    "untie them in config.json (tie_word_embeddings=false) to keep both"
                )
            del model[target]
    return model


def write_model_dir(
    root: str, subdir: str, ckpt: LogicalCheckpoint, max_shard_size: int, progress=None, digests: bool = True
) -> WriteResult:
    """A Hugging Face model directory: config.json and (sharded) model.safetensors."""
    result = write_sharded(root, subdir, "model", model_entries(ckpt), max_shard_size, progress=progress, digests=digests)
    if ckpt.config is not None:
        rel = f"{subdir}/config.json" if subdir else "config.json"
        result.files[rel] = _write_json(root, rel, ckpt.config)
    return result


def _optimizer_json(opt: OptimizerState) -> dict[str, Any]:
    skeleton, tensors = codec.encode(opt.param_groups)
    if tensors:
        raise ConversionError(f"optimizer param groups hold tensors ({sorted(tensors)[:3]}); only scalars are supported")
    return {"class": opt.cls, "state_keys": opt.state_keys, "param_groups": skeleton, "scalars": opt.scalars}


def copy_components(ckpt: LogicalCheckpoint, out: str, files: dict[str, FileRecord]) -> dict[str, ComponentRecord]:
    """Carry the non-model components into ``out`` (digest-checked copies) plus the reader's in-memory state."""
    components = {}
    for key, comp in ckpt.components.items():
        for rel, src, rec in comp.paths():
            dst_path = os.path.join(out, rel)
            os.makedirs(os.path.dirname(dst_path), exist_ok=True)
            shutil.copyfile(src, dst_path)
            files[rel] = FileRecord(rec.bytes, digest_as(dst_path, rec.digest), rec.writer)
            if files[rel].digest != rec.digest:
                raise CorruptCheckpointError(src, "content digest differs from its manifest")
        components[key] = comp.record
    for key, state in ckpt.extra_state.items():
        if key in components:
            raise ConversionError(f"component {key!r} comes both from files and from the reader's in-memory state")
        base = f"components/{key}"
        files.update(write_piece(out, base, state))
        components[key] = ComponentRecord(pattern="GLOBAL", policy="keep", pieces={"global": base})
    for key, states in ckpt.rank_state.items():
        if key in components:
            raise ConversionError(f"component {key!r} comes both from files and from the reader's in-memory state")
        spec = ComponentSpec(key, SharingPattern.PER_RANK, None, WorldSizePolicy.RESEED, True)
        pieces = pieces_for(spec, Topology.uniform(len(states)))
        for piece, state in zip(pieces, states):
            files.update(write_piece(out, piece.base, state, writer=piece.writer))
        components[key] = ComponentRecord(pattern=spec.pattern.value, policy=spec.policy.value, pieces={p.owner: p.base for p in pieces})
    return components


def write_universal(
    ckpt: LogicalCheckpoint,
    dst: str,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: Callable[[TensorEntry], None] | None = None,
) -> Manifest:
    """Write ``ckpt`` as a universal checkpoint at ``dst``, built in staging and moved into place whole."""
    with staged_output(dst, overwrite) as out:
        result = write_model_dir(out, "model", ckpt, max_shard_size, progress)
        optimizer_section = None
        if ckpt.optimizer is not None:
            opt = ckpt.optimizer
            for key in sorted(opt.tensors):
                part = write_sharded(
                    out, "optimizer", key, opt.tensors[key], max_shard_size, lambda n, k=key: optim_key(k, n), progress
                )
                result.files.update(part.files)
                result.tensors.update(part.tensors)
            result.files[STATE_JSON] = _write_json(out, STATE_JSON, _optimizer_json(opt))
            optimizer_section = {"class": opt.cls, "state_keys": opt.state_keys, "groups": STATE_JSON}
        components = copy_components(ckpt, out, result.files)
        for d in {os.path.dirname(os.path.join(out, rel)) for rel in result.files}:
            fsync_path(d)
        manifest = Manifest(
            format=UNIVERSAL_FORMAT,
            topology=ckpt.topology or Topology.uniform(1).to_json(),
            committed_at=now_iso(),
            producer=producer_versions(),
            step=ckpt.step,
            source=ckpt.source,
            model={
                "family": (ckpt.config or {}).get("model_type"),
                "config": "model/config.json" if ckpt.config is not None else None,
                "tied": ckpt.tied,
                "frozen": ckpt.frozen,
            },
            optimizer=optimizer_section,
            tensors=result.tensors,
            components=components,
            files=dict(sorted(result.files.items())),
            notes=list(ckpt.notes),
        )
        write_manifest(out, manifest)
    log.info("wrote universal checkpoint %s (%d tensors, %d files)", dst, len(result.tensors), len(result.files))
    return manifest


# ---------------------------------------------------------------------------------------------------


def read_hf_safetensors(directory: str, stem: str = "model") -> dict[str, LazyTensor] | None:
    """Lazy tensors of ``<stem>.safetensors`` or its sharded index in ``directory``; None if neither exists."""
    single = os.path.join(directory, f"{stem}.safetensors")
    index_path = os.path.join(directory, f"{stem}.safetensors.index.json")
    if os.path.isfile(index_path):
        try:
            with open(index_path, encoding="utf-8") as f:
                weight_map: dict[str, str] = json.load(f)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError, UnicodeDecodeError) as exc:
            raise CorruptCheckpointError(index_path, f"not a valid safetensors index: {exc}") from None
        files: dict[str, SafetensorsFile] = {}
        tensors: dict[str, LazyTensor] = {}
        for name, fname in weight_map.items():
            if fname not in files:
                path = os.path.join(directory, fname)
                if not os.path.isfile(path):
                    raise MissingFileError(path, f"named by {os.path.basename(index_path)} but missing")
                files[fname] = SafetensorsFile(path)
            if name not in files[fname]:
                raise CorruptCheckpointError(files[fname].path, f"index says it holds {name!r}, it does not")
            tensors[name] = files[fname].lazy(name)
        return tensors
    if os.path.isfile(single):
        st = SafetensorsFile(single)
        return {name: st.lazy(name) for name in st.keys()}
    return None


def read_universal(directory: str, verify_digests: bool = False) -> LogicalCheckpoint:
    manifest = read_manifest(directory)
    if manifest.format != UNIVERSAL_FORMAT:
        raise CorruptCheckpointError(directory, f"is a {manifest.format} checkpoint, not {UNIVERSAL_FORMAT}")
    check_files(directory, manifest, manifest.files, digest=verify_digests)
    model = read_hf_safetensors(os.path.join(directory, "model")) or {}
    for name, t in model.items():
        t.digest = manifest.tensors[name].digest if name in manifest.tensors else None
    config = None
    if manifest.model and manifest.model.get("config"):
        with open(os.path.join(directory, manifest.model["config"]), encoding="utf-8") as f:
            config = json.load(f)
    optimizer = None
    if manifest.optimizer:
        with open(os.path.join(directory, STATE_JSON), encoding="utf-8") as f:
            state = json.load(f)
        tensors = {}
        for key in state["state_keys"]:
            found = read_hf_safetensors(os.path.join(directory, "optimizer"), key)
            if found is not None:
                for name, t in found.items():
                    record = manifest.tensors.get(optim_key(key, name))
                    t.digest = record.digest if record else None
                tensors[key] = found
        optimizer = OptimizerState(state["class"], codec.decode(state["param_groups"], _no_tensor), tensors, state["scalars"])
    components = {key: ComponentSource.from_manifest(directory, manifest, key) for key in manifest.components}
    model_meta = manifest.model or {}
    return LogicalCheckpoint(
        model=model,
        config=config,
        optimizer=optimizer,
        components=components,
        source=dict(manifest.source),
        topology=manifest.topology,
        tied=model_meta.get("tied", []),
        frozen=model_meta.get("frozen", []),
        step=manifest.step,
        notes=list(manifest.notes),
    )


def _no_tensor(name: str) -> Any:
    raise CorruptCheckpointError(STATE_JSON, f"unexpected tensor reference {name!r}")


def scalar_value(entry: dict[str, Any]) -> torch.Tensor:
    """A 0-dim optimizer state value as stored in state.json."""
    return torch.tensor(entry["value"], dtype=dtype_from_name(entry["dtype"]))


def scalar_entry(t: torch.Tensor) -> dict[str, Any]:
    return {"value": t.item(), "dtype": dtype_name(t.dtype)}


def split_optimizer_state(
    per_name: dict[str, dict[str, Any]], where: str
) -> tuple[dict[str, dict[str, LazyTensor]], dict[str, dict[str, dict[str, Any]]]]:
    """A name-keyed optimizer state (``{name: {key: value}}``) as OptimizerState's ``tensors`` (state key ->
    name -> tensor) and ``scalars`` (0-dim values and numbers: AdamW's step). Values may be lazy or loaded."""
    tensors: dict[str, dict[str, LazyTensor]] = {}
    scalars: dict[str, dict[str, dict[str, Any]]] = {}
    for name, entries in per_name.items():
        for key, value in entries.items():
            if isinstance(value, torch.Tensor):
                value = LazyTensor.of(value, f"{where}[{name}.{key}]")
            if isinstance(value, LazyTensor) and len(value.spec.shape) > 0:
                tensors.setdefault(key, {})[name] = value
            elif isinstance(value, LazyTensor):
                scalars.setdefault(key, {})[name] = scalar_entry(value.load())
            elif isinstance(value, (int, float)):
                scalars.setdefault(key, {})[name] = scalar_entry(torch.tensor(value))
            else:
                raise ConversionError(f"{where}: optimizer state {key!r} of {name!r} is a {type(value).__name__}")
    return tensors, scalars
