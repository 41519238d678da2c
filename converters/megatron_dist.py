"""Megatron's ``torch_dist`` checkpoint format (``--ckpt-format torch_dist``, megatron-core's dist_checkpointing).

One directory (``iter_XXXXXXX/`` under a ``latest_checkpointed_iteration.txt``, or on its own) holds:

- ``metadata.json``: ``{"sharded_backend": "torch_dist", ...}``;
- ``common.pt``: what is not sharded (``args``, ``iteration``, the optimizer's param groups and common step);
- torch.distributed.checkpoint data: every tensor as one global tensor whatever the TP x PP of the run, the
  decoder's layers stacked on a leading dimension (``decoder.layers.self_attention.linear_qkv.weight`` is
  ``[layers, (heads + 2 groups) x head_dim, hidden]``), fused tensors in their TP=1 layout (QKV by query
  group, SwiGLU's fc1 ``[gate; up]``), norms under Transformer Engine's names, the vocabulary padded, Adam's
  moments under ``optimizer.state.<key>.<name>``, each linear layer's ``_extra_state`` as one object per layer
  (``<name>/shard_<layer>_<layers>``), each TP x PP rank's RNG as ``rng_state/shard_<p>.<t>_<PP>.<TP>``, and with
  the distributed optimizer either its ``fully_reshardable`` tensors (``optimizer.state.param.<name>`` and the
  moments) or its ``dp_reshardable`` flat buckets (``megatron_buckets``).

The same rules as the legacy format map each tensor to Hugging Face names (``megatron_map``), with one
tensor-parallel piece: the stored tensor. Reading is lazy (one layer's slice at a time); writing goes through
torch's own ``dcp.save`` with whole tensors, which megatron-core loads onto any TP x PP.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable

from interop.lazy_import import torch

from interop.commit import durable_write
from interop.sharding import ShardingMetadata, Strategy
from interop.dtypes import dtype_name
from interop.errors import ConversionError, CorruptCheckpointError, MissingFileError
from interop.logical import DeferredList, DeferredMapping, DeferredScalars, LogicalCheckpoint, OptimizerState
from interop.structure import Absent, Keys, ListOf, MapOf, Maybe, OneOf, check
from interop.tensors import LazyTensor, TensorSpec
from interop.universal import scalar_entry

from . import megatron_buckets as buckets
from .megatron_buckets import CHAINED  # chained_<i>.optimizer.state.<key>.<name> for the i-th optimizer
from .dcp import DCPReader, write_dcp
from .engine_checkpoint import RNG, Written, carried_components, component_state, owning_checkpoint, rank_rng_states, write_engine_checkpoint
from .megatron import (
    CHECKPOINT_VERSION, PADDING, SCHEDULER, TRACKER, MergedCache, _nonzero, hf_config, hf_shapes, hf_tensors, hf_values,
    MEGATRON_ARGS, expert_parallel_size, expert_tensor_parallel_size, is_no_decay, load_megatron_file, megatron_hyper, norm_eps_notes, note_unmapped, padding_rows,
    mtp_stages, pipeline_split, target_shape,
)
from .megatron_arch import MegatronArch
from .megatron_pipeline import PipelineSplit, recorded_flags
from .megatron_rng import DEFAULT_SEED, megatron_rng_states, our_rng
from .pickle_safety import numpy_allowlist
from .torch_zip import NUMBER, TENSOR, as_torch, is_tensor, materialize
from .megatron_map import (
    EXPERTS, LAYER_PREFIX, MTP_PREFIX, VOCAB, Rule, expert_index, extra_state_key, is_expert, layer_of, megatron_pieces, merge, mtp_copies,
    parameters, rules, stack_index, stacked_experts,
)
from .megatron_pieces import RankPieces, fused_dtype
from .stacked_experts import per_expert, restacked
from .detection import METADATA_JSON, is_megatron_dist, locate_torch_dist as locate, torch_dist_backend as _backend  # noqa: F401

log = logging.getLogger(__name__)

COMMON = "common.pt"
# What the reader uses of common.pt: the arguments, the iteration, and each of megatron-core's optimizers' param
# groups (a mixed-precision optimizer's one level down; a MoE's chained ones keyed 0 and 1); checked once loaded
# (each key where present: the distributed optimizer's holds only its param_state_sharding_type here)
_TORCH_PART = Keys(param_groups=Absent(ListOf(Keys(wd_mult=Maybe(NUMBER), weight_decay=Maybe(NUMBER), step=Absent(OneOf(NUMBER, TENSOR))))),
                   state=Maybe(Keys(common_step=Maybe(OneOf(NUMBER, TENSOR)))))
_PART = Keys(_TORCH_PART, optimizer=Absent(_TORCH_PART), param_state_sharding_type=Absent(str))
# the optimizer entry is one part, or a MoE's chained parts (:func:`_is_chained`): told apart before it is checked,
# since a chained dict's integer keys would pass unchecked as a part's other keys
COMMON_STATE = Keys(args=Maybe(MEGATRON_ARGS), iteration=Maybe(int), optimizer=Maybe(dict))
BACKEND = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}
OPTIM_PREFIX = "optimizer.state."
MASTER = "fp32_param"  # megatron-core's mixed-precision optimizer: optimizer.state.fp32_param.<model key>
DIST_MASTER = "param"  # its DistributedOptimizer, 'fully_reshardable': optimizer.state.param.<model key> (fp32)
FULLY_RESHARDABLE = "fully_reshardable"
RNG_STATE = "rng_state"  # Megatron-LM's per TP x PP rank object: rng_state/shard_<p>.<t>_<PP>.<TP>


NATIVE_KEY = "megatron_dist"  # the native component of our checkpoint around a torch_dist iteration directory


@dataclass(frozen=True)
class StoredKeys:
    """How torch_dist names and stacks a model's tensors. By default megatron-core stacks the layers:
    ``decoder.layers.<i>.x`` is row i of ``decoder.layers.x``, and an expert's
    ``decoder.layers.<i>.mlp.experts.local_experts.<e>.x`` is [i, e] of ``decoder.layers.mlp.experts.experts.x``
    (whatever the expert-parallel size). ``per_layer``: its non-homogeneous layers (a MoE model with dense layers
    first, ``--moe-layer-freq`` a pattern): each layer's own keys, ``decoder.layers.<i>.x``, the experts stacked in
    ``decoder.layers.<i>.mlp.experts.experts.x``."""

    per_layer: bool = False

    @classmethod
    def of(cls, args: dict[str, Any]) -> "StoredKeys":
        """megatron-core's TransformerBlock.sharded_state_dict: per-layer keys where --moe-layer-freq is a pattern
        (Megatron-LM's args hold it parsed, a list) or every N-th layer (N > 1)."""
        freq = args.get("moe_layer_freq", 1)
        return cls(isinstance(freq, (list, tuple)) or (isinstance(freq, int) and not isinstance(freq, bool) and freq > 1))

    def name(self, megatron: str) -> str:
        head, found, rest = megatron.partition(EXPERTS)
        if found:  # every expert's tensor of a layer in one: ...mlp.experts.experts.x
            megatron = f"{head}mlp.experts.experts.{rest.split('.', 1)[1]}"
        if not megatron.startswith(LAYER_PREFIX) or self.per_layer:
            return megatron
        return LAYER_PREFIX + megatron[len(LAYER_PREFIX):].split(".", 1)[1]

    def index(self, megatron: str) -> tuple[int, ...]:
        """Where the tensor lies in its stored tensor's leading (stacking) dimensions."""
        index = stack_index(megatron)
        return index[1:] if self.per_layer and layer_of(megatron) is not None else index

    def stacking(self, megatron: str, arch: MegatronArch) -> tuple[tuple[str, int], ...]:
        """The stored tensor's leading dimensions (what they count, how many): the layers, unless per layer or in an
        MTP layer (megatron-core stacks neither), and a layer's experts."""
        layers = (("layers", arch.num_layers),) if layer_of(megatron) is not None and not self.per_layer else ()
        return layers + ((("experts", arch.experts),) if expert_index(megatron) is not None else ())

    def extra_states(self, all_rules: list[Rule], arch: MegatronArch) -> list[str]:
        """The keys of megatron-core's linears' extra states (None without FP8), each a ShardedObject stored as
        ``<key>/shard_<offset>_<shape>`` with the layer (and expert) stacking as its offset and shape."""
        out = []
        for rule in all_rules:
            key = extra_state_key(rule.megatron)
            if key is None or not key.startswith((LAYER_PREFIX, MTP_PREFIX)):
                continue
            index, shape = self.index(rule.megatron), tuple(n for _, n in self.stacking(rule.megatron, arch))
            offset, shape = (index, shape) if index else ((0,), (1,))
            out.append(f"{self.name(key)}/shard_{'.'.join(map(str, offset))}_{'.'.join(map(str, shape))}")
        return out


# --- where a checkpoint is ----------------------------------------------------------------------------------
# --- reading ------------------------------------------------------------------------------------------------
def read_megatron_dist(path: str, trust_pickle: bool = False, verify_digests: bool = True) -> LogicalCheckpoint:
    directory = locate(path)
    manifest, owner = owning_checkpoint(directory, NATIVE_KEY, verify_digests)  # ours: checked first
    backend = _backend(directory)
    if not backend or backend.get("sharded_backend") != "torch_dist":
        raise CorruptCheckpointError(os.path.join(directory, METADATA_JSON), f"is not a torch_dist checkpoint ({backend})")
    common_path = os.path.join(directory, COMMON)
    if not os.path.isfile(common_path):
        raise MissingFileError(common_path, "missing: torch_dist keeps args and iteration there")
    common = load_megatron_file(common_path, trust_pickle, stored=True)  # its tensors (a step) read without torch
    if not isinstance(common, dict):
        raise CorruptCheckpointError(common_path, f"is a {type(common).__name__}, not megatron-core's common state dict")
    check(common_path, common, COMMON_STATE)
    if common.get("optimizer"):
        check(common_path, common["optimizer"], MapOf(int, _PART) if _is_chained(common["optimizer"]) else _PART, "optimizer")
    args = common.get("args")
    if args is None:
        raise CorruptCheckpointError(common_path, "holds no 'args': the model's shape is unknown")
    args_d = vars(args) if not isinstance(args, dict) else args
    arch = MegatronArch.from_args(args_d, common_path, grouped_gemm=True)  # stored as SequentialMLP's
    reader = DCPReader(directory)
    stored = set(reader.tensor_keys())
    all_rules = rules(arch)
    params = parameters(all_rules)  # what the optimizer holds: not the buffers (a router's expert bias)
    keys = StoredKeys.of(args_d)
    names = {r.megatron: next((keys.name(n) for n in (r.megatron, *r.aliases) if keys.name(n) in stored), None) for r in all_rules}
    missing = [r.megatron for r in all_rules if names[r.megatron] is None]
    if missing:
        raise CorruptCheckpointError(directory, f"holds no {keys.name(missing[0])} ({len(missing)} tensors missing)")
    padded = reader.spec(names[all_rules[0].megatron]).shape[0]
    if args_d.get("padded_vocab_size") and int(args_d["padded_vocab_size"]) != padded:
        raise CorruptCheckpointError(directory, f"embedding has {padded} rows, but args.padded_vocab_size is {args_d['padded_vocab_size']}")
    cache = MergedCache()
    padding: dict[str, Any] = {}  # the padded vocabulary rows, as stand-ins where one chunk holds them

    def full_shape(rule: Rule) -> tuple[int, ...]:
        key = next(keys.name(n) for n in (rule.megatron, *rule.aliases) if keys.name(n) in stored)
        return tuple(reader.spec(key).shape[len(keys.index(rule.megatron)):])

    def check_stacking(rule: Rule, key: str) -> None:
        spec = reader.spec(key)
        for (what, expected), held in zip(keys.stacking(rule.megatron, arch), spec.shape):
            if held != expected:
                raise CorruptCheckpointError(directory, f"{key} stacks {held} {what}; args say {expected}")

    def stored_full(rule: Rule, key: str) -> torch.Tensor:
        spec, index = reader.spec(key), keys.index(rule.megatron)
        if not index:
            return reader.read(key)
        n = len(index)
        check_stacking(rule, key)
        return reader.read(key, index + (0,) * (len(spec.shape) - n), (1,) * n + tuple(spec.shape[n:])).reshape(spec.shape[n:])

    def lazy_for(rule: Rule, key: str, tag: str) -> dict[str, LazyTensor]:
        spec = reader.spec(key)
        shape = tuple(spec.shape[len(keys.index(rule.megatron)):])
        if rule.split == VOCAB and shape[0] > arch.vocab:
            region = ((arch.vocab, 0), (shape[0] - arch.vocab, shape[1]))
            rows = reader.view(key, *region)
            padding[f"{tag}/{rule.megatron}"] = rows if rows is not None else reader.read(key, *region)
        # each layer's chunks as views of the data files: a tensor whose rows lie whole in them is copied file to file
        # (its stacking checked against the args first, as the torch path checks it)
        check_stacking(rule, key)
        tiles = reader.tiles(key, keys.index(rule.megatron))
        return hf_tensors(rule, [lambda: stored_full(rule, key)], arch, f"{directory}[{key}]", cache, tag, spec.dtype_name,
                          hf_shapes(rule, arch, shape, f"{directory}[{key}]"), tiles=tiles)

    # bf16 / fp16 runs: the optimizer's fp32 main params are the weights' truth (the model's are their rounding)
    if common.get("optimizer") is not None and not isinstance(common["optimizer"], dict):
        raise CorruptCheckpointError(common_path, f"optimizer entry is a {type(common['optimizer']).__name__}, not Megatron's state dict")
    sharding_type = _sharding_type(common.get("optimizer") or {}, common_path)
    if sharding_type not in (None, FULLY_RESHARDABLE, buckets.DP_RESHARDABLE):
        raise ConversionError(f"{common_path}: the distributed optimizer's {sharding_type!r} layout is not supported; "
                              f"save with --dist-ckpt-optim-fully-reshardable ({FULLY_RESHARDABLE}) or --ckpt-format torch")
    model: dict[str, LazyTensor] = {}
    if sharding_type == buckets.DP_RESHARDABLE:  # flat buckets per TP x PP rank: the same TP x PP as the args
        tp, pp, ep = (int(args_d.get(a) or 1) for a in ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                                                         "expert_model_parallel_size"))
        etp = expert_tensor_parallel_size(arch, tp, ep, args_d.get("expert_tensor_parallel_size"), common_path)
        mtp_stages(arch, pp, f"{common_path}: dp_reshardable buckets")
        regions = buckets.read_layout(reader, arch, tp, pipeline_split(arch, pp, args_d, common_path), ep, full_shape, lambda r: stored_full(r, names[r.megatron]),
                                      directory, args_d, etp)

        def lazy_flat(rule: Rule, skey: str, tag: str) -> dict[str, LazyTensor]:
            pieces = [lambda r=r: buckets.region_tensor(reader, r, skey) for r in regions[rule.megatron]]
            shape = full_shape(rule)
            if rule.split == VOCAB and shape[0] > arch.vocab:
                padding[f"{tag}/{rule.megatron}"] = merge(rule, [p() for p in pieces])[arch.vocab:].clone()
            return hf_tensors(rule, pieces, arch, f"{directory}[{regions[rule.megatron][0].bucket}.{skey}]", cache, tag,
                              "float32", hf_shapes(rule, arch, shape, directory))

        has_master = True
        for rule in all_rules:
            model.update(lazy_for(rule, names[rule.megatron], "model") if rule.buffer else lazy_flat(rule, "param", "master"))
        prefixes = buckets.part_prefixes(arch, ep)
        split = dense_and_experts(params) if len(prefixes) == 2 else [params]
        parts = [({"param_groups": buckets.param_groups(reader, prefix, directory)}, rs) for prefix, rs in zip(prefixes, split)]
        optimizer = _optimizer(reader, parts, names, ["exp_avg", "exp_avg_sq"], lambda rule, skey: lazy_flat(rule, skey, f"optim:{skey}"),
                               common_path, keys)
    else:
        parts = _chained_parts(common.get("optimizer") or {}, params, common_path)
        prefixed = len(parts) > 1 and any(k.startswith(CHAINED) for k in stored)  # megatron-core's, unless told not to

        def optim_key(rule: Rule, what: str) -> str:
            part = int(is_expert(rule)) if prefixed else None  # the parts: dense (0), experts (1)
            return (f"{CHAINED}{part}." if part is not None else "") + f"{OPTIM_PREFIX}{what}.{names[rule.megatron]}"

        master_key = DIST_MASTER if sharding_type == FULLY_RESHARDABLE else MASTER
        masters = {r.megatron: optim_key(r, master_key) for r in params}
        has_master = all(k in stored for k in masters.values())
        # the first weight is what a writer asks for first (every target leads with the model): its bytes are hashed
        # while the rest is planned (numpy's import and the row plans), not after
        reader.start_checks(masters[all_rules[0].megatron] if has_master else names[all_rules[0].megatron])
        for rule in all_rules:
            master = has_master and not rule.buffer
            model.update(lazy_for(rule, masters[rule.megatron], "master") if master else lazy_for(rule, names[rule.megatron], "model"))
        master_keys = {MASTER, DIST_MASTER} if sharding_type == FULLY_RESHARDABLE else {MASTER}
        unprefixed = [k.split(".", 1)[1] if k.startswith(CHAINED) else k for k in stored]
        state_keys = sorted({k[len(OPTIM_PREFIX):].split(".", 1)[0] for k in unprefixed if k.startswith(OPTIM_PREFIX)} - master_keys)

        def state_lazy(rule: Rule, skey: str) -> dict[str, LazyTensor]:
            key = optim_key(rule, skey)
            return lazy_for(rule, key, f"optim:{skey}") if key in stored else {}

        optimizer = _optimizer(reader, parts, names, state_keys, state_lazy, common_path, keys)
    step = int(common.get("iteration") or 0)
    extra: dict[str, Any] = {}
    if any(_nonzero(t) for t in padding.values()):  # built with torch for a target that keeps them (as the legacy reader)
        extra[PADDING] = DeferredMapping(lambda: {k: as_torch(t).clone() for k, t in padding.items()})
    if common.get(SCHEDULER) is not None:
        extra[SCHEDULER] = materialize(common[SCHEDULER])
    layout = {k: int(args_d.get(a) or 1) for k, a in (("tp", "tensor_model_parallel_size"), ("pp", "pipeline_model_parallel_size"),
                                                      ("ep", "expert_model_parallel_size"))}
    rng_keys = _rng_keys(reader, layout["tp"], layout["pp"])
    etp_arg = args_d.get("expert_tensor_parallel_size")  # the experts' own TP size, where the run set one

    def rng_states() -> list[dict[str, Any]]:
        found = _rng_states(reader, rng_keys)
        if found is None:  # every rank's entry is there, in a shape not Megatron's: said, not carried as no state
            raise CorruptCheckpointError(directory, f"{RNG_STATE} entries are not megatron-core's per-rank RNG states")
        return found

    rng = DeferredList(rng_states) if rng_keys is not None else None
    pipeline = recorded_flags({**args_d, "num_layers": arch.num_layers}, common_path)
    config = hf_config(arch, args_d)
    model.update({copy: model[main] for copy, main in mtp_copies(arch).items()})  # as a hub checkpoint keeps them
    return restacked(LogicalCheckpoint(
        model=model, config=config, optimizer=optimizer, notes=norm_eps_notes(arch, config),
        source={"format": "megatron-dist", **layout, "world_size": int(args_d.get("world_size") or layout["tp"] * layout["pp"]),
                "dtype": reader.spec(names[all_rules[0].megatron]).dtype_name, "iteration": step,
                **({"master_dtype": "float32"} if has_master else {}), **({"pipeline": pipeline} if pipeline else {}),
                **({"etp": etp_arg} if arch.experts and isinstance(etp_arg, int) and etp_arg != layout["tp"] else {})},
        tied=[["lm_head.weight", all_rules[0].hf[0]]] if arch.tied else [], step=step, extra_state=extra,
        rank_state={RNG: rng} if rng is not None else {},
        components=carried_components(owner, manifest, NATIVE_KEY),
        topology=manifest.topology if manifest is not None else None,
    ), stacked_experts(arch))


