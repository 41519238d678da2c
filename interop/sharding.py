"""The model side of the adapter: how a distributed model exposes its state, and what the manifest records
about how it is sharded, so a converter can reassemble logical tensors without the launch config."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any, Protocol, runtime_checkable

from .lazy_import import torch

from .dtypes import dtype_name


class Strategy(str, Enum):
    SINGLE = "single"
    DDP = "ddp"
    ZERO = "zero"  # DeepSpeed ZeRO-1/2/3
    FSDP = "fsdp"
    TENSOR_PARALLEL = "tensor_parallel"
    PIPELINE_PARALLEL = "pipeline_parallel"
    HYBRID = "hybrid"  # DP x TP x PP


@dataclass
class TensorSharding:
    """How one logical tensor is split across tensor-parallel ranks."""

    tp_degree: int = 1
    split_axis: int | None = None  # None: replicated across TP ranks
    layout: str = "plain"  # "plain", "fused_qkv", "gated_fc1" (Megatron's [gate_r; up_r]), "conv1d"


@dataclass
class ShardingMetadata:
    strategy: Strategy
    world_size: int = 1
    precision: str = "float32"  # dtype the model computes in
    master_precision: str | None = None  # dtype of the optimizer's master copy, when it differs
    zero_stage: int | None = None
    sharding_strategy: str | None = None  # FSDP: "full_shard", "shard_grad_op", "hybrid_shard", "no_shard"
    dp: int = 1
    tp: int = 1
    pp: int = 1
    ep: int = 1  # expert-parallel ranks: each holds 1/ep of every MoE layer's experts
    tensors: dict[str, TensorSharding] = field(default_factory=dict)  # only tensors that are split
    # module tensors holding a MoE layer's experts along their first dimension, split over the ep ranks in order:
    # ep rank r holds experts [r*E/ep, (r+1)*E/ep) (the topology's "ep" groups say which ranks those are)
    expert_tensors: list[str] = field(default_factory=list)
    pp_stage_of_layer: dict[str, int] = field(default_factory=dict)  # layer prefix -> pipeline stage
    any_world_size: bool = False  # the engine's files are for no world size (DCP written offline): any run loads them

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["strategy"] = self.strategy.value
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "ShardingMetadata":
        data = dict(data)
        data["strategy"] = Strategy(data["strategy"])
        data["tensors"] = {k: TensorSharding(**v) for k, v in data.get("tensors", {}).items()}
        return cls(**data)


@runtime_checkable
class DistributedModel(Protocol):
    """What a trainer's model offers the adapter, whatever engine shards it."""

    strategy: Strategy
    rank: int
    world_size: int

    def local_state_dict(self) -> dict[str, torch.Tensor]: ...  # this rank's shards

    def full_state_dict(self) -> dict[str, torch.Tensor]: ...  # logical tensors (gathered where sharded)

    def load_local_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None: ...

    def sharding_metadata(self) -> ShardingMetadata: ...


class LocalModel:
    """A model held whole on every rank (single process or DDP): local and full state are the same."""

    def __init__(self, module: torch.nn.Module, rank: int = 0, world_size: int = 1, master_dtype: torch.dtype | None = None):
        self.module = module
        self.rank = rank
        self.world_size = world_size
        self.strategy = Strategy.SINGLE if world_size == 1 else Strategy.DDP
        self._master_dtype = master_dtype

    def local_state_dict(self) -> dict[str, torch.Tensor]:
        return self.module.state_dict()

    full_state_dict = local_state_dict

    def load_local_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state)

    load_full_state_dict = load_local_state_dict

    # Stateful, so the model itself can be a component
    state_dict = local_state_dict
    load_state_dict = load_local_state_dict

    def sharding_metadata(self) -> ShardingMetadata:
        dtype = next(self.module.parameters()).dtype
        master = self._master_dtype
        return ShardingMetadata(
            strategy=self.strategy,
            world_size=self.world_size,
            dp=self.world_size,
            precision=dtype_name(dtype),
            master_precision=dtype_name(master) if master is not None and master != dtype else None,
        )
