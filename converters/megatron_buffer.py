"""Where megatron-core's DistributedOptimizer keeps each parameter's fp32 master and Adam moments: the gradient
buffer of each model chunk, bucket by bucket (``distributed/param_and_grad_buffer.py``, ``_ParamAndGradBuffer``).

The files record no offsets, so the layout is computed as megatron-core computes it. Parameters go in reverse
module order, each start rounded up to a multiple of 64. A new bucket starts after a parameter once the bucket
holds ``bucket_size`` elements (``--overlap-grad-reduce``), and around a tied embedding shared between the first
and last pipeline stages (``shared_embedding``: its own bucket, so both stages shard it alike). A bucket's end is
padded for the data-parallel size. The files drop that padding, which makes them the same for every DP size, but
keep the alignment gaps inside a bucket. ``distrib_optim.pt`` (``save_parameter_state``, ``buckets_coalesced``)
concatenates the buckets; torch_dist's ``dp_reshardable`` layout stores each as a tensor of its own.

Hand-written because megatron-core builds the layout only inside a live ``DistributedDataParallel`` (CUDA buffers,
process groups): a converter has neither.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, TypeVar

from interop.structure import Absent, Keys, ListOf

from .megatron_arch import MegatronArch
from .megatron_map import rules, tied_output_rule
from .torch_zip import NUMBER

# the distributed optimizer's param groups beside its flat state (distrib_optim.pt's in model_optim_rng.pt,
# dp_reshardable's in its ``optimizer`` object): DistributedOptimizer.state_dict's hyper-parameters and step
DISTRIBUTED_GROUPS = ListOf(Keys(weight_decay=Absent(NUMBER), wd_mult=Absent(NUMBER), step=Absent(NUMBER)))
PARAM_ALIGNMENT = 64  # _pad_start_of_param_if_needed: 128-byte aligned starts of >= 16-bit values
DEFAULT_BUCKET_SIZE = 40_000_000  # DistributedDataParallel: max(40M, 1M x DP) when --ddp-bucket-size is not given
BUCKET_SIZE_PER_DP_RANK = 1_000_000


@dataclass(frozen=True)
class Bucket:
    """One bucket: {parameter: (start, end)} counted from the bucket's start, and its length without the end's
    padding (what the files hold)."""

    index: dict[str, tuple[int, int]]
    numel_unpadded: int


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def buckets(params: list[tuple[str, tuple[int, ...]]], shared: frozenset[str] | set[str] = frozenset(),
            bucket_size: int | None = None) -> list[Bucket]:
    """The buckets of one model chunk's parameters, given in module order; ``shared``: the tied embedding's names
    (a bucket of its own); ``bucket_size``: :func:`run_bucket_size`'s answer. Follows _ParamAndGradBuffer.__init__
    step by step, the end of a bucket split before a shared parameter keeping its alignment gap."""
    out: list[Bucket] = []
    index: dict[str, tuple[int, int]] = {}
    at = 0  # from the bucket's start, which megatron-core pads to a multiple of 128: alignment is the same counted so

    def close(end: int) -> int:
        nonlocal index
        out.append(Bucket(index, end))
        index = {}
        return 0

    for name, shape in reversed(params):
        at = -(-at // PARAM_ALIGNMENT) * PARAM_ALIGNMENT
        if name in shared and index:
            at = close(at)
        end = at + _numel(shape)
        index[name] = (at, end)
        at = close(end) if (bucket_size is not None and end >= bucket_size) or name in shared else end
    if index:
        close(at)
    return out


T = TypeVar("T")


def chunk_buffers(held: list[tuple[int, T]]) -> list[tuple[int, list[T]]]:
    """One optimizer's parameters (each with its model chunk) as its gradient buffers: megatron-core's
    DistributedDataParallel per chunk gives each chunk holding any of them a buffer, which the optimizer numbers
    in chunk order (``gbuf_idx``). Returns [(chunk, its parameters in the order given)], buffer by buffer."""
    return [(v, [x for c, x in held if c == v]) for v in sorted({c for c, _ in held})]


def shared_names(arch: MegatronArch, pp: int, p: int) -> frozenset[str]:
    """The Megatron names megatron-core marks ``shared_embedding`` on pipeline stage ``p`` (LanguageModule's
    setup_embeddings_and_output_layer): a tied embedding on the first stage and its copy on the last, when those
    are two stages."""
    if not arch.tied or pp == 1:
        return frozenset()
    return frozenset(({rules(arch)[0].megatron} if p == 0 else set()) | ({tied_output_rule(arch).megatron} if p == pp - 1 else set()))


def coalesced(parts: list[Bucket]) -> tuple[dict[str, tuple[int, int]], int]:
    """distrib_optim.pt's layout: every bucket's unpadded part, one after another. Returns {name: (start, end)}
    and the length."""
    index, offset = {}, 0
    for bucket in parts:
        index.update({n: (a + offset, b + offset) for n, (a, b) in bucket.index.items()})
        offset += bucket.numel_unpadded
    return index, offset


def run_bucket_size(args: dict[str, Any], pipeline_rank: int, chunk: int = 0) -> int | None:
    """The bucket size of the run that saved ``args`` (Megatron-LM's), for model chunk ``chunk`` of pipeline stage
    ``pipeline_rank``: buckets only with --overlap-grad-reduce, on the first stage (DistributedDataParallel turns
    bucketing off on the others, whose gradient reduction is off the critical path), in its first model chunk
    (Megatron-LM's get_model: disable_bucketing for a virtual pipeline's later chunks, and for every chunk with
    --overlap-param-gather-with-optimizer-step)."""
    if not args.get("overlap_grad_reduce") or pipeline_rank > 0 or chunk > 0 or args.get("overlap_param_gather_with_optimizer_step"):
        return None
    size = args.get("ddp_bucket_size")
    if size:
        return int(size)
    return max(DEFAULT_BUCKET_SIZE, BUCKET_SIZE_PER_DP_RANK * int(args.get("data_parallel_size") or 1))