def _rng_key(p: int, t: int, pp: int, tp: int) -> str:
    """Megatron-LM's get_rng_state: ShardedObject('rng_state', [state], (PP, TP), (p, t))."""
    return f"{RNG_STATE}/shard_{p}.{t}_{pp}.{tp}"


def _rng_keys(reader: DCPReader, tp: int, pp: int) -> list[str] | None:
    """Each TP x PP rank's RNG entry (rank t + tp x p), when the checkpoint has them all."""
    keys = [_rng_key(p, t, pp, tp) for p in range(pp) for t in range(tp)]
    return keys if set(keys) <= set(reader.object_keys()) else None


def _rng_states(reader: DCPReader, keys: list[str]) -> list[dict[str, Any]] | None:
    """The ranks' generators of ``keys`` in our RNG layout; None if one is not in Megatron's shape."""
    out = []
    for key in keys:
        saved = reader.read_object(key, numpy_allowlist())  # [the rank's rng_state list], the list holding one replica's state
        entry = our_rng(saved[0][0]) if isinstance(saved, list) and saved and isinstance(saved[0], list) and len(saved[0]) == 1 else None
        if entry is None:
            return None
        out.append(entry)
    return out


def dense_and_experts(all_rules: list[Rule]) -> list[list[Rule]]:
    """The parameters of a MoE model's two chained optimizers: the dense ones', the experts'."""
    return [[r for r in all_rules if not is_expert(r)], [r for r in all_rules if is_expert(r)]]


