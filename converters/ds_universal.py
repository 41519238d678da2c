"""DeepSpeed's universal checkpoint: what ``ds_to_universal`` writes and ``load_universal`` reads.

A tag directory (``<root>/latest_universal`` names it) holds every trainable parameter whole, one folder each:
``zero/<name>/fp32.pt``, ``exp_avg.pt``, ``exp_avg_sq.pt`` (``{"param": tensor, "cat_dim": 0}``; DeepSpeed's
ZeRO-3 converter writes bare flat tensors) and ``step.pt``, plus ``zero/optimizer_state.pt`` (param groups,
global optimizer state) and the source's model-states file(s), copied. ``load_universal`` re-partitions this
for whatever world size and stage the loading engine has.

What DeepSpeed's loaders read, and so what a written checkpoint must hold for all three stages at once:

- ZeRO-1/2 glob ``mp_rank_*_model_states.pt``, ZeRO-3 ``zero_pp_rank_0_mp_rank_*_model_states.pt``; only the
  metadata is used (step, scheduler, client state), never ``module``. We write both names.
- ZeRO-1/2 read every ``*.pt`` in a parameter's folder as ``{"param": ...}`` and take ``step.pt`` as the
  group's step; ZeRO-3 reads fp32/exp_avg/exp_avg_sq and one step, ``optimizer_state_dict.state[0].step``.
- ZeRO-1/2 set each group's hyper-parameters from ``param_groups``; ZeRO-3 sets *every* group's from
  ``optimizer_state_dict.param_groups[0]``, so we put there only the values all groups share, and a
  decay / no-decay split keeps its per-group weight decay.
- Neither restores frozen parameters or buffers (they are not the optimizer's); they are kept here anyway,
  in ``zero/<name>/fp32.pt`` as ``ds_to_universal`` does and exactly in the model states, for readers.
"""

from __future__ import annotations

import logging
import math
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

from interop.lazy_import import torch

from interop.commit import LATEST_UNIVERSAL
from interop.manifest import MANIFEST
from interop.verify import open_checkpoint
from interop.sharding import ShardingMetadata, Strategy
from interop.errors import ConversionError, CorruptCheckpointError, MissingFileError
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.paths import inside, plain_name
from interop.tensors import LazyTensor, TensorSpec
from interop.universal import scalar_entry

from .deepspeed import ZERO3_MODEL_FILE, ZERO12_MODEL_FILE, _shape, frozen_and_buffers, load_ds_file, precision_of_config, to_logical
from .detection import DS_UNIVERSAL_OPTIMIZER_STATE, DS_UNIVERSAL_ZERO_DIR, is_ds_universal, locate_ds_universal as locate  # noqa: F401
from .engine_checkpoint import Written, at_once, native_dir, write_engine_checkpoint
from .deepspeed_writer import _group_scalars, deepspeed_version, model_states, shapes
from .param_order import engine_order
from .pickle_safety import save_torch
from .torch_zip import as_torch, dtype_name_of, is_tensor, piece_of

log = logging.getLogger(__name__)

LATEST = LATEST_UNIVERSAL
NATIVE_KEY = "ds_universal"  # the native component of our checkpoint around a universal tag directory
ZERO_DIR, OPTIMIZER_STATE = DS_UNIVERSAL_ZERO_DIR, DS_UNIVERSAL_OPTIMIZER_STATE
PARAM = "param"  # DeepSpeed's key for the tensor in a universal state file
ADAM_KEYS = ("exp_avg", "exp_avg_sq")


# --- where the files are ------------------------------------------------------------------------------------
@dataclass
class UniversalFiles:
    tag_dir: str
    model: list[str]  # the model-states files: ZeRO-3's per rank, else the one
    zero3: bool

    @property
    def zero(self) -> str:
        return os.path.join(self.tag_dir, ZERO_DIR)


def universal_files(tag_dir: str) -> UniversalFiles:
    optim = os.path.join(tag_dir, ZERO_DIR, OPTIMIZER_STATE)
    if not os.path.isfile(optim):
        raise MissingFileError(optim, "missing: a universal checkpoint keeps its param groups there")
    if os.path.isfile(os.path.join(tag_dir, ZERO12_MODEL_FILE)):
        return UniversalFiles(tag_dir, [os.path.join(tag_dir, ZERO12_MODEL_FILE)], False)
    ranks = sorted(int(m.group(1)) for m in map(ZERO3_MODEL_FILE.match, os.listdir(tag_dir)) if m)
    if not ranks:
        raise MissingFileError(os.path.join(tag_dir, ZERO12_MODEL_FILE), "missing: no model-states file beside zero/")
    model = [os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(max(ranks) + 1)]
    for p in model:
        if not os.path.isfile(p):
            raise MissingFileError(p, f"missing: the ZeRO-3 model states of ranks 0..{max(ranks)} hold the frozen parameters")
    return UniversalFiles(tag_dir, model, True)


