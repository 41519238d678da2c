"""megatron-core's DistributedOptimizer state in torch_dist's ``dp_reshardable`` layout (Megatron-LM's default
with ``--use-distributed-optimizer --ckpt-format torch_dist``).

Each TP x PP rank (``dp_group_idx_<G>``, G its rank in the model-parallel group: TP fastest) stores each bucket of
its gradient buffers (one per model chunk: ``gbuf_idx_<v>``, v > 0 under a virtual pipeline) as three flat fp32
tensors, ``optimizer.distributed.dp_group_idx_<G>.gbuf_idx_<v>.dtype_(<param dtype>, <grad dtype>).bucket_idx_<k>.
{param,exp_avg,exp_avg_sq}``: its parameters' TP pieces in the buffer layout of :mod:`.megatron_buffer` (reverse
module order, 64-aligned starts, gaps unspecified; buckets of --overlap-grad-reduce and a tied embedding's own), and
beside them the objects ``per_bucket_numel``, ``per_bucket_numel_unpadded`` (a list over the buffers) and
``optimizer`` (the param groups, with the step). A MoE model at EP > 1 has two optimizers, each with its own
buffers, keys prefixed ``chained_<i>.``: the dense one's per TP x PP rank, the experts' per rank of the expert
tensor x expert x pipeline group (:func:`rank_buffers`), the experts split over the expert tensor-parallel size
(``--expert-tensor-parallel-size``, by default the TP size).

The layout follows the model's module order, which the files do not record; the local spec's and Transformer
Engine's differ in where a layer's input norm sits. Reading tries both and keeps the one under which every 1-D
parameter's fp32 master (norms, biases: small, in every layer) rounds to the model's stored value; writing uses
the local spec's order, the one megatron-core runs here.
"""

from __future__ import annotations

import io
import math
import re
from dataclasses import dataclass
from typing import Any, Callable

from interop.lazy_import import torch

from interop.errors import ConversionError, CorruptCheckpointError
from interop.structure import check
from interop.tensors import LazyTensor, TensorSpec

from .megatron_buffer import DISTRIBUTED_GROUPS, buckets, chunk_buffers, run_bucket_size, shared_names
from .megatron_arch import MegatronArch
from .megatron_map import Rule, chunk_rules, expert_index, is_expert, parameters, rules, split, tied_output_rule
from .megatron_pipeline import PipelineSplit

DP_RESHARDABLE = "dp_reshardable"
FLAT_KEYS = ("param", "exp_avg", "exp_avg_sq")  # fp32 main params and Adam's moments
GROUP_PREFIX = "optimizer.distributed.dp_group_idx_{}."
CHAINED = "chained_"  # megatron-core's ChainedOptimizer: chained_<i>.<key> for its i-th optimizer's state
BUCKET = re.compile(r"^gbuf_idx_(\d+)\.(dtype_\(.*\))\.bucket_idx_(\d+)\.(\w+)$")
OBJECT = "{}/shard_0_1"  # a ShardedObject of shape (1,) in torch_dist: the key of its one shard
NUMEL_PAD = 128  # per_bucket_numel pads each bucket for the run's DP size; only the unpadded count is checked on load


@dataclass(frozen=True)
class Region:
    """One TP rank's piece of a Megatron tensor inside a TP x PP rank's flat bucket."""

    bucket: str  # the DCP key without the trailing ``.param`` / ``.exp_avg`` / ``.exp_avg_sq``
    start: int
    end: int
    shape: tuple[int, ...]


def module_orders(arch: MegatronArch) -> list[tuple[str, list[Rule]]]:
    """The candidate module orders, each as rules under Transformer Engine's names (torch_dist's): the local
    spec's (input norm first in a layer) and Transformer Engine's (norms inside linear_qkv and linear_fc1)."""
    te = parameters(rules(arch, te_names=True))  # the buffers' (a router's expert bias) are no gradients
    by_name = {r.megatron: r for r in te}
    local = [by_name[r.megatron] if r.megatron in by_name else by_name[r.aliases[0]] for r in parameters(rules(arch, te_names=False))]
    return [("local", local), ("transformer_engine", te)]