def _is_chained(saved: dict) -> bool:
    """common.pt's optimizer entry is megatron-core's ChainedOptimizer's (a MoE model's parts, keyed 0 and 1)."""
    return bool(saved) and all(isinstance(k, int) for k in saved)


def _sharding_type(saved: dict, common_path: str) -> str | None:
    """The distributed optimizer's layout common.pt names (None: megatron-core's own optimizer): a ChainedOptimizer's
    (a MoE model's dense and expert optimizers) each name it, the same."""
    if _is_chained(saved):
        kinds = {part.get("param_state_sharding_type") if isinstance(part, dict) else None for part in saved.values()}
        if len(kinds) != 1:
            raise CorruptCheckpointError(common_path, f"optimizer chains parts of different layouts: {sorted(map(str, kinds))}")
        return kinds.pop()
    return saved.get("param_state_sharding_type")


def _chained_parts(saved: Any, all_rules: list[Rule], common_path: str) -> list[tuple[dict[str, Any], list[Rule]]]:
    """The optimizer's state dicts and the parameters each holds. A MoE model's is megatron-core's
    ChainedOptimizer: ``{0: dense optimizer's, 1: expert optimizer's}`` (get_megatron_optimizer keeps expert
    parameters in an optimizer of their own); any other one optimizer for every parameter."""
    if isinstance(saved, dict) and _is_chained(saved):
        if not all(isinstance(part, dict) for part in saved.values()):
            raise CorruptCheckpointError(common_path, "optimizer chains parts that are not megatron-core's optimizer state dicts")
        split = dense_and_experts(all_rules)
        if sorted(saved) != [0, 1] or not split[1]:
            raise CorruptCheckpointError(common_path, f"optimizer chains {len(saved)} optimizers; megatron-core chains a "
                                         "MoE model's dense and expert optimizers (2), and a dense model's none")
        return [(saved[0], split[0]), (saved[1], split[1])]
    return [(saved, all_rules)]


