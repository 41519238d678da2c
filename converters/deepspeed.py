"""DeepSpeed ZeRO-1/2/3 checkpoints: read any world size into logical tensors, write any world size and stage.

A ZeRO checkpoint directory (``<dir>/latest`` names the tag; ``<dir>/<tag>/`` holds the files) keeps the fp32
master weights and the optimizer state as flat per-rank partitions; the model-states file says how to cut them:

- ZeRO-1/2: each param group is one flat vector, padded at its end to a multiple of 2 x world size, split into
  equal partitions. ``single_partition_of_fp32_groups`` is a rank's part with its tail padding stripped;
  optimizer state (exp_avg, ...) is kept unstripped. Concatenating the ranks' parts and cutting in
  ``param_shapes`` order (skipping ``param_alignment_paddings``) gives the parameters.
- ZeRO-3: every parameter is split on its own, ``ceil(numel / world)`` elements per rank, and a rank's flat
  sub-group vectors are its pieces back to back.

Frozen parameters are not in the flat vectors: ZeRO-2 keeps them whole and ZeRO-3 in pieces in
``frozen_param_fragments``; ZeRO-1 saves none there, so they come from ``module`` (DeepSpeed's own
zero_to_fp32 drops them). Buffers come from ``module``; tied parameters from ``shared_params``.
"""

from __future__ import annotations

import logging
import math
import os
import re
from dataclasses import dataclass, field
from typing import Any

from interop.lazy_import import torch

from interop.commit import resolve_checkpoint_dir
from interop.errors import (
    ConversionError,
    CorruptCheckpointError,
    MissingFileError,
    TopologyError,
    UnknownFormatError,
    UnsupportedStateError,
)
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.manifest import MANIFEST, Manifest
from interop.dtypes import dtype_from_name
from interop.tensors import LazyTensor, TensorSpec
from interop.universal import scalar_entry
from interop.structure import Absent, Keys, ListOf, MapOf, Maybe, OneOf, check
from interop.verify import open_checkpoint

from . import deepspeed_moe
from .detection import DEEPSPEED_KEY, OPTIM_FILE, is_deepspeed_checkpoint, locate_deepspeed as locate  # noqa: F401
from .engine_checkpoint import at_once, carried_components, owning_checkpoint, native_dir
from .models.facts import tied_groups
from .hf import config_near
from .pickle_safety import is_mapped, load_torch_file
from .torch_zip import NUMBER, TENSOR, TORCH_OPTIMIZER, as_torch, copy_into, dtype_name_of, is_tensor, lazy_of, materialize, piece_of

log = logging.getLogger(__name__)

NATIVE_KEY = DEEPSPEED_KEY  # the native component of our DeepSpeed trainer's checkpoints
ZERO3_MODEL_FILE = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
ZERO12_MODEL_FILE = "mp_rank_00_model_states.pt"
PRECISIONS = ("float32", "bfloat16", "float16")


# --- DeepSpeed's pickled objects, allowlisted without importing DeepSpeed -----------------------------------
class _PickledObject:
    """Stands in for a DeepSpeed object (a loss scaler) inside a checkpoint: its attributes, nothing runnable."""

    def __setstate__(self, state: Any) -> None:
        self.__dict__.update(state if isinstance(state, dict) else {"state": state})


class LossScaler(_PickledObject):
    pass


class DynamicLossScaler(_PickledObject):
    pass


class FragmentAddress(_PickledObject):
    pass


def _zero_stage_enum(value: int) -> int:
    return int(value)


DEEPSPEED_ALLOWLIST: list[Any] = [
    (LossScaler, "deepspeed.runtime.fp16.loss_scaler.LossScaler"),
    (DynamicLossScaler, "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler"),
    (_zero_stage_enum, "deepspeed.runtime.zero.config.ZeroStageEnum"),
    (FragmentAddress, "deepspeed.utils.tensor_fragment.fragment_address"),
]


def load_ds_file(path: str, trust_pickle: bool = False) -> Any:
    """A DeepSpeed file, tensors as torch_zip.StoredTensors where torch is not needed to read them."""
    return load_torch_file(path, trust_pickle, allow=DEEPSPEED_ALLOWLIST, stored=True)


# --- where the files are ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NativeLayout:
    """What decides whether DeepSpeed can load a checkpoint as it is: world size, stage family, precision."""

    world_size: int
    zero_stage: int
    precision: str = "float32"
    ep_size: int = 1  # expert-parallel ranks of deepspeed.moe layers

    def describe(self) -> str:
        ep = f", experts over {self.ep_size} ranks" if self.ep_size > 1 else ""
        return f"ZeRO-{self.zero_stage}, {self.world_size} rank(s), {self.precision}{ep}"

    def loads_as(self, other: "NativeLayout") -> bool:
        """ZeRO-1 and -2 share a partitioning, so either loads into the other; stage 3 does not."""
        return (
            self.world_size == other.world_size
            and self.precision == other.precision
            and self.ep_size == other.ep_size
            and (self.zero_stage == 3) == (other.zero_stage == 3)
        )