@dataclass(frozen=True)
class Buffer:
    """One gradient buffer of one optimizer on one rank: its optimizer's key prefix (``[chained_<part>.]optimizer.
    distributed.dp_group_idx_<G>.``), its index among that optimizer's buffers (``gbuf_idx_<g>``: one per model
    chunk that holds any of its parameters), its pipeline stage and model chunk, and its parameters in module
    order as (rule, TP piece shape)."""

    prefix: str
    gbuf: int
    stage: int
    chunk: int
    tp_rank: int
    experts: bool  # the expert optimizer's (no tied embedding in it)
    params: list[tuple[Rule, tuple[int, ...]]]  # tp_rank's pieces: of the TP split, or the expert TP split's

    def stem(self, dtype: torch.dtype) -> str:
        """The key stem of its buckets, which append ``bucket_idx_<k>``."""
        grad = torch.float32  # Megatron-LM reduces bf16 / fp16 gradients in fp32 (--accumulate-allreduce-grads-in-fp32)
        return f"{self.prefix}gbuf_idx_{self.gbuf}.dtype_{(dtype, grad)}."


def pieces(rule: Rule, arch: MegatronArch, tp: int, ep: int, etp: int) -> int:
    """How many tensor-parallel pieces the buffers hold ``rule`` in: the expert tensor-parallel size for a routed
    expert of a ChainedOptimizer's expert part (EP > 1), else the TP size."""
    return etp if arch.experts and ep > 1 and is_expert(rule) else tp