def _optimizer(reader, parts: list[tuple[dict[str, Any], list[Rule]]], names, state_keys: list[str],
               state_lazy: Callable[[Rule, str], dict[str, LazyTensor]], common_path: str, keys: StoredKeys) -> OptimizerState | None:
    """Adam's state by Hugging Face name: ``state_lazy(rule, key)`` gives a rule's tensors of one state key; each
    part holds the param groups (and the step) of one of megatron-core's optimizers and the rules it holds."""
    if not state_keys:
        return None
    tensors: dict[str, dict[str, LazyTensor]] = {}
    param_groups: list[dict[str, Any]] = []
    step = None
    for saved, part_rules in parts:
        if isinstance(saved.get("optimizer"), dict) and "param_groups" not in saved:
            saved = saved["optimizer"]  # Float16OptimizerWithFloat16Params: the torch optimizer's dict one level down
        groups = saved.get("param_groups")
        members: list[list[str]] = [[], []]
        for rule in part_rules:
            for skey in state_keys:
                tensors.setdefault(skey, {}).update(state_lazy(rule, skey))
            shape = reader.spec(names[rule.megatron]).shape[len(keys.index(rule.megatron)):]
            members[is_no_decay(rule.megatron, tuple(shape))].extend(rule.hf)
        held = [m for m in members if m]  # megatron-core makes a group only for parameters it has
        if not isinstance(groups, list) or len(groups) != len(held):
            raise CorruptCheckpointError(common_path, f"optimizer state without megatron-core's {len(held)} param groups "
                                         f"({' and '.join(k for k, m in zip(('decay', 'no decay'), members) if m)}) in common.pt")
        decay_first = sorted(groups, key=lambda g: float(g.get("wd_mult", 1.0)) == 0.0)
        param_groups += [{**{k: materialize(v) for k, v in g.items() if k not in ("params", "step")}, "params": m}
                         for g, m in zip(decay_first, held)]
        part_step = (saved.get("state") or {}).get("common_step")
        if part_step is None and groups and all("step" in g for g in groups):  # the distributed optimizer keeps it per group
            part_step = groups[0]["step"]
        step = part_step if step is None else step
    readers = {}
    if step is not None:  # read when a target asks (an export to Hugging Face never does: no torch for it)
        def entry() -> dict[str, Any]:
            return scalar_entry(step if is_tensor(step) else torch.tensor(float(step)))
        readers["step"] = {n: entry for g in param_groups for n in g["params"]}
    return OptimizerState("AdamW", param_groups, tensors, DeferredScalars(readers))