# --- reading -------------------------------------------------------------------------------------------------
def _state_file(path: str, shape: tuple[int, ...], trust_pickle: bool) -> Any:
    """The tensor in one of the universal checkpoint's per-parameter files: a torch_zip.StoredTensor, or torch's."""
    obj = load_ds_file(path, trust_pickle)
    t = obj.get(PARAM) if isinstance(obj, dict) else obj
    if not is_tensor(t):
        raise CorruptCheckpointError(path, f"holds no tensor (expected a tensor or a dict with {PARAM!r})")
    if t.numel() != math.prod(shape):
        raise CorruptCheckpointError(path, f"holds {t.numel()} elements; the parameter has shape {list(shape)}")
    return t


def _lazy(path: str, shape: tuple[int, ...], trust_pickle: bool) -> LazyTensor:
    def pieces():
        t = _state_file(path, shape, trust_pickle)
        return [piece_of(t, mapped=True)] if t.is_contiguous() and dtype_name_of(t) == "float32" else None

    return LazyTensor(TensorSpec(shape, "float32"), lambda: as_torch(_state_file(path, shape, trust_pickle)).reshape(shape), path,
                      mapped_pieces=pieces)


def _groups_of(osd: dict[str, Any], path: str) -> tuple[list[dict[str, Any]], dict[int, int], dict[int, dict]]:
    """Param groups' hyper-parameters, the group of each flat group, and the base state per flat group."""
    base = osd.get("optimizer_state_dict") if isinstance(osd.get("optimizer_state_dict"), dict) else {}
    groups = osd.get("param_groups") or base.get("param_groups")
    if not isinstance(groups, list) or not groups:
        raise CorruptCheckpointError(path, "no param_groups")
    group_of_flat = {int(flat): g for g, group in enumerate(groups) for flat in group.get("params", [])}
    return groups, group_of_flat, dict(base.get("state") or {})


def read_ds_universal(path: str, trust_pickle: bool = False, verify_digests: bool = True) -> LogicalCheckpoint:
    """A DeepSpeed universal checkpoint (``ds_to_universal``'s or ours) as a logical one; ours is checked
    against its manifest before any file is unpickled."""
    files = universal_files(locate(path))
    manifest = None
    if os.path.isfile(os.path.join(files.tag_dir, MANIFEST)):
        manifest = open_checkpoint(files.tag_dir, verify_digests, by_tensor=False)
        native_dir(files.tag_dir, manifest, NATIVE_KEY)  # refuses our checkpoint of another layout
    optim_path = os.path.join(files.zero, OPTIMIZER_STATE)
    osd = load_ds_file(optim_path, trust_pickle)
    if not isinstance(osd, dict):
        raise CorruptCheckpointError(optim_path, "not a DeepSpeed universal optimizer state")
    model_states = []
    for p in files.model:
        ms = load_ds_file(p, trust_pickle)
        if not isinstance(ms, dict) or "param_shapes" not in ms:
            raise CorruptCheckpointError(p, "not a DeepSpeed model-states file (no param_shapes)")
        model_states.append(ms)
    ms0 = model_states[0]
    groups, group_of_flat, base_state = _groups_of(osd, optim_path)

    trainable: dict[str, LazyTensor] = {}
    tensors: dict[str, dict[str, LazyTensor]] = {}
    scalars: dict[str, dict[str, dict[str, Any]]] = {}
    members: dict[int, list[str]] = {}
    for flat, group_shapes in enumerate(ms0["param_shapes"]):
        group = group_of_flat.get(flat, 0) if files.zero3 else flat
        for name, shape in group_shapes.items():
            shape = _shape(shape)
            folder = inside(files.zero, name, files.model[0])  # a parameter's folder, named from the model states
            fp32 = os.path.join(folder, "fp32.pt")
            if not os.path.isfile(fp32):
                raise MissingFileError(fp32, f"missing: trainable parameter {name!r} has no fp32 weights")
            trainable[name] = _lazy(fp32, shape, trust_pickle)
            members.setdefault(group, []).append(name)
            keys = sorted(f[:-3] for f in os.listdir(folder) if f.endswith(".pt"))
            for key in keys:
                if key not in ("fp32", "step"):
                    tensors.setdefault(key, {})[name] = _lazy(os.path.join(folder, f"{key}.pt"), shape, trust_pickle)
            if "step" in keys:
                step = load_ds_file(os.path.join(folder, "step.pt"), trust_pickle)
            else:  # DeepSpeed's ZeRO-3 converter keeps the step only in the copied optimizer state
                step = (base_state.get(flat) or {}).get("step")
            if step is not None:
                t = step if is_tensor(step) else torch.tensor(step)
                scalars.setdefault("step", {})[name] = scalar_entry(t)
    param_groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": members.get(i, [])} for i, g in enumerate(groups)]
    optimizer = OptimizerState("AdamW", param_groups, tensors, scalars)
    frozen, buffers = frozen_and_buffers(model_states, files.model[0], set(trainable), files.zero3)
    stage = osd.get("zero_stage")
    ds_config = ms0.get("ds_config") or {}
    source = {
        "format": "ds-universal",
        "zero_stage": int(stage) if stage is not None else None,  # the source's; universal loads on any stage
        "world_size": ms0.get("dp_world_size"),
        "dtype": precision_of_config(ds_config),
        "master_dtype": "float32",
        "ds_version": ms0.get("ds_version"),
        "tag": os.path.basename(os.path.normpath(files.tag_dir)),
    }
    return to_logical(ms0, trainable, frozen, buffers, optimizer, source, files.tag_dir, manifest, files.tag_dir,
                      root=path, native_key=NATIVE_KEY)


