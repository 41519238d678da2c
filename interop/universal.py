"""The universal checkpoint, format v1: safetensors + JSON, no pickle, streamed tensor by tensor.

    ckpt/
      model/                    a Hugging Face model directory (config.json, model*.safetensors [+ index])
      optimizer/<key>*.safetensors [+ <key>.safetensors.index.json]   one state key each, canonical names
      optimizer/state.json      optimizer class, param groups (names), 0-dim per-param state (step)
      adapter/                  a peft adapter directory (adapter_config.json, adapter_model.safetensors), when the
                                model was trained with adapters: model/ then holds the frozen base model
      components/ ranks/ groups/ nodes/   the other components, as the trainer saved them
      manifest.json             written last; every file with size and digest, every tensor with digest
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from .lazy_import import instance_of, torch

from . import codec
from .commit import durable_write, fsync_path, write_manifest
from .dtypes import dtype_from_name, dtype_name, is_dtype_name, is_floating, itemsize
from .errors import ConversionError, CorruptCheckpointError
from .logical import AdapterState, ComponentSource, DeferredScalars, LogicalCheckpoint, OptimizerState, optim_key
from .manifest import UNIVERSAL_FORMAT, ComponentRecord, FileRecord, Manifest, TensorRecord, now_iso, producer_versions
from .pieces import write_piece
from .planner import pieces_for
from . import digests
from .jsonio import read_json
from .paths import inside, plain_name
from .safetensors_io import TensorEntry, WrittenFile, read_hf_safetensors
from .spread import Spread, TensorFile, leads, spread_output, write_tensor_files
from .state import ComponentSpec, SharingPattern, WorldSizePolicy
from .tensors import LazyTensor
from .topology import Topology
from .verify import digest_as, open_checkpoint

log = logging.getLogger(__name__)

DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3  # Hugging Face's default
STATE_JSON = "optimizer/state.json"
ADAPTER_DIR = "adapter"
ADAPTER_CONFIG = f"{ADAPTER_DIR}/adapter_config.json"  # peft's file names: the folder is an adapter directory


def parse_size(text: str | int) -> int:
    """'5GB', '500MB', '2GiB' or a byte count."""
    if isinstance(text, int):
        return text
    s = text.strip().upper()
    for suffix, mult in (("GIB", 1024**3), ("MIB", 1024**2), ("KIB", 1024), ("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(suffix):
            number = float(s[: -len(suffix)])
            if not math.isfinite(number):
                raise ValueError(f"size {text!r} is not finite")
            return int(number * mult)
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


@dataclass
class ShardedPlan:
    """The files ``write_sharded`` writes for one stem, decided before any byte is: what a single process writes
    one after another, or many processes between them (``interop.spread``)."""

    files: list[TensorFile]
    index: tuple[str, dict[str, Any]] | None  # (path, content) of the index, for more than one shard
    checked: dict[str, LazyTensor]  # source tensors whose recorded digest the written one must equal
    key_of: Callable[[str], str]
    hashed: bool

    def finish(self, root: str, written: dict[str, WrittenFile], leads: bool = True) -> WriteResult:
        """The records of what was written (its digests checked against the source's), and the index (the lead's)."""
        result = WriteResult()
        for f in self.files:
            done = written[f.rel]
            result.files[f.rel] = FileRecord(done.nbytes, done.digest)
            for entry in f.entries:
                if entry.name in self.checked:
                    self.checked[entry.name].check_digest(done.tensor_digests[entry.name])
                result.tensors[self.key_of(entry.name)] = TensorRecord(
                    list(entry.spec.shape), entry.spec.dtype_name, f.rel, done.tensor_digests.get(entry.name)
                )
        if self.index is not None and leads:
            result.files[self.index[0]] = _write_json(root, *self.index)
        return result


def plan_sharded(
    subdir: str,
    stem: str,
    tensors: dict[str, LazyTensor],
    max_shard_size: int,
    key_of: Callable[[str], str] = lambda name: name,
    hashed: bool = True,
) -> ShardedPlan:
    """``<stem>.safetensors`` or ``<stem>-0000i-of-0000n.safetensors`` + ``<stem>.safetensors.index.json``.

    Without ``hashed`` (an export no manifest will describe) nothing is hashed, unless a source tensor has
    a recorded digest: then it is checked, so a corrupted universal checkpoint is not exported silently."""
    # a source tensor with a recorded digest of this version's algorithm is checked against what the writer
    # hashes anyway (no second pass); one of another algorithm checks itself as it loads
    checked = {name for name, t in tensors.items() if t.digest is not None and digests.parse(t.digest, t.origin)[0] == digests.ALGO}
    entries = [  # a tensor whose digest this writer cannot check goes through load(), which checks it
        TensorEntry(name, t.spec, (lambda t=t: t.load(verify=False)) if name in checked else t.load,
                    t.mapped_pieces if t.digest is None or name in checked else None)
        for name, t in tensors.items()
    ]
    shards = shard_groups(entries, max_shard_size)
    plain_name(stem, "optimizer state key" if subdir == "optimizer" else "file stem")  # a key from the source names the file
    files, weight_map = [], {}
    for i, shard in enumerate(shards, 1):
        fname = f"{stem}.safetensors" if len(shards) == 1 else f"{stem}-{i:05d}-of-{len(shards):05d}.safetensors"
        files.append(TensorFile(f"{subdir}/{fname}" if subdir else fname, shard, {"format": "pt"}))
        weight_map.update((entry.name, fname) for entry in shard)
    index = None
    if len(shards) > 1:
        rel = f"{subdir}/{stem}.safetensors.index.json" if subdir else f"{stem}.safetensors.index.json"
        index = (rel, {"metadata": {"total_size": sum(e.spec.nbytes for e in entries)}, "weight_map": weight_map})
    return ShardedPlan(files, index, {n: tensors[n] for n in checked}, key_of, hashed or bool(checked))


def write_plans(root: str, plans: list[ShardedPlan], progress=None, spread: Spread | None = None) -> WriteResult:
    """Write every plan's files (by this process, or each process of ``spread`` its share) and gather their records."""
    result = WriteResult()
    for hashed in (True, False):  # one pass over the bytes for each kind (an export's plans are all unhashed)
        group = [p for p in plans if p.hashed == hashed]
        if not group:
            continue
        written = write_tensor_files(root, [f for p in group for f in p.files], hashed, progress, spread)
        for p in group:
            part = p.finish(root, written, leads(spread))
            result.files.update(part.files)
            result.tensors.update(part.tensors)
    return result