# --- writing ------------------------------------------------------------------------------------------------
def _full(rule: Rule, source: dict[str, LazyTensor], padded: int, fill_for, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One rule's full Megatron tensor (fused, vocabulary padded) of ``source``'s tensors, cast to ``dtype`` if given."""
    values = hf_values(rule, lambda n: (source[n].load().to(dtype) if dtype else source[n].load()) if n in source else None)
    if values is None:
        raise ConversionError(f"the source has no {list(rule.hf)} for Megatron's {rule.megatron}")
    return megatron_pieces(rule, values, 1, padded, fill_for(rule))[0]


def _layer(rule: Rule, source: dict[str, LazyTensor], fill_for, spec: TensorSpec, pieces: RankPieces, tag: str) -> LazyTensor:
    """One rule's full Megatron tensor as a LazyTensor (its one TP piece, :mod:`.megatron_pieces`): the source's
    own, or runs of the sources' rows (a fused QKV, [gate; up], the padded vocabulary), whose mapped bytes go
    straight to the output; else built when loaded (a cast, a transpose)."""
    values = hf_values(rule, lambda n: source.get(n))
    if values is None:
        raise ConversionError(f"the source has no {list(rule.hf)} for Megatron's {rule.megatron}")
    out = pieces.pieces(rule, values, spec.dtype, fill_for(rule), tag)[0]
    if out.spec != spec:
        raise ConversionError(f"{rule.megatron}: built as {out.spec.describe()}, planned as {spec.describe()}")
    return out


def _stacked(rules_: list[Rule], source: dict[str, LazyTensor], padded: int, fill_for, tag: str, keys: StoredKeys,
             dtype: torch.dtype | None = None) -> LazyTensor | None:
    """One stored tensor of ``source``'s tensors (cast to ``dtype`` if given): the rules' full Megatron tensors
    (one per layer, or one), stacked when per layer. None when the source has none of them. The shape comes
    from the specs; the tensors load when the writer reaches them, layer by layer (``parts``) where it streams."""
    from .row_numbers import RowNumbers  # (numpy: imported only by a writer that plans, not by every conversion)

    first = rules_[0]
    specs = hf_values(first, lambda n: source[n].spec if n in source else None)
    if specs is None:
        return None
    fused = first.fuse([RowNumbers.shaped(s.shape) for s in specs]).shape  # (meta tensors would import torch's compiler)
    full_shape = (padded, *fused[1:]) if first.split == VOCAB else tuple(fused)
    out_dtype = dtype or fused_dtype(specs)
    index = keys.index(first.megatron)  # the rules come layer by layer, and within a layer expert by expert
    stacked: tuple[int, ...] = ()
    if len(index) == 1:
        stacked = (len(rules_),)
    elif index:
        experts = len({expert_index(r.megatron) for r in rules_})
        stacked = (len(rules_) // experts, experts)

    pieces = RankPieces(1, padded, threading.Lock())

    def part(rule: Rule) -> LazyTensor:
        return _layer(rule, source, fill_for, TensorSpec(full_shape, out_dtype), pieces, tag)

    shape = (*stacked, *full_shape)
    if not stacked:
        whole = part(first)
        return LazyTensor(TensorSpec(shape, out_dtype), whole.load, origin=keys.name(first.megatron), parts=lambda: (whole,))

    def load() -> torch.Tensor:
        return torch.stack([part(r).load() for r in rules_]).reshape(shape)

    return LazyTensor(TensorSpec(shape, out_dtype), load, origin=keys.name(first.megatron), parts=lambda: (part(r) for r in rules_))


def write_megatron_dist(ckpt: LogicalCheckpoint, dst: str, tp: int = 1, overwrite: bool = False,
                        distributed_optimizer: str | None = None, pp: int = 1, transformer_impl: str = "transformer_engine",
                        ep: int | None = None, ddp: dict[str, Any] | None = None, pipeline: dict[str, Any] | None = None,
                        etp: int | None = None) -> None:
    """``dst/latest_checkpointed_iteration.txt`` and ``dst/iter_<step>/`` in torch_dist: megatron-core's
    ``dist_checkpointing.load`` reads it at any pipeline size and at tensor-parallel sizes whose padded
    vocabulary (a multiple of 128 x TP) is ``tp``'s. Tensors are built one stored tensor at a time.
    ``distributed_optimizer``: the DistributedOptimizer's layout, ``fully_reshardable`` (per tensor, loads at
    any DP x TP x PP) or ``dp_reshardable`` (flat buckets of the local spec at exactly ``tp`` x ``pp``, as the
    loading run's Megatron-LM data-parallel flags ``ddp`` make them: ``overlap_grad_reduce``, ``ddp_bucket_size``; and
    its pipeline split flags ``pipeline``: a buffer per model chunk of a virtual pipeline, uneven stages; ``etp``:
    its --expert-tensor-parallel-size, the experts' pieces in their buffers). The model's tensors are the same for
    every split."""
    if distributed_optimizer not in (None, FULLY_RESHARDABLE, buckets.DP_RESHARDABLE):
        raise ConversionError(f"unknown distributed-optimizer layout {distributed_optimizer!r}")
    flat = distributed_optimizer == buckets.DP_RESHARDABLE
    if flat and transformer_impl != "local":  # the buckets follow the module order, checked against the local spec
        raise ConversionError("the dp_reshardable layout is written for --transformer-impl local (its buckets follow the "
                              "module order); for Transformer Engine runs use --dist-optim-layout fully_reshardable")
    arch, padded, dtype = target_shape(ckpt, tp)
    if flat:
        mtp_stages(arch, pp, "--dist-optim-layout dp_reshardable buckets")
    split = pipeline_split(arch, pp, pipeline)
    ep = expert_parallel_size(ckpt, arch, ep)
    etp = expert_tensor_parallel_size(arch, tp, ep, etp, f"--expert-tensor-parallel-size {etp}" if etp is not None else f"--tp {tp} --ep-size {ep}", ckpt.notes,
                                      ckpt.optimizer is not None)
    all_rules = rules(arch, te_names=True)
    viewed = per_expert(ckpt, stacked_experts(arch))  # the rules name each expert's slice of a stacked tensor
    note_unmapped(viewed, all_rules, arch)
    split_args = split.to_args()
    args_d = arch.to_args(tp, pp)
    keys = StoredKeys.of(args_d)
    mla = bool(args_d.get("multi_latent_attention"))
    by_key: dict[str, list[Rule]] = {}
    for rule in all_rules:
        by_key.setdefault(_stored_key(rule, transformer_impl, keys, mla), []).append(rule)
    param_keys = {k: rs for k, rs in by_key.items() if not rs[0].buffer}  # what the optimizer holds
    padding = component_state(ckpt, PADDING) or {}
    model, opt = viewed.model, viewed.optimizer
    # a MoE model's optimizer at EP > 1 is megatron-core's ChainedOptimizer: the dense parameters' (0) and the
    # experts' (1), each state key prefixed chained_<i>. (its default: no content metadata asks it not to)
    chained = ep > 1 and opt is not None

    def prefix(rule: Rule) -> str:  # fully_reshardable: no prefix (the content metadata's chained_optim_avoid_prefix)
        return f"{CHAINED}{int(is_expert(rule))}." if chained and not distributed_optimizer else ""

    state: dict[str, Any] = {}
    for key, rs in by_key.items():
        state[key] = _stacked(rs, model, padded, lambda r: padding_rows(padding, r, "model", "master"), "model", keys,
                              None if rs[0].buffer else dtype)  # a buffer keeps its dtype (megatron-core's expert bias: fp32)
        if state[key] is None:
            raise ConversionError(f"the source has no {list(rs[0].hf)} for Megatron's {rs[0].megatron}")
    mixed = dtype != torch.float32
    if distributed_optimizer and opt is not None and sorted(opt.tensors) != ["exp_avg", "exp_avg_sq"]:
        raise ConversionError(f"the distributed optimizer keeps Adam's exp_avg and exp_avg_sq; the source has {sorted(opt.tensors)}")
    for skey, per in (opt.tensors.items() if opt and not flat else []):
        for key, rs in param_keys.items():
            t = _stacked(rs, per, padded, lambda r, s=skey: padding_rows(padding, r, f"optim:{s}"), f"optim:{skey}", keys)
            if t is not None:
                state[f"{prefix(rs[0])}{OPTIM_PREFIX}{skey}.{key}"] = t
    if (mixed or distributed_optimizer) and opt is not None and not flat:  # the fp32 main params, from the fp32 weights
        for key, rs in param_keys.items():
            name = DIST_MASTER if distributed_optimizer else MASTER
            state[f"{prefix(rs[0])}{OPTIM_PREFIX}{name}.{key}"] = _stacked(
                rs, model, padded, lambda r: padding_rows(padding, r, "master", "model"), "master", keys, torch.float32)
    for key in keys.extra_states(all_rules, arch):  # megatron-core's linears' extra states, stored as torch_dist stores
        state[key] = [None]  # every sharded object: a list of its replicas' data
    step = int(ckpt.step or 0)
    args = argparse.Namespace(**arch.to_args(
        tp, pp, iteration=step, params_dtype=dtype, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
        ckpt_format="torch_dist", transformer_impl=transformer_impl, world_size=tp * pp * ep,
        data_parallel_size=ep, use_distributed_optimizer=bool(distributed_optimizer),
        **({"expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp} if arch.experts else {}),
        dist_ckpt_optim_fully_reshardable=distributed_optimizer == FULLY_RESHARDABLE,
        no_save_optim=opt is None, hf_config=dict(ckpt.config), padded_vocab_size=padded, seed=DEFAULT_SEED, no_save_rng=False,
        **(ddp or {}), **split_args,
    ))
    rng, rng_notes = megatron_rng_states(rank_rng_states(ckpt, tp * pp), tp, pp, args.seed, etp=etp)
    ckpt.notes.extend(rng_notes)
    for (t, p, _), entry in rng.items():
        state[_rng_key(p, t, pp, tp)] = buckets.sharded_object([entry])
    common: dict[str, Any] = {"args": args, "checkpoint_version": CHECKPOINT_VERSION, "iteration": step}
    if opt is not None:
        steps = {float(e["value"]) for e in opt.scalars.get("step", {}).values()}
        if len(steps) > 1:
            raise ConversionError(f"Megatron keeps one optimizer step for all parameters; the source has {sorted(steps)}")
        step_value = steps.pop() if steps else None
        inner = {"state": {"common_step": torch.tensor(step_value)} if step_value is not None else {}, "param_groups": megatron_hyper(opt)}
        if distributed_optimizer:  # DistributedOptimizer.sharded_state_dict: the step in each group
            groups = [{**g, "step": float(step_value or 0.0)} for g in inner["param_groups"]]
            common["content_metadata"] = {"distrib_optim_sharding_type": distributed_optimizer, "singleton_local_shards": False,
                                          "chained_optim_avoid_prefix": True}  # what Megatron-LM's load asks the optimizer for
            expert_groups = _expert_groups(groups[0], [r for r in all_rules if is_expert(r)], state, keys) if chained else []
            if flat:  # the groups are an object of each buffer's, beside its buckets
                kind = {"param_state_sharding_type": distributed_optimizer}
                common["optimizer"] = {0: kind, 1: dict(kind)} if chained else kind
                state.update(_bucket_entries(arch, tp, split, ep, etp, dtype, [groups, expert_groups], state, keys, model, opt, padded, padding,
                                             vars(args)))
            elif chained:  # each of the ChainedOptimizer's DistributedOptimizers: its groups, the layout it names
                common["optimizer"] = {i: {"optimizer": {"param_groups": g}, "param_state_sharding_type": distributed_optimizer}
                                       for i, g in enumerate((groups, expert_groups))}
            else:
                common["optimizer"] = {"optimizer": {"param_groups": groups}, "param_state_sharding_type": distributed_optimizer}
        elif chained:
            expert_groups = _expert_groups(inner["param_groups"][0], [r for r in all_rules if is_expert(r)], state, keys)
            # each its own dicts: torch.save keeps shared objects shared, and megatron-core's load fills each part's state
            parts = [inner, {"state": dict(inner["state"]), "param_groups": expert_groups}]
            common["optimizer"] = {i: {"optimizer": part} if mixed else part for i, part in enumerate(parts)}
        else:
            # FP32Optimizer's state dict is torch's; Float16OptimizerWithFloat16Params nests it under "optimizer"
            common["optimizer"] = {"optimizer": inner} if mixed else inner
    scheduler = component_state(ckpt, SCHEDULER)
    if scheduler is not None:
        common[SCHEDULER] = scheduler
    def write_files(out: str) -> Written:
        directory = os.path.join(out, f"iter_{step:07d}")
        write_dcp(state, directory)
        buffer = io.BytesIO()
        torch.save(common, buffer)
        durable_write(os.path.join(directory, COMMON), buffer.getvalue())
        durable_write(os.path.join(directory, METADATA_JSON), json.dumps(BACKEND).encode())
        durable_write(os.path.join(out, TRACKER), str(step).encode())
        return Written(at=os.path.basename(directory))

    sharding = ShardingMetadata(strategy=Strategy.HYBRID, world_size=tp * pp * ep, tp=tp, pp=pp, ep=ep, precision=dtype_name(dtype))
    write_engine_checkpoint(ckpt, dst, NATIVE_KEY, write_files, sharding, {"megatron": "torch_dist"},
                            {"class": opt.cls} if opt is not None else None, overwrite, frozenset({SCHEDULER, PADDING, RNG}))
    log.info("wrote Megatron torch_dist checkpoint %s (iteration %d, %d stored tensors)", dst, step, len(state))


def _stored_key(rule: Rule, transformer_impl: str, keys: StoredKeys, mla: bool = False) -> str:
    """A rule's torch_dist key. A MoE layer's pre-MLP norm is its own module in both of megatron-core's specs: TE's
    saves it as ``pre_mlp_layernorm.weight``, the local spec under TE's dense name (its sharded_state_dict_keys_map:
    ``mlp.linear_fc1.layer_norm_weight``). The local spec's multi-latent-attention layer has no key map: every norm
    under its own module's name (``self_attention.q_layernorm.weight``, ``pre_mlp_layernorm.weight``)."""
    if transformer_impl == "local" and rule.aliases:
        if mla and ".layer_norm_" in rule.megatron:
            return keys.name(rule.aliases[0])
        if not mla and rule.megatron.endswith(".pre_mlp_layernorm.weight"):
            return keys.name(rule.aliases[0])
    return keys.name(rule.megatron)