# --- writing -------------------------------------------------------------------------------------------------
def _save(obj: Any, path: str) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    save_torch(obj, path)


def _shared_hyper(hyper: list[dict[str, Any]]) -> dict[str, Any]:
    """The hyper-parameters every group agrees on: all ZeRO-3's universal loader can set without harm."""
    first = hyper[0] if hyper else {}
    return {k: v for k, v in first.items() if all(k in h and h[k] == v for h in hyper[1:])}


def write_ds_universal(
    ckpt: LogicalCheckpoint,
    dst: str,
    ds_config: dict[str, Any] | None = None,
    overwrite: bool = False,
    progress: Callable[[LazyTensor], None] | None = None,
) -> str:
    """Write ``ckpt`` as a DeepSpeed universal checkpoint under ``dst`` (``engine.load_checkpoint(dst)`` with
    ``"checkpoint": {"load_universal": true}``, on any stage and world size); returns the tag directory's name.
    Our manifest and the source's other components sit in the tag directory beside DeepSpeed's files.

    A source without optimizer state (a Hugging Face model) gets AdamW's initial state, zeros at step 0, which
    is what the optimizer would start from anyway; DeepSpeed's ZeRO-3 loader needs the files to exist."""
    order = engine_order(ckpt)
    opt = ckpt.optimizer
    keys = sorted(opt.tensors) if opt is not None else []
    unknown = [k for k in keys if k not in ADAM_KEYS]
    if unknown:  # DeepSpeed's ZeRO-3 loader restores exp_avg and exp_avg_sq only; others would be lost
        raise ConversionError(f"DeepSpeed's universal layout holds AdamW state only; the source also has {unknown}")
    extra_scalars = sorted(set(opt.scalar_keys if opt is not None else []) - {"step"})
    if extra_scalars:
        raise ConversionError(f"DeepSpeed's universal layout keeps only the 'step' scalar; the source also has {extra_scalars}")
    step = int(ckpt.step or 0)
    tag = f"global_step{step}_universal"
    ds_config = dict(ds_config or {})
    if not ds_config and ckpt.source.get("dtype") == "bfloat16":  # record the precision it was trained in
        ds_config["bf16"] = {"enabled": True}
    version = deepspeed_version()  # the files hold no DeepSpeed class: it is not imported

    def write_files(out: str) -> Written:
        zero = os.path.join(out, tag, ZERO_DIR)
        group_steps: list[torch.Tensor] = []
        jobs: list[tuple[str, torch.Tensor]] = []
        for names in order.groups:
            group_step = _group_scalars(ckpt, names).get("step", torch.tensor(0.0))
            group_steps.append(group_step)
            jobs += [(name, group_step) for name in names]

        reading = threading.Lock()

        def write_parameter(name: str, group_step: torch.Tensor) -> tuple[list[LazyTensor], int]:
            """One parameter's folder (DeepSpeed's layout): its fp32 weight, Adam's moments and its group's step,
            each streamed from the source into its file (a mapped source's bytes copied file to file)."""
            folder = os.path.join(zero, plain_name(name, "parameter"))
            t = ckpt.model[name]
            done, zeros = [], 0
            for key, lazy in (("fp32", t), *((k, opt.tensors.get(k, {}).get(name) if opt is not None else None) for k in ADAM_KEYS)):
                if lazy is None:
                    value = torch.zeros(t.spec.shape, dtype=torch.float32)
                    zeros += 1
                else:  # read one at a time: a reader's caches (a TP merge's) are not shared across threads
                    value = lazy.cast(torch.float32).guarded(reading)
                    done.append(lazy)
                _save({PARAM: value, "cat_dim": 0}, os.path.join(folder, f"{key}.pt"))
                del value
            _save(group_step.clone(), os.path.join(folder, "step.pt"))
            return done, zeros

        filled = 0
        # Several parameters at once: one's bytes are read from the source while others' are pickled and written
        # (each file is the same as written one after another)
        for done, zeros in at_once(write_parameter, jobs, "ds-universal"):
            filled += zeros
            for lazy in done if progress is not None else ():
                progress(lazy)
        kept = {n: ckpt.model[n].load() for n in order.frozen + order.buffers}  # read once: also in the model states
        for name, t in kept.items():  # as ds_to_universal keeps them: whole, in fp32
            _save({PARAM: t.to(torch.float32)}, os.path.join(zero, plain_name(name, "tensor"), "fp32.pt"))
        if filled:
            log.warning("%d optimizer state tensor(s) absent from the source were written as AdamW's initial zeros", filled)
        hyper = [{**h, "params": [g]} for g, h in enumerate(order.hyper)]
        _save(
            {
                "ds_version": version,
                "param_groups": hyper,
                "optimizer_state_dict": {
                    "state": {g: {"step": s.clone()} for g, s in enumerate(group_steps)},
                    "param_groups": [{**_shared_hyper(order.hyper), "params": [0]}],
                },
            },
            os.path.join(zero, OPTIMIZER_STATE),
        )
        states = _model_states(ckpt, order, kept, ds_config, version, step)
        for name in (ZERO12_MODEL_FILE, "zero_pp_rank_0_mp_rank_00_model_states.pt"):
            save_torch(states, os.path.join(out, tag, name))
        with open(os.path.join(out, LATEST), "w", encoding="utf-8") as f:
            f.write(tag)
        notes = []
        if order.frozen:  # a LoRA run's whole base model, or a --freeze run's frozen part
            notes.append(f"DeepSpeed's load_universal restores no frozen parameter: the {len(order.frozen)} frozen tensors "
                         f"(e.g. {order.frozen[0]}) are kept here for readers only, so the loading run must build them "
                         "itself (from the same base model); --to deepspeed writes them where DeepSpeed's own load takes them")
        return Written(notes=notes, at=tag)

    sharding = ShardingMetadata(strategy=Strategy.ZERO, world_size=int(ckpt.source.get("world_size") or 1),
                                precision=ckpt.source.get("dtype") or "float32", master_precision="float32")
    write_engine_checkpoint(ckpt, dst, NATIVE_KEY, write_files, sharding, {"deepspeed": version},
                            {"class": opt.cls} if opt is not None else None, overwrite)
    log.info("wrote DeepSpeed universal checkpoint %s", os.path.join(dst, tag))
    return tag


def _model_states(
    ckpt: LogicalCheckpoint, order, kept: dict[str, torch.Tensor], ds_config: dict[str, Any], version: str, step: int
) -> dict[str, Any]:
    """What the universal loaders take from the model-states file (step, scheduler, client state), plus the
    frozen parameters and buffers (``kept``) for readers; trainable parameters are in zero/ only (empty here,
    as ZeRO-3's)."""
    buffers = set(order.buffers)
    module = OrderedDict((n, kept[n] if n in buffers else torch.empty(0, dtype=torch.float32)) for n in order.module_keys)
    return model_states(
        ckpt, order, module, [shapes(ckpt, names) for names in order.groups],
        frozen_shapes=shapes(ckpt, order.frozen),
        frozen_fragments=OrderedDict((n, kept[n]) for n in order.frozen),
        step=step, ds_config=ds_config, world=int(ckpt.source.get("world_size") or 1), version=version,
    )