@dataclass
class NativeFiles:
    tag_dir: str
    optim: list[str]  # by dp rank
    model: list[str]  # ZeRO-3: by dp rank; ZeRO-1/2: the one file
    bf16_prefix: bool

    @property
    def world_size(self) -> int:
        return len(self.optim)


def native_files(tag_dir: str) -> NativeFiles:
    """The per-rank files, checked for completeness: every rank 0..N-1 once, one kind, one model parallel rank."""
    optim: dict[int, str] = {}
    kinds, mp_ranks = set(), set()
    for name in sorted(os.listdir(tag_dir)):
        m = OPTIM_FILE.match(name)
        if m:
            rank = int(m.group(2))
            kinds.add(bool(m.group(1)))
            mp_ranks.add(int(m.group(3)))
            if rank in optim:
                raise CorruptCheckpointError(os.path.join(tag_dir, name), f"a second optimizer file for rank {rank}")
            optim[rank] = os.path.join(tag_dir, name)
    if not optim:
        raise UnknownFormatError(tag_dir, "no ZeRO optimizer files (*_optim_states.pt)")
    if len(kinds) > 1:
        raise CorruptCheckpointError(tag_dir, "holds both bf16_ and plain ZeRO optimizer files (two saves mixed)")
    if mp_ranks != {0}:
        raise UnsupportedStateError(f"{tag_dir}: model-parallel ZeRO checkpoints (mp_rank {sorted(mp_ranks)}) are not supported")
    world = max(optim) + 1
    missing = [r for r in range(world) if r not in optim]
    if missing:
        prefix = "bf16_" if kinds.pop() else ""
        path = os.path.join(tag_dir, f"{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt")
        raise MissingFileError(path, f"missing: the checkpoint has optimizer files for ranks up to {world - 1}")
    zero3 = sorted(n for n in os.listdir(tag_dir) if ZERO3_MODEL_FILE.match(n))
    if zero3:
        model = [os.path.join(tag_dir, f"zero_pp_rank_{r}_mp_rank_00_model_states.pt") for r in range(world)]
        for p in model:
            if not os.path.isfile(p):
                raise MissingFileError(p, f"missing: ZeRO-3 keeps one model-states file per rank ({world} ranks)")
        extra = [n for n in zero3 if int(ZERO3_MODEL_FILE.match(n).group(1)) >= world]
        if extra:
            raise TopologyError(f"{os.path.join(tag_dir, extra[0])}: model states for a rank beyond the {world} optimizer files (two world sizes mixed)")
    else:
        model = [os.path.join(tag_dir, ZERO12_MODEL_FILE)]
        if not os.path.isfile(model[0]):
            raise MissingFileError(model[0], "missing: the model-states file of a ZeRO-1/2 checkpoint")
    return NativeFiles(tag_dir, [optim[r] for r in range(world)], model, bool(kinds.pop()))


_ENABLED = Maybe(Keys(enabled=Maybe(OneOf(bool, int, str))))
DS_CONFIG_READ = Keys(zero_optimization=Maybe(Keys(stage=Absent(int))), bf16=_ENABLED, bfloat16=_ENABLED, fp16=_ENABLED)


def precision_of_config(ds_config: dict[str, Any] | None) -> str:
    cfg = ds_config or {}
    if (cfg.get("bf16") or cfg.get("bfloat16") or {}).get("enabled"):
        return "bfloat16"
    if (cfg.get("fp16") or {}).get("enabled"):
        return "float16"
    return "float32"


@dataclass
class NativeInfo:
    files: NativeFiles
    layout: NativeLayout
    ds_version: str | None
    rank0_states: Any = field(default=None, repr=False, compare=False)  # files.model[0] as read here (not read twice)


def describe(path: str, trust_pickle: bool = False, keep_states: bool = False) -> NativeInfo:
    """Stage, world size and precision of the checkpoint at ``path`` (reads only the rank-0 model states; kept in
    ``rank0_states`` with ``keep_states``, for a reader that goes on to read them)."""
    files = native_files(locate(path))
    states = load_ds_file(files.model[0], trust_pickle)
    if isinstance(states, dict):
        check(files.model[0], states, Keys(ds_config=Maybe(DS_CONFIG_READ)))
    ds_config = states.get("ds_config") if isinstance(states, dict) else None
    stage = int(((ds_config or {}).get("zero_optimization") or {}).get("stage", 3 if len(files.model) > 1 else 2))
    if len(files.model) > 1 or ZERO3_MODEL_FILE.match(os.path.basename(files.model[0])):
        stage = 3
    precision = precision_of_config(ds_config)
    if files.bf16_prefix:
        precision = "bfloat16"
    return NativeInfo(files, NativeLayout(files.world_size, stage, precision), states.get("ds_version") if isinstance(states, dict) else None,
                      states if keep_states else None)