def _expert_groups(decay: dict[str, Any], expert_rules: list[Rule], state: dict[str, Any], keys: StoredKeys) -> list[dict[str, Any]]:
    """The expert optimizer's param groups as megatron-core's _get_param_groups makes them: the decay group for its
    matrices, a no-decay one only if an expert has biases or norms; the dense groups' hyper-parameters."""
    def shape(rule: Rule) -> tuple[int, ...]:
        return tuple(state[keys.name(rule.megatron)].spec.shape[len(keys.index(rule.megatron)):])

    groups = [{**decay, "is_expert_parallel": True}]
    if any(is_no_decay(r.megatron, shape(r)) for r in expert_rules):
        groups.append({**decay, "weight_decay": 0.0, "wd_mult": 0.0, "is_expert_parallel": True})
    return groups


def _bucket_entries(arch, tp: int, split: PipelineSplit, ep: int, etp: int, dtype: torch.dtype, groups, state, keys: StoredKeys, model,
                    opt: OptimizerState, padded: int,
                    padding: dict[str, torch.Tensor], args: dict[str, Any]) -> dict[str, Any]:
    """The dp_reshardable buckets: each rule's full fp32 master (from the weights) and moments, vocabulary padded."""
    def full_shape(rule: Rule) -> tuple[int, ...]:  # the stored tensor's, less its stacking (layers, experts)
        shape = state[_stored_key(rule, "local", keys, bool(args.get("multi_latent_attention")))].spec.shape
        return tuple(shape[len(keys.index(rule.megatron)):])

    def full_tensor(rule: Rule, key: str) -> torch.Tensor:
        if key == "param":
            return _full(rule, model, padded, lambda r: padding_rows(padding, r, "master", "model"), torch.float32)
        return _full(rule, opt.tensors[key], padded, lambda r: padding_rows(padding, r, f"optim:{key}"))

    return buckets.write_entries(arch, tp, split, ep, dtype, groups, full_shape, full_tensor, args, etp)