def write_sharded(
    root: str,
    subdir: str,
    stem: str,
    tensors: dict[str, LazyTensor],
    max_shard_size: int,
    key_of: Callable[[str], str] = lambda name: name,
    progress: Callable[[TensorEntry], None] | None = None,
    hashed: bool = True,
) -> WriteResult:
    """One stem's files, written by this process (see :func:`plan_sharded`)."""
    return write_plans(root, [plan_sharded(subdir, stem, tensors, max_shard_size, key_of, hashed)], progress)


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
            if not same_values(model[target], model[source]):
                raise ConversionError(
                    f"{target} and {source} are declared tied but hold different values; "
                    "untie them in config.json (tie_word_embeddings=false) to keep both"
                )
            del model[target]
    return model


def same_values(a: LazyTensor, b: LazyTensor) -> bool:
    """Whether two tensors hold the same bytes: by the digests their manifest records where both have one of one
    algorithm (the manifest is checked; the tensor left out is never read, the one written is checked as it is),
    else hashed (each checked against its own record, where it has one)."""
    if a.spec != b.spec:
        return False
    if a.digest is not None and b.digest is not None and digests.parse(a.digest, a.origin)[0] == digests.parse(b.digest, b.origin)[0]:
        return a.digest == b.digest
    return a.bytes_digest() == b.bytes_digest()


def write_model_dir(
    root: str, subdir: str, ckpt: LogicalCheckpoint, max_shard_size: int, progress=None, hashed: bool = True,
    spread: Spread | None = None,
) -> WriteResult:
    """A Hugging Face model directory: config.json and (sharded) model.safetensors."""
    result = write_plans(root, [plan_sharded(subdir, "model", model_entries(ckpt), max_shard_size, hashed=hashed)], progress, spread)
    if ckpt.config is not None and leads(spread):
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
            files[rel] = FileRecord(rec.bytes, digest_as(dst_path, rec.digest, rec.block_bytes), rec.writer, rec.blocks, rec.block_bytes)
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


def universal_plans(ckpt: LogicalCheckpoint, max_shard_size: int = DEFAULT_MAX_SHARD_SIZE) -> list[ShardedPlan]:
    """The tensor files of ``ckpt``'s universal checkpoint: model (the frozen base where there are adapters), the
    adapter (peft's own layout, one file: PeftModel.from_pretrained reads no shards), each optimizer state key."""
    adapter = ckpt.adapter
    held = set(adapter.tensors) if adapter else set()
    base = replace(ckpt, model={n: t for n, t in ckpt.model.items() if n not in held}) if adapter else ckpt
    plans = [plan_sharded("model", "model", model_entries(base), max_shard_size)]
    if adapter is not None:
        plans.append(plan_sharded(ADAPTER_DIR, "adapter_model", {n: ckpt.model[n] for n in adapter.tensors}, 2**62))
    opt = ckpt.optimizer
    for key in sorted(opt.tensors) if opt is not None else []:
        plans.append(plan_sharded("optimizer", key, opt.tensors[key], max_shard_size, lambda n, k=key: optim_key(k, n)))
    return plans