def rank_buffers(arch: MegatronArch, order: list[Rule], tp: int, pipeline: PipelineSplit, ep: int,
                 full_shape: Callable[[Rule], tuple[int, ...]], etp: int) -> list[Buffer]:
    """Every rank's buffers, one per model chunk (:class:`.megatron_pipeline.PipelineSplit`) holding any of the
    optimizer's parameters. A dense optimizer's on TP x PP rank G = t + tp x p (the last stage's tied copy of the
    embedding included: it has its own place in the buffer). A MoE model at EP > 1 has megatron-core's
    ChainedOptimizer: the dense parameters' (part 0, G as above) and the experts' (part 1) on each rank of the
    expert tensor x expert x pipeline group, G = t + etp x (e + ep x p) (its order tp-ep-pp; ``etp`` the expert
    tensor-parallel size, :func:`.megatron.expert_tensor_parallel_size`), holding the experts local to expert rank e,
    each in ``etp`` pieces; at EP 1 one optimizer holds every parameter."""
    stages = chunk_rules(order, arch, pipeline)
    if arch.tied and pipeline.pp > 1:
        stages[-1][-1].append(tied_output_rule(arch))
    chained = bool(arch.experts) and ep > 1
    per = arch.experts // ep if arch.experts else 0

    def prefix(part: int, g: int) -> str:
        return (f"{CHAINED}{part}." if chained else "") + GROUP_PREFIX.format(g)

    def owner(rule: Rule, p: int, t: int) -> tuple[str, bool]:
        """The optimizer holding ``rule``'s piece t on stage p: its key prefix, and whether it is the experts'."""
        if chained and is_expert(rule):
            return prefix(1, t + etp * (expert_index(rule.megatron) // per + ep * p)), True
        return prefix(0, t + tp * p), False

    out = []
    for p, chunks in enumerate(stages):
        held: dict[tuple[str, bool, int], list[tuple[int, tuple[Rule, tuple[int, ...]]]]] = {}
        for v, rules_ in enumerate(chunks):
            for r in rules_:
                for t, piece in enumerate(split(r, torch.empty(full_shape(r), device="meta"), pieces(r, arch, tp, ep, etp))):
                    held.setdefault((*owner(r, p, t), t), []).append((v, (r, tuple(piece.shape))))
        for (pre, experts, t), params in held.items():
            out += [Buffer(pre, g, p, v, t, experts, mine) for g, (v, mine) in enumerate(chunk_buffers(params))]
    return out


def layout(buf: Buffer, stem: str, arch: MegatronArch, pp: int, args: dict[str, Any]) -> tuple[dict[str, Region], list[int]]:
    """A buffer's regions in its buckets (``stem`` + ``bucket_idx_<k>``) and each bucket's length, bucketed as the
    run's ``args`` say (the tied embedding in the dense buffer only)."""
    params = buf.params
    shared = frozenset() if buf.experts else shared_names(arch, pp, buf.stage)
    parts = buckets([(f"{i}", shape) for i, (_, shape) in enumerate(params)],
                    frozenset(f"{i}" for i, (rule, _) in enumerate(params) if rule.megatron in shared),
                    run_bucket_size(args, buf.stage, buf.chunk))
    regions = {}
    for k, part in enumerate(parts):
        for i, (a, b) in part.index.items():
            rule, shape = params[int(i)]
            regions[rule.megatron] = Region(f"{stem}bucket_idx_{k}", a, b, shape)
    return regions, [part.numel_unpadded for part in parts]


def bucket_keys(tensor_keys: list[str], buffers: list[Buffer], where: str) -> dict[tuple[str, int], list[str]]:
    """Each buffer's (prefix, gbuf) bucket keys, in bucket order; one line naming what else the files hold."""
    prefixes = sorted({b.prefix for b in buffers}, key=len, reverse=True)
    found: dict[tuple[str, int], dict[str, set[int]]] = {(b.prefix, b.gbuf): {} for b in buffers}
    for key in tensor_keys:
        unchained = key.split(".", 1)[1] if key.startswith(CHAINED) else key
        if not unchained.startswith(GROUP_PREFIX.split("{")[0]):
            continue  # the model's, or another optimizer state's
        prefix = next((x for x in prefixes if key.startswith(x)), None)
        m = BUCKET.match(key[len(prefix):]) if prefix is not None else None
        if m is None or (prefix, int(m.group(1))) not in found:
            raise CorruptCheckpointError(where, f"holds {key!r}, not a distributed-optimizer bucket tensor of a rank and "
                                         "model chunk the args describe")
        found[(prefix, int(m.group(1)))].setdefault(f"{prefix}gbuf_idx_{m.group(1)}.{m.group(2)}.", set()).add(int(m.group(3)))
    out = {}
    for (prefix, g), stems in found.items():
        if not stems:
            raise CorruptCheckpointError(where, f"holds no distributed-optimizer bucket {prefix}gbuf_idx_{g}.* (the args' "
                                         "layout has one)")
        if len(stems) > 1:
            raise ConversionError(f"{where}: {prefix}gbuf_idx_{g} has buckets of {len(stems)} dtypes ({sorted(stems)[:2]}...); "
                                  "one precision is read; save with --dist-ckpt-optim-fully-reshardable")
        (stem, indices), = stems.items()
        if indices != set(range(len(indices))):
            raise CorruptCheckpointError(where, f"{prefix}gbuf_idx_{g} holds buckets {sorted(indices)}, not 0..{len(indices) - 1}")
        out[(prefix, g)] = [f"{stem}bucket_idx_{k}" for k in range(len(indices))]
    return out


def read_layout(reader, arch: MegatronArch, tp: int, pipeline: PipelineSplit, ep: int, full_shape: Callable[[Rule], tuple[int, ...]],
                model_full: Callable[[Rule], torch.Tensor], where: str, args: dict[str, Any], etp: int) -> dict[str, list[Region]]:
    """Megatron name -> its tensor-parallel pieces' regions (:func:`pieces`), under the module order whose fp32
    masters match the model; the buckets as the saving run's args made them (:mod:`.megatron_buffer`)."""
    orders = [(name, rank_buffers(arch, order, tp, pipeline, ep, full_shape, etp), order) for name, order in module_orders(arch)]
    stems = bucket_keys(reader.tensor_keys(), orders[0][1], where)  # the buffers are the orders' same
    stored = set(reader.tensor_keys())
    for key in (f"{s}.{k}" for ss in stems.values() for s in ss for k in FLAT_KEYS):
        if key not in stored:
            raise CorruptCheckpointError(where, f"holds no {key!r}: the distributed optimizer keeps fp32 params and both Adam moments")
    tried = []
    for name, ranks, order in orders:
        regions: dict[str, list[Region | None]] = {}
        fits = True
        for buf in ranks:
            got = stems[(buf.prefix, buf.gbuf)]
            placed, sizes = layout(buf, got[0][: -len("bucket_idx_0")], arch, pipeline.pp, args)
            held = [tuple(reader.spec(f"{s}.param").shape) for s in got]
            if held != [(n,) for n in sizes]:
                fits = False
                tried.append(f"{name}: {buf.prefix}gbuf_idx_{buf.gbuf} lays out to buckets of {sizes}, the checkpoint holds "
                             f"{[h[0] if len(h) == 1 else h for h in held]}")
                break
            for rule, _ in buf.params:
                regions.setdefault(rule.megatron, [None] * pieces(rule, arch, tp, ep, etp))[buf.tp_rank] = placed[rule.megatron]
        if fits and _masters_match(reader, order, regions, model_full, tried, name):
            return regions  # type: ignore[return-value]
    raise CorruptCheckpointError(where, "the distributed optimizer's buckets fit no known module order "
                                 f"({'; '.join(tried)}); save with --dist-ckpt-optim-fully-reshardable")


def _masters_match(reader, order: list[Rule], regions, model_full, tried: list[str], name: str) -> bool:
    for rule in order:
        if len(rule.hf) != 1 or regions.get(rule.megatron) is None:
            continue
        full = model_full(rule)
        if full.dim() != 1:
            continue
        for t, piece in enumerate(split(rule, full, len(regions[rule.megatron]))):
            master = region_tensor(reader, regions[rule.megatron][t], "param")
            if not torch.equal(master.to(piece.dtype), piece):
                tried.append(f"{name}: {rule.megatron}'s fp32 master is not its weight")
                return False
    return True


def region_tensor(reader, region: Region, key: str) -> torch.Tensor:
    return reader.read(f"{region.bucket}.{key}", (region.start,), (region.end - region.start,)).view(region.shape)


def param_groups(reader, prefix: str, where: str) -> list[dict[str, Any]]:
    """An optimizer's param groups (each with the step), from its first rank's object (``prefix``: that buffer's)."""
    key = OBJECT.format(prefix + "optimizer")
    if key not in reader.object_keys():
        raise CorruptCheckpointError(where, f"holds no {key!r}: the distributed optimizer's param groups")
    saved = reader.read_object(key)
    saved = saved[0] if isinstance(saved, list) and len(saved) == 1 else saved
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    if not isinstance(groups, list):
        raise CorruptCheckpointError(where, f"{key!r} is not the optimizer's state dict (no param_groups)")
    check(where, groups, DISTRIBUTED_GROUPS, f"{key}.param_groups")
    return groups


def part_prefixes(arch: MegatronArch, ep: int) -> list[str]:
    """The first buffer's key prefix of each of the run's optimizers: one, or a MoE model's two at EP > 1."""
    if arch.experts and ep > 1:
        return [f"{CHAINED}{part}.{GROUP_PREFIX.format(0)}" for part in (0, 1)]
    return [GROUP_PREFIX.format(0)]


# --- writing ------------------------------------------------------------------------------------------------
def sharded_object(value: Any) -> io.BytesIO:
    """A ShardedObject's bytes as megatron-core's torch_dist stores them (a one-element list of its data),
    handed to DCP as bytes so that it does not flatten the dicts inside."""
    buffer = io.BytesIO()
    torch.save([value], buffer)
    buffer.seek(0)
    return buffer


def write_entries(arch: MegatronArch, tp: int, pipeline: PipelineSplit, ep: int, dtype: torch.dtype, groups: list[list[dict[str, Any]]],
                  full_shape: Callable[[Rule], tuple[int, ...]], full_tensor: Callable[[Rule, str], torch.Tensor],
                  args: dict[str, Any], etp: int) -> dict[str, Any]:
    """The DCP entries of every buffer's buckets (:func:`rank_buffers`) in the local spec's module order, as the
    written ``args``' pipeline split, --overlap-grad-reduce and --ddp-bucket-size make them: lazy flat tensors built
    from ``full_tensor(rule, key)`` (the full Megatron tensor of the fp32 master or a moment, vocabulary padded) and
    the objects megatron-core asks for beside them (per optimizer; the bucket sizes per buffer); ``groups``: each
    optimizer's param groups (:func:`part_prefixes`)."""
    if arch.tied and pipeline.pp > 1:
        # the tied embedding's own buckets: megatron-core 0.16.1's dp_reshardable save fails on them here ("out of
        # bounds chunk" where the first stage's other bucket ends in an alignment gap), so no run of it judged ours
        raise ConversionError("the dp_reshardable layout is written for untied or single-stage embeddings; "
                              "use --dist-optim-layout fully_reshardable, or --ckpt-format torch's distrib_optim.pt (--to megatron)")
    _, order = module_orders(arch)[0]
    buffers = rank_buffers(arch, order, tp, pipeline, ep, full_shape, etp)
    placed = {(b.prefix, b.gbuf): layout(b, b.stem(dtype), arch, pipeline.pp, args) for b in buffers}
    where = {(rule.megatron, b.tp_rank): placed[(b.prefix, b.gbuf)][0][rule.megatron] for b in buffers for rule, _ in b.params}
    built: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def flats(p: int, key: str) -> dict[str, torch.Tensor]:
        """Stage ``p``'s buffers' flat bucket tensors of ``key``, built together (each full tensor loaded once)."""
        if (p, key) not in built:
            built.clear()
            mine = [b for b in buffers if b.stage == p]
            bufs = {f"{b.stem(dtype)}bucket_idx_{k}": torch.zeros(n, dtype=torch.float32)
                    for b in mine for k, n in enumerate(placed[(b.prefix, b.gbuf)][1])}
            for rule in dict.fromkeys(r for b in mine if b.tp_rank == 0 for r, _ in b.params):
                for t, piece in enumerate(split(rule, full_tensor(rule, key).float(), pieces(rule, arch, tp, ep, etp))):
                    r = where[(rule.megatron, t)]
                    bufs[r.bucket][r.start:r.end] = piece.reshape(-1)
            built[(p, key)] = bufs
        return built[(p, key)]

    out: dict[str, Any] = {}
    dtypes = (dtype, torch.float32)
    numels: dict[str, tuple[Buffer, list[dict], list[dict]]] = {}  # per optimizer: per buffer, padded and unpadded
    for b in buffers:
        sizes = placed[(b.prefix, b.gbuf)][1]
        for k, n in enumerate(sizes):
            stem = f"{b.stem(dtype)}bucket_idx_{k}"
            for key in FLAT_KEYS:
                out[f"{stem}.{key}"] = LazyTensor(TensorSpec((n,), torch.float32), lambda p=b.stage, key=key, stem=stem: flats(p, key)[stem],
                                                  origin=f"{stem}.{key}")
        _, padded, unpadded = numels.setdefault(b.prefix, (b, [], []))
        padded.append({dtypes: [math.ceil(n / NUMEL_PAD) * NUMEL_PAD for n in sizes]})
        unpadded.append({dtypes: sizes})
    for prefix, (b, padded, unpadded) in numels.items():
        out[OBJECT.format(prefix + "optimizer")] = sharded_object({"param_groups": groups[int(b.experts)]})
        out[OBJECT.format(prefix + "per_bucket_numel")] = sharded_object(padded)
        out[OBJECT.format(prefix + "per_bucket_numel_unpadded")] = sharded_object(unpadded)
    return out