# --- flat partitions -----------------------------------------------------------------------------------------
class FlatView:
    """Several 1-D tensors (torch's or torch_zip's stored ones) seen as one vector. Reading copies only the pieces a
    range touches; over ``mapped`` parts (views of mmapped files) the pages read are then released, so RSS stays
    at one tensor."""

    def __init__(self, parts: list[Any], origin: str, mapped: bool = False):
        self.parts = [p.reshape(-1) for p in parts]
        self.origin = origin
        self.mapped = mapped
        self.starts = [0]
        for p in self.parts:
            self.starts.append(self.starts[-1] + p.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def views(self, offset: int, numel: int) -> list[Any]:
        """Elements ``offset .. offset + numel`` as views of the parts, no copy."""
        if offset + numel > self.numel:
            raise CorruptCheckpointError(
                self.origin, f"flat partition holds {self.numel} elements; need {offset + numel} (truncated or wrong shapes)"
            )
        out = []
        for part, start in zip(self.parts, self.starts):
            lo, hi = max(offset, start), min(offset + numel, start + part.numel())
            if lo < hi:
                out.append(part[lo - start : hi - start])
        return out

    def read_into(self, out: torch.Tensor, offset: int, numel: int) -> None:
        """Copy elements ``offset .. offset + numel`` into the 1-D ``out``."""
        if offset + numel > self.numel:
            raise CorruptCheckpointError(
                self.origin, f"flat partition holds {self.numel} elements; need {offset + numel} (truncated or wrong shapes)"
            )
        for part, start in zip(self.parts, self.starts):
            lo, hi = max(offset, start), min(offset + numel, start + part.numel())
            if lo < hi:
                copy_into(out[lo - offset : hi - offset], part[lo - start : hi - start], self.mapped)


@dataclass
class _Param:
    name: str
    shape: tuple[int, ...]
    group: int  # optimizer param group
    flat: int  # ZeRO-1/2: param group; ZeRO-3: sub-group
    offset: int  # ZeRO-1/2: offset in the group's full flat vector; ZeRO-3: offset in each rank's flat vector
    ranks: tuple[int, ...] | None = None  # ZeRO-1/2: the ranks whose partitions make its group's vector (None: all)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _shape(s: Any) -> tuple[int, ...]:
    return tuple(int(d) for d in s)


# What the readers below use of DeepSpeed's files (runtime/engine.py's _save_checkpoint and _save_zero_checkpoint,
# zero/stage_1_and_2.py's and stage3.py's state_dict), checked once each file is loaded
SHAPE = ListOf(int)  # a torch.Size
MODEL_STATES = Keys(
    param_shapes=ListOf(MapOf(str, SHAPE)), frozen_param_shapes=Maybe(MapOf(str, SHAPE)),
    frozen_param_fragments=Maybe(MapOf(str, TENSOR)), buffer_names=Maybe(ListOf(str)), shared_params=Maybe(MapOf(str, str)),
    module=Maybe(MapOf(str, object)), dp_world_size=Maybe(int), global_steps=Maybe(int), num_experts=Maybe(OneOf(int, ListOf(int))),
    ds_config=Maybe(DS_CONFIG_READ),
)
_BASE_STATE = OneOf(TORCH_OPTIMIZER, ListOf(MapOf(str, Maybe(OneOf(TENSOR, NUMBER)))))  # rigid, or elastic (per group)
_ZERO_COMMON = dict(partition_count=OneOf(int, ListOf(int)), param_alignment_paddings=Maybe(ListOf(ListOf(int))))
OPTIM_STATES_ZERO12 = Keys(optimizer_state_dict=Keys(single_partition_of_fp32_groups=ListOf(TENSOR), base_optimizer_state=_BASE_STATE, **_ZERO_COMMON))
OPTIM_STATES_ZERO3 = Keys(optimizer_state_dict=Keys(fp32_flat_groups=ListOf(TENSOR), optimizer_state_dict=_BASE_STATE, **_ZERO_COMMON))


@dataclass
class _Optim:
    """One rank's ZeRO optimizer file, normalised across ZeRO-1/2, BF16_Optimizer and ZeRO-3."""

    path: str
    fp32: list[Any]  # per flat group: torch_zip.StoredTensor (or torch.Tensor)
    state: list[dict[str, Any]]  # per flat group: state key -> tensor / scalar
    param_groups: list[dict[str, Any]]  # torch optimizer param groups (hyper-parameters, "params": flat indices)
    partition_count: int
    alignment_paddings: list[list[int]] | None = None  # ZeRO-1/2 parameter_alignment: padding after each param
    group_partitions: list[int] | None = None  # ZeRO-1/2: ranks each flat group is split over (MoE groups: fewer)
    mapped: bool = False  # its tensors are views of the mmapped file


def _parse_optim(path: str, trust_pickle: bool, zero3: bool) -> _Optim:
    sd = load_ds_file(path, trust_pickle)
    if not isinstance(sd, dict) or not isinstance(sd.get("optimizer_state_dict"), dict):
        raise CorruptCheckpointError(path, "not a ZeRO optimizer file: missing 'optimizer_state_dict'")
    check(path, sd, OPTIM_STATES_ZERO3 if zero3 else OPTIM_STATES_ZERO12)  # every key below there, of its type
    osd = sd["optimizer_state_dict"]
    fp32 = list(osd["fp32_flat_groups"] if zero3 else osd["single_partition_of_fp32_groups"])
    base = osd["optimizer_state_dict"] if zero3 else osd["base_optimizer_state"]
    count = osd["partition_count"]
    if isinstance(count, (list, tuple)) and not count:
        raise CorruptCheckpointError(path, "optimizer_state_dict.partition_count is an empty list, not a rank count")
    per_group = [int(c) for c in count] if isinstance(count, (list, tuple)) else None
    count = max(per_group) if per_group else int(count)
    if isinstance(base, dict):  # a torch optimizer state dict (the default, "rigid" layout)
        groups = base.get("param_groups", [])
        per_flat = [dict(base.get("state", {}).get(i, {})) for i in range(len(fp32))]
    else:  # elastic layout: a list of per-group states, stripped, and one step for all groups
        groups = []
        per_flat = [dict(s) for s in base]
        step = osd.get("base_optimizer_state_step")
        if step is not None:
            for s in per_flat:
                s.setdefault("step", step)
    return _Optim(path, fp32, per_flat, groups, count, osd.get("param_alignment_paddings"), mapped=is_mapped(path), group_partitions=per_group)


# --- reading -------------------------------------------------------------------------------------------------
_DS_KEYS = {
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
    "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
    "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size", "ds_config", "ds_version",
    "checkpoint_parallel_dimensions", "universal_checkpoint_info", "num_experts", "ds_autoep_layers",
}


@dataclass
class DeepSpeedCheckpoint:
    """A parsed ZeRO checkpoint: enough to produce every logical tensor lazily."""

    info: NativeInfo
    model_states: list[dict[str, Any]]
    optims: list[_Optim]
    params: list[_Param] = field(default_factory=list)
    frozen: dict[str, LazyTensor] = field(default_factory=dict)
    buffers: dict[str, LazyTensor] = field(default_factory=dict)


def _params_zero12(ms: dict[str, Any], optims: list[_Optim], path: str) -> list[_Param]:
    shapes = ms["param_shapes"]
    paddings = optims[0].alignment_paddings
    params = []
    for g, group in enumerate(shapes):
        pads = paddings[g] if paddings else [0] * len(group)
        for ranks, rename in _group_owners(ms, optims, g, group, path):
            offset = 0
            for i, (name, shape) in enumerate(group.items()):
                p = _Param(rename(name), _shape(shape), g, g, offset, ranks)
                params.append(p)
                offset += p.numel + (pads[i] if i < len(pads) else 0)
            held = list(ranks if ranks is not None else range(len(optims)))
            sizes = [optims[r].fp32[g].numel() for r in held] if g < len(optims[0].fp32) else [0]
            have = sum(sizes)
            if offset - (pads[-1] if pads else 0) > have:
                raise CorruptCheckpointError(path, f"param group {g} needs {offset} fp32 elements; the {len(held)} rank files "
                                                   f"holding it have {have}")
            # equal partitions, the last stripped of the tail padding: none longer, none but the last shorter, and
            # no more than the parameters and their alignment paddings (a rank's extra elements would shift the next's)
            odd = next((r for r, n in zip(held, sizes) if n > sizes[0] or (n < sizes[0] and r != held[-1])), None)
            if odd is not None or have > offset:
                culprit = optims[odd if odd is not None else held[0]].path
                raise CorruptCheckpointError(culprit, f"param group {g}'s partitions are {sizes} fp32 elements over ranks {held}, "
                                                      f"not equal partitions of its {offset} (the last without its padding)")
    return params


def _group_owners(ms: dict[str, Any], optims: list[_Optim], g: int, group: dict[str, Any], path: str):
    """(ranks, renaming) for each copy of param group ``g`` the ranks hold: one over all ranks, or, for a
    ``deepspeed.moe`` expert group, one per expert-parallel rank (:mod:`.deepspeed_moe`): rank 0's
    ``param_shapes`` names its own experts by local number; the copy of expert-parallel rank e renames them to
    their global numbers, as DeepSpeed's own expert files do."""
    hyper = optims[0].param_groups[g] if g < len(optims[0].param_groups) else {}
    world = len(optims)
    if not hyper.get("moe"):
        return [(None, lambda n: n)]
    ep = _expert_parallel(optims, g)
    for name in group:
        if deepspeed_moe.expert_of(name) is None:
            raise UnsupportedStateError(f"{path}: {name!r} is in expert group {g} ({hyper.get('name')}) but is not named as a "
                                        "deepspeed.moe expert's parameter; interop cannot place it")
    try:
        local = deepspeed_moe.ExpertLayers.of(list(group))  # rank 0's experts: numbered 0..n-1 in each layer
    except ConversionError as exc:
        raise CorruptCheckpointError(path, f"param_shapes of expert group {g}: {exc}") from None
    counts = [int(c) for c in ms.get("num_experts") or []]
    totals = sorted({n * ep for n in local.experts.values()})
    if counts and not set(totals) <= set(counts):
        raise CorruptCheckpointError(path, f"expert group {g} holds {totals} experts per layer over {ep} expert-parallel ranks, "
                                           f"but the model has num_experts {counts}")
    whole = deepspeed_moe.ExpertLayers({p: n * ep for p, n in local.experts.items()}, local.suffixes)

    def renaming(e: int):
        to_global = {on_rank: name for name, on_rank in whole.local(ep, e)}  # the one numbering rule, deepspeed_moe's
        return to_global.__getitem__
    data_before = bool((ms.get("ds_config") or {}).get(deepspeed_moe.DATA_BEFORE_EXPERT))
    return [(ranks, renaming(e)) for e, ranks in enumerate(deepspeed_moe.ep_ranks(world, ep, data_before))]


def _expert_parallel(optims: list[_Optim], g: int | None = None) -> int:
    """Expert-parallel ranks of expert group ``g`` (of the largest, for None): the world over the ranks it is
    split across; 1 for a checkpoint without expert groups."""
    world = len(optims)
    parts = optims[0].group_partitions or [world] * len(optims[0].fp32)
    groups = [g] if g is not None else [i for i, h in enumerate(optims[0].param_groups) if h.get("moe") and i < len(parts)]
    ep = 1
    for i in groups:
        if parts[i] <= 0 or world % parts[i]:
            raise CorruptCheckpointError(optims[0].path, f"expert group {i} is split over {parts[i]} ranks, which does not divide {world}")
        ep = max(ep, world // parts[i])
    return ep


def _params_zero3(ms: dict[str, Any], optims: list[_Optim], world: int) -> list[_Param]:
    group_of_flat: dict[int, int] = {}
    for g, group in enumerate(optims[0].param_groups):
        for flat in group.get("params", []):
            if int(flat) in group_of_flat:
                raise CorruptCheckpointError(optims[0].path, f"optimizer param groups {group_of_flat[int(flat)]} and {g} both list sub-group {flat}")
            group_of_flat[int(flat)] = g
    unlisted = [s for s in range(len(ms["param_shapes"])) if s not in group_of_flat]
    if optims[0].param_groups and unlisted:
        raise CorruptCheckpointError(optims[0].path, f"sub-group {unlisted[0]} is in no optimizer param group")
    params, offset = [], 0  # offsets run on across sub-groups: a rank's sub-group vectors are read as one
    for sub, group in enumerate(ms["param_shapes"]):
        start = offset
        for name, shape in group.items():
            p = _Param(name, _shape(shape), group_of_flat.get(sub, 0), sub, offset)
            params.append(p)
            offset += math.ceil(p.numel / world)
        for o in optims:  # every rank: one with more would shift its later sub-groups' pieces
            have = o.fp32[sub].numel() if sub < len(o.fp32) else 0
            if offset - start != have:
                raise CorruptCheckpointError(o.path, f"sub-group {sub} holds {have} fp32 elements per rank; its parameters need {offset - start}")
            if sub < len(o.fp32) and o.fp32[sub].dtype != optims[0].fp32[sub].dtype:
                raise CorruptCheckpointError(o.path, f"sub-group {sub} is {o.fp32[sub].dtype}, rank 0's {optims[0].fp32[sub].dtype}")
    return params


def frozen_and_buffers(
    model_states: list[dict[str, Any]], path: str, trainable: set[str], zero3: bool
) -> tuple[dict[str, LazyTensor], dict[str, LazyTensor]]:
    """Frozen parameters and buffers from the model-states files (all ranks' for ZeRO-3, else the one)."""
    ms0 = model_states[0]
    module = ms0.get("module") or {}
    shared = dict(ms0.get("shared_params") or {})
    buffer_names = list(ms0.get("buffer_names") or [])
    buffers = {n: lazy_of(module[n], f"{path}:module.{n}") for n in buffer_names if n in module}
    frozen: dict[str, LazyTensor] = {}
    frozen_shapes = ms0.get("frozen_param_shapes")
    if frozen_shapes:
        for name, shape in frozen_shapes.items():
            shape = _shape(shape)
            frags = [ms.get("frozen_param_fragments", {}).get(name) for ms in model_states]
            if any(f is None for f in frags):
                raise CorruptCheckpointError(path, f"frozen parameter {name!r} has no saved fragment")
            numel = math.prod(shape)
            if zero3:
                def load(frags=frags, numel=numel, shape=shape):
                    return torch.cat([as_torch(f).reshape(-1) for f in frags])[:numel].reshape(shape).clone()
            else:
                def load(frag=frags[0], shape=shape):
                    return as_torch(frag).reshape(shape)
            frozen[name] = LazyTensor(TensorSpec(shape, dtype_name_of(frags[0])), load, f"{path}:frozen_param_fragments.{name}")
    elif not zero3:  # ZeRO-1 saves no fragments: frozen parameters are whole in `module`
        for name, t in module.items():
            if name not in trainable and name not in shared and name not in buffer_names:
                frozen[name] = lazy_of(t, f"{path}:module.{name}")
    return frozen, buffers


def read_native(path: str, trust_pickle: bool = False) -> DeepSpeedCheckpoint:
    info = describe(path, trust_pickle, keep_states=True)
    files, world, zero3 = info.files, info.layout.world_size, info.layout.zero_stage == 3
    model_states = []
    rank0, info.rank0_states = info.rank0_states, None  # held by model_states from here
    for i, p in enumerate(files.model):
        ms = rank0 if i == 0 else load_ds_file(p, trust_pickle)
        if not isinstance(ms, dict) or "param_shapes" not in ms:
            raise CorruptCheckpointError(p, "not a DeepSpeed model-states file (no param_shapes)")
        check(p, ms, MODEL_STATES)
        saved_world = ms.get("dp_world_size")
        if saved_world is not None and int(saved_world) != world:
            raise TopologyError(f"{p}: saved by {saved_world} ranks, but the directory holds {world} optimizer files (two world sizes mixed)")
        if model_states and (ms.get("global_steps"), ms.get("global_samples")) != (rank0.get("global_steps"), rank0.get("global_samples")):
            raise CorruptCheckpointError(p, f"is step {ms.get('global_steps')!r} ({ms.get('global_samples')!r} samples), rank 0's "
                                            f"{rank0.get('global_steps')!r} ({rank0.get('global_samples')!r}): rank files of different saves")
        model_states.append(ms)
    # each rank's file parsed on its own thread: most of a parse is waiting for its blocks' digests
    optims = list(at_once(_parse_optim, [(p, trust_pickle, zero3) for p in files.optim], "deepspeed-read"))
    for o in optims:
        if o.partition_count != world:
            raise TopologyError(f"{o.path}: written by a run of {o.partition_count} ranks; the directory has {world} optimizer files (two world sizes mixed)")
        if len(o.fp32) != len(optims[0].fp32):
            raise CorruptCheckpointError(o.path, f"{len(o.fp32)} flat groups; rank 0 has {len(optims[0].fp32)}")
    ckpt = DeepSpeedCheckpoint(info, model_states, optims)
    ms0 = model_states[0]
    ckpt.params = _params_zero3(ms0, optims, world) if zero3 else _params_zero12(ms0, optims, files.model[0])
    if any(g.get("moe") for g in optims[0].param_groups):
        for layer, experts in enumerate(ms0.get("num_experts") or []):
            for e in range(int(experts)):
                f = os.path.join(files.tag_dir, deepspeed_moe.expert_file(layer, e))
                if not os.path.isfile(f):
                    raise MissingFileError(f, f"missing: DeepSpeed's loader reads each of MoE layer {layer}'s {experts} experts "
                                              "from its own file")
    ckpt.frozen, ckpt.buffers = frozen_and_buffers(model_states, files.model[0], {p.name for p in ckpt.params}, zero3)
    return ckpt


def param_shapes(path: str, trust_pickle: bool = False) -> list[dict[str, tuple[int, ...]]]:
    """The flat groups' parameter names and shapes, in order: what must match the engine that loads it."""
    files = native_files(locate(path))
    ms = load_ds_file(files.model[0], trust_pickle)
    return [{n: _shape(s) for n, s in g.items()} for g in ms["param_shapes"]]


def _param_tensor(ckpt: DeepSpeedCheckpoint, p: _Param, flats: list[FlatView]) -> torch.Tensor:
    """``flats``: per rank (ZeRO-3) or one concatenation over ranks (ZeRO-1/2) of the vectors holding ``p``."""
    out = torch.empty(p.numel, dtype=dtype_from_name(dtype_name_of(flats[0].parts[0])))
    done = 0
    for f, offset, n in _param_ranges(ckpt, p, flats):
        f.read_into(out[done : done + n], offset, n)
        done += n
    return out.reshape(p.shape)


def _param_ranges(ckpt: DeepSpeedCheckpoint, p: _Param, flats: list[FlatView]) -> list[tuple[FlatView, int, int]]:
    """(flat, offset, numel) pieces that make up ``p`` in order."""
    if ckpt.info.layout.zero_stage != 3:
        return [(flats[0], p.offset, p.numel)]
    per_rank, done, out = math.ceil(p.numel / len(flats)), 0, []  # rank r holds r*c .. (r+1)*c, the last rank's tail padding
    for f in flats:
        n = min(per_rank, p.numel - done)
        if n > 0:
            out.append((f, p.offset, n))
            done += n
    return out


def _param_views(ckpt: DeepSpeedCheckpoint, p: _Param, key: str | None) -> list[Any]:
    return [v for f, offset, n in _param_ranges(ckpt, p, _flats(ckpt, p, key)) for v in f.views(offset, n)]


def _mapped_pieces(ckpt: DeepSpeedCheckpoint, p: _Param, key: str | None):
    """LazyTensor.mapped_pieces for ``p``, when every rank file is memory-mapped (torch's zip format)."""
    if not all(o.mapped for o in ckpt.optims):
        return None
    return lambda: [piece_of(v, mapped=True) for v in _param_views(ckpt, p, key)]


def _flats(ckpt: DeepSpeedCheckpoint, p: _Param, key: str | None) -> list[FlatView]:
    """The vectors holding ``p``'s fp32 weights (key None) or optimizer state ``key``."""
    zero3 = ckpt.info.layout.zero_stage == 3

    def vector(o: _Optim, flat: int) -> Any:
        if key is None:
            return o.fp32[flat]
        t = o.state[flat][key]
        return t.reshape(-1)[: o.fp32[flat].numel()]  # ZeRO-1/2 keep state unstripped: trim to the fp32 part

    if zero3:
        return [FlatView([vector(o, f) for f in range(len(o.fp32))], o.path, o.mapped) for o in ckpt.optims]
    owners = [ckpt.optims[r] for r in p.ranks] if p.ranks is not None else ckpt.optims
    return [FlatView([vector(o, p.flat) for o in owners], owners[0].path, all(o.mapped for o in owners))]


def _state_layout(ckpt: DeepSpeedCheckpoint) -> tuple[list[str], dict[int, dict[str, Any]]]:
    """Tensor state keys sliced per parameter, and per flat group the scalar state (step, ...)."""
    tensor_keys: set[str] = set()
    scalars: dict[int, dict[str, Any]] = {}
    for o in ckpt.optims:
        for flat, state in enumerate(o.state):
            for key, value in state.items():
                if is_tensor(value) and value.dim() > 0:
                    if value.numel() < o.fp32[flat].numel():
                        raise UnsupportedStateError(
                            f"{o.path}: optimizer state {key!r} of group {flat} has {value.numel()} elements, "
                            f"not one per parameter element ({o.fp32[flat].numel()}); interop does not know how to split it"
                        )
                    tensor_keys.add(key)
                elif is_tensor(value) or isinstance(value, (int, float)):
                    scalars.setdefault(flat, {})[key] = value
                else:
                    raise UnsupportedStateError(
                        f"{o.path}: optimizer state {key!r} of group {flat} is a {type(value).__name__}; "
                        "only tensors and numbers are supported"
                    )
    for o in ckpt.optims:
        for flat, state in enumerate(o.state):
            absent = tensor_keys - set(state)
            if absent:  # every flat group is stepped whole (a parameter without a gradient steps on zeros)
                raise CorruptCheckpointError(o.path, f"group {flat} lacks optimizer state {sorted(absent)} that other groups have")
            flat_key = next((k for k in tensor_keys if not (is_tensor(state[k]) and state[k].dim() > 0)), None)
            if flat_key is not None:
                raise CorruptCheckpointError(o.path, f"optimizer state {flat_key!r} of group {flat} is a "
                                                     f"{type(state[flat_key]).__name__}; other groups hold a tensor of it")
    return sorted(tensor_keys), scalars


def _optimizer(ckpt: DeepSpeedCheckpoint) -> OptimizerState:
    tensor_keys, scalars = _state_layout(ckpt)
    o0 = ckpt.optims[0]
    by_group: dict[int, list[str]] = {}
    for p in ckpt.params:
        by_group.setdefault(p.group, []).append(p.name)
    groups = []
    for g, group in enumerate(o0.param_groups or [{}] * (max(by_group, default=-1) + 1)):
        hyper = {k: materialize(v) for k, v in group.items() if k != "params"}  # a tensor lr: torch's, not a stand-in
        groups.append({**hyper, "params": by_group.get(g, [])})
    tensors: dict[str, dict[str, LazyTensor]] = {}
    for key in tensor_keys:
        tensors[key] = {}
        for p in ckpt.params:
            if key not in o0.state[p.flat]:
                continue  # this group has not stepped yet
            tensors[key][p.name] = LazyTensor(
                TensorSpec(p.shape, dtype_name_of(o0.state[p.flat][key])),
                lambda p=p, key=key: _param_tensor(ckpt, p, _flats(ckpt, p, key)),
                f"{o0.path}:{key}",
                mapped_pieces=_mapped_pieces(ckpt, p, key),
            )
    scalar_out: dict[str, dict[str, dict[str, Any]]] = {}
    for p in ckpt.params:
        for key, value in scalars.get(p.flat, {}).items():
            t = value if is_tensor(value) else torch.tensor(value)
            scalar_out.setdefault(key, {})[p.name] = scalar_entry(t)
    return OptimizerState("AdamW", groups, tensors, scalar_out)


def _client_state(ms: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in ms.items() if k not in _DS_KEYS}


def read_deepspeed(path: str, trust_pickle: bool = False, verify_digests: bool = True,
                   config: dict[str, Any] | None = None) -> LogicalCheckpoint:
    """A ZeRO checkpoint (DeepSpeed's, accelerate's ``pytorch_model`` tag, or our trainer's) as a logical one;
    ours is checked against its manifest before any file is unpickled."""
    directory = resolve_checkpoint_dir(path)  # ours: a checkpoint, or a root whose 'latest' names one
    manifest = open_checkpoint(directory, verify_digests) if os.path.isfile(os.path.join(directory, MANIFEST)) else None
    if manifest is not None:
        path = native_dir(directory, manifest, NATIVE_KEY)
    else:  # pointed at the engine's directory (or a tag) inside one of ours: still checked against its manifest
        engine_dir = os.path.dirname(locate(path))
        manifest, owner = owning_checkpoint(engine_dir, NATIVE_KEY, verify_digests)
        directory = owner if manifest is not None else directory
    ckpt = read_native(path, trust_pickle)
    trainable = {
        p.name: LazyTensor(TensorSpec(p.shape, "float32"), lambda p=p: _param_tensor(ckpt, p, _flats(ckpt, p, None)),
                           f"{ckpt.optims[0].path}:fp32", mapped_pieces=_mapped_pieces(ckpt, p, None))
        for p in ckpt.params
    }
    layout = ckpt.info.layout
    source = {
        "format": "deepspeed",
        "zero_stage": layout.zero_stage,
        "world_size": layout.world_size,
        "dtype": layout.precision,
        "master_dtype": "float32",
        "ds_version": ckpt.info.ds_version,
        "tag": os.path.basename(os.path.normpath(ckpt.info.files.tag_dir)),
    }
    ep = _expert_parallel(ckpt.optims) if layout.zero_stage != 3 else 1
    if ep > 1:
        source["ep_size"] = ep
    if ckpt.model_states[0].get("num_experts") and any(g.get("moe") for g in ckpt.optims[0].param_groups):
        source["num_experts"] = [int(n) for n in ckpt.model_states[0]["num_experts"]]  # per deepspeed.moe layer
    return to_logical(ckpt.model_states[0], trainable, ckpt.frozen, ckpt.buffers, _optimizer(ckpt), source,
                      ckpt.info.files.tag_dir, manifest, directory, root=path, config=config)


def to_logical(
    ms0: dict[str, Any],
    trainable: dict[str, LazyTensor],
    frozen: dict[str, LazyTensor],
    buffers: dict[str, LazyTensor],
    optimizer: OptimizerState,
    source: dict[str, Any],
    tag_dir: str,
    manifest: Manifest | None = None,
    directory: str = "",
    root: str | None = None,
    native_key: str = NATIVE_KEY,
    config: dict[str, Any] | None = None,
) -> LogicalCheckpoint:
    """The logical checkpoint of DeepSpeed files: ``ms0`` (rank 0's model states) gives ties, the step, the
    scheduler and client state; ``manifest`` (of our checkpoint at ``directory`` around them) adds the rest."""
    model = {**trainable, **frozen, **buffers}
    shared = dict(ms0.get("shared_params") or {})
    for alias, src in shared.items():
        if src in model:
            model[alias] = model[src]
    model_info = (manifest.model if manifest is not None else None) or {}
    config = config or model_info.get("config") or config_near(tag_dir, root or tag_dir)
    tied = [[alias, src] for alias, src in shared.items()] or tied_groups(config)
    components = carried_components(directory, manifest, native_key)
    step = manifest.step if manifest is not None else ms0.get("global_steps")
    notes = []
    client = _client_state(ms0)
    if client:
        notes.append(f"DeepSpeed client state keys {sorted(client)} are carried as component 'client_state'")
    out = LogicalCheckpoint(
        model=model,
        config=config,
        optimizer=optimizer,
        components=components,
        source=source,
        topology=manifest.topology if manifest is not None else None,
        tied=tied,
        frozen=sorted(frozen),
        step=int(step) if step is not None else None,
        notes=notes,
    )
    if client:
        out.extra_state["client_state"] = materialize(client)
    if ms0.get("lr_scheduler") is not None and "scheduler" not in components:
        out.extra_state["lr_scheduler"] = materialize(ms0["lr_scheduler"])
    return out