def write_universal(
    ckpt: LogicalCheckpoint,
    dst: str,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    overwrite: bool = False,
    progress: Callable[[TensorEntry], None] | None = None,
    spread: Spread | None = None,
) -> Manifest | None:
    """Write ``ckpt`` as a universal checkpoint at ``dst``, built in staging and moved into place whole. With
    ``spread`` every process of it calls this together and writes its share of the tensor bytes; the lead writes
    the rest and the manifest (returned there; None on the other ranks)."""
    with spread_output(dst, overwrite, spread) as out:
        adapter, opt = ckpt.adapter, ckpt.optimizer
        result = write_plans(out, universal_plans(ckpt, max_shard_size), progress, spread)
        if not leads(spread):
            return None
        if ckpt.config is not None:
            result.files["model/config.json"] = _write_json(out, "model/config.json", ckpt.config)
        adapter_section = None
        if adapter is not None:
            result.files[ADAPTER_CONFIG] = _write_json(out, ADAPTER_CONFIG, adapter.config)
            adapter_section = {"config": ADAPTER_CONFIG, "name": adapter.name}
        optimizer_section = None
        if opt is not None:
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
                **({"adapter": adapter_section} if adapter_section else {}),
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


def read_universal(directory: str, verify_digests: bool = True) -> LogicalCheckpoint:
    """The universal checkpoint at ``directory``. Everything is checked against the manifest before use: the
    JSON files and component pieces by their file digests, the model and optimizer tensors one by one as they
    are loaded (each LazyTensor carries its recorded digest), their headers here."""
    manifest = open_checkpoint(directory, verify_digests)
    if manifest.format != UNIVERSAL_FORMAT:
        raise CorruptCheckpointError(directory, f"is a {manifest.format} checkpoint, not {UNIVERSAL_FORMAT}")
    model = read_hf_safetensors(os.path.join(directory, "model")) or {}
    _attach_digests(model, manifest, lambda name: name, directory)
    config = None
    if manifest.model and manifest.model.get("config"):
        config = read_json(inside(directory, manifest.model["config"]), "model config")
    optimizer = None
    if manifest.optimizer:
        path = inside(directory, STATE_JSON)
        state = read_json(path, "optimizer state")
        try:
            keys, cls, scalars = list(state["state_keys"]), state["class"], dict(state["scalars"])
            groups = codec.decode(state["param_groups"], _no_tensor)
            if not all(isinstance(k, str) for k in keys) or not isinstance(groups, list) or not isinstance(cls, str):
                raise TypeError("state_keys must be names, param_groups a list and class a name")
            for per in scalars.values():
                for entry in per.values():
                    checked_scalar(entry)
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptCheckpointError(path, f"not a valid optimizer state: {exc}") from None
        tensors = {}
        for key in keys:
            found = read_hf_safetensors(os.path.join(directory, "optimizer"), key)
            if found is not None:
                _attach_digests(found, manifest, lambda name, k=key: optim_key(k, name), directory)
                tensors[key] = found
        optimizer = OptimizerState(cls, groups, tensors, scalars)
    components = {key: ComponentSource.from_manifest(directory, manifest, key) for key in manifest.components}
    model_meta = manifest.model or {}
    adapter = None
    if model_meta.get("adapter"):
        section = model_meta["adapter"]
        if not isinstance(section["config"], str):
            raise CorruptCheckpointError(os.path.join(directory, "manifest.json"), "model.adapter.config must name the "
                                         f"adapter's {ADAPTER_CONFIG} file")
        held = read_hf_safetensors(os.path.join(directory, ADAPTER_DIR), "adapter_model")
        if held is None:
            raise CorruptCheckpointError(os.path.join(directory, ADAPTER_DIR, "adapter_model.safetensors"),
                                         "missing: the manifest records an adapter")
        _attach_digests(held, manifest, lambda name: name, directory)
        clash = sorted(set(held) & set(model))
        if clash:
            raise CorruptCheckpointError(directory, f"tensor {clash[0]!r} is both in model/ and in {ADAPTER_DIR}/")
        model.update(held)
        path = inside(directory, section["config"])
        adapter = AdapterState(checked_adapter_config(read_json(path, "adapter config"), path), section["name"], list(held))
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
        adapter=adapter,
    )


def checked_adapter_config(config: Any, where: str) -> dict[str, Any]:
    """peft's adapter config as a checkpoint holds it (adapter_config.json, or our manifest's record): an object
    naming its peft type, refused naming ``where`` otherwise."""
    if not isinstance(config, dict) or not isinstance(config.get("peft_type"), str):
        raise CorruptCheckpointError(where, "is not peft's adapter config (an object with its peft_type)")
    return config


def _attach_digests(tensors: dict[str, LazyTensor], manifest: Manifest, key_of: Callable[[str], str], directory: str) -> None:
    """Give each tensor read from the checkpoint the digest its manifest records, so loading it checks its bytes."""
    for name, t in tensors.items():
        record = manifest.tensors.get(key_of(name))
        if record is None or record.digest is None:
            raise CorruptCheckpointError(t.origin or directory, f"tensor {key_of(name)!r} has no digest in the manifest")
        t.digest = record.digest


def _no_tensor(name: str) -> Any:
    raise CorruptCheckpointError(STATE_JSON, f"unexpected tensor reference {name!r}")


def checked_scalar(entry: dict[str, Any]) -> tuple[int | float | bool, str]:
    """A 0-dim optimizer state value as stored in state.json: (value, dtype name), checked without torch (reading
    a universal checkpoint for a target that needs no torch, Hugging Face, must not import it: a second of start-up)."""
    value, dtype = entry["value"], entry["dtype"]
    if not (isinstance(dtype, str) and is_dtype_name(dtype)):
        dtype_from_name(dtype)  # a name outside the table (ValueError where torch has no such dtype either)
    if not isinstance(value, (int, float)) or isinstance(value, bool) and dtype != "bool":
        raise TypeError(f"scalar value {value!r} is not a number")
    if isinstance(value, int) and dtype != "bool" and is_dtype_name(dtype) and not is_floating(dtype):
        width = 8 * itemsize(dtype)  # (torch.tensor would refuse it with a RuntimeError, in the target's writer)
        low, high = (0, 1 << width) if dtype.startswith("u") else (-(1 << (width - 1)), 1 << (width - 1))
        if not low <= value < high:
            raise ValueError(f"scalar value {value} does not fit {dtype}")
    return value, dtype


def scalar_value(entry: dict[str, Any]) -> torch.Tensor:
    """A 0-dim optimizer state value as stored in state.json, as a tensor."""
    value, dtype = checked_scalar(entry)
    return torch.tensor(value, dtype=dtype_from_name(dtype))


def saved_scalar(entry: dict[str, Any]) -> "torch.Tensor | int | float | bool":
    """A 0-dim optimizer state value as its optimizer held it: a Python number where the entry says it was one
    (``"number": true``), else a 0-dim tensor (torch's AdamW's step)."""
    if entry.get("number") is True:
        value, dtype = checked_scalar(entry)
        return bool(value) if dtype == "bool" else float(value) if is_floating(dtype) else int(value)
    return scalar_value(entry)


def scalar_entry(t: "torch.Tensor") -> dict[str, Any]:
    """A one-element tensor as the manifest records it. Also takes a tensor that knows its ``dtype_name`` and
    ``item()`` without torch (a torch_zip.StoredTensor)."""
    name = getattr(t, "dtype_name", None)
    return {"value": t.item(), "dtype": name if isinstance(name, str) else dtype_name(t.dtype)}


def split_optimizer_state(
    per_name: dict[str, dict[str, Any]], where: str
) -> tuple[dict[str, dict[str, LazyTensor]], DeferredScalars]:
    """A name-keyed optimizer state (``{name: {key: value}}``) as OptimizerState's ``tensors`` (state key ->
    name -> tensor) and ``scalars`` (0-dim values and numbers: AdamW's step), these read when first asked for.
    Values may be lazy or loaded."""
    tensors: dict[str, dict[str, LazyTensor]] = {}
    readers: dict[str, dict[str, Callable[[], dict[str, Any]]]] = {}
    for name, entries in per_name.items():
        for key, value in entries.items():
            if instance_of(value, "torch", "Tensor"):
                value = LazyTensor.of(value, f"{where}[{name}.{key}]")
            if isinstance(value, LazyTensor) and len(value.spec.shape) > 0:
                tensors.setdefault(key, {})[name] = value
            elif isinstance(value, LazyTensor):  # read when asked for, from its bytes where it can be (no torch)
                readers.setdefault(key, {})[name] = lambda v=value: {"value": v.item(), "dtype": v.spec.dtype_name}
            elif isinstance(value, (int, float)):  # a number the optimizer keeps as one (transformers' Adafactor's step)
                entry = {**scalar_entry(torch.tensor(value)), "number": True}
                readers.setdefault(key, {})[name] = lambda e=entry: e
            else:
                raise ConversionError(f"{where}: optimizer state {key!r} of {name!r} is a {type(value).__name__}")
    return tensors, DeferredScalars(readers)
