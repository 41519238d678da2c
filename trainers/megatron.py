"""The reference Megatron-style trainer: DP x TP x PP on a device mesh with torch's own machinery.

    torchrun --nproc_per_node 2 -m trainers.megatron --tp 2 --steps 8
    torchrun --nproc_per_node 2 -m trainers.megatron --pp 2 --microbatches 4 --pipeline-schedule 1f1b
    torchrun --nproc_per_node 4 examples/train_megatron.py --tp 2 --pp 2 --activation-checkpointing
    torchrun --nproc_per_node 2 -m trainers.megatron --tp 2 --resume path/to/universal   # any layout, any format
    torchrun --nproc_per_node 4 -m trainers.megatron --model mixtral --ep 2 --tp 2        # experts over 2 ranks

The mesh is (pp, dp, tp) with tp fastest, as Megatron places ranks; dp is the world size over tp x pp, and
with ``--ep`` it is (expert-data-parallel x ep): the ranks of an ``ep`` group hold different experts and
different data, the ranks of an ``edp`` group the same experts. Expert gradients are reduced over ``edp``
(and tp, whose ranks run their experts on disjoint slices of their shared tokens), every other gradient over dp.
Tensor parallelism is DTensor's (``trainers.megatron_model``), pipeline parallelism is
``torch.distributed.pipelining`` (GPipe or 1F1B over ``--microbatches``), data parallelism an all-reduce of
the gradients over the dp group. ``--batch-size`` is the global batch, split over the dp replicas and then
into microbatches, so the data order and the losses do not depend on the layout.

Model and optimizer are one torch.distributed.checkpoint directory (``<checkpoint>/dcp``) holding logical
tensors under canonical names, so a run of any other layout loads it directly. ``--resume`` also takes a
checkpoint of another format (universal, Hugging Face, Megatron-LM, ...): it is converted in-process first.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.distributed as dist

from converters import dcp as dcp_format
from converters import interop_dcp
from interop import SharingPattern, StateComponent, WorldSizePolicy
from interop.sharding import ShardingMetadata, Strategy
from interop.state import NativeLoad
from interop.errors import ConfigurationError

from . import memory
from .base import flag, BaseTrainer, TrainerConfig, build_model, configure_logging, model_metadata, param_group_names, run
from .base import parse_config as base_parse_config
from .megatron_model import (CausalLMStage, apply_expert_parallel, apply_tensor_parallel, enable_activation_checkpointing,
                             expert_plan, stage_layouts, tensor_sharding)

log = logging.getLogger(__name__)

SCHEDULES = ("gpipe", "1f1b")


@dataclass
class MegatronTrainerConfig(TrainerConfig):
    tp: int = flag(1, "tensor-parallel size (Megatron's --tensor-model-parallel-size)")
    pp: int = flag(1, "pipeline-parallel size (Megatron's --pipeline-model-parallel-size)")
    ep: int = flag(1, "expert-parallel size, dividing the data-parallel size (Megatron's --expert-model-parallel-size)")
    microbatches: int = flag(0, "per pipeline step; 0: as many as pipeline stages")
    pipeline_schedule: str = flag("1f1b", "gpipe | 1f1b")
    recompute_granularity: str = flag("layer", "with --activation-checkpointing: layer | stage")
    output_dir: str = "out/megatron"


class DCPModelOptimizer:
    """Model and optimizer through torch.distributed.checkpoint: each rank writes its own shards of the logical
    tensors, and loading reads whatever part of them this rank's layout needs. The files lie beside the
    manifest: ``dcp.load(state, checkpoint_id=checkpoint)`` reads one of the run's checkpoints as it is."""

    native_top = True

    def __init__(self, trainer: "MegatronTrainer"):
        self.trainer = trainer

    def save_native(self, directory: str) -> None:
        dcp_format.save_dcp(self.trainer.model_and_optimizer_state(), directory)

    def stage_native(self, directory: str, group: Any = None):
        """Staged by DCP's own stager now, written by ``dcp.save`` on the commit's thread over ``group`` (the commit's
        process group, not the one training uses meanwhile): ``converters.dcp.stage_dcp``."""
        return dcp_format.stage_dcp(self.trainer.model_and_optimizer_state(), directory, group)

    def load_native(self, load: NativeLoad) -> None:
        trainer = self.trainer
        state = trainer.model_and_optimizer_state()
        metadata = dcp_format.read_metadata(load.directory)
        if not any(key.startswith("optimizer.") for key in metadata.state_dict_metadata):
            log.warning("%s holds no optimizer state: the optimizer starts afresh", load.directory)
            del state["optimizer"]
        dcp_format.load_dcp(state, load.directory, metadata)
        trainer.set_model_and_optimizer_state(state)


def _mean(values: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([v.full_tensor() if hasattr(v, "full_tensor") else v for v in values]).mean()


def causal_lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross entropy (Hugging Face's loss for unpadded batches); with vocabulary-split
    logits it runs inside ``loss_parallel`` and never gathers them."""
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class MegatronTrainer(BaseTrainer):
    cfg: MegatronTrainerConfig

    def init_distributed(self) -> tuple[int, int]:
        rank, world = super().init_distributed()
        cfg = self.cfg
        if cfg.pipeline_schedule not in SCHEDULES:
            raise ConfigurationError(f"--pipeline-schedule {cfg.pipeline_schedule!r}: one of {', '.join(SCHEDULES)}")
        if world % (cfg.tp * cfg.pp):
            raise ConfigurationError(f"world size {world} is not a multiple of tp x pp = {cfg.tp} x {cfg.pp}")
        self.dp = world // (cfg.tp * cfg.pp)
        if cfg.ep < 1 or self.dp % cfg.ep:
            raise ConfigurationError(f"--ep {cfg.ep} does not divide the data-parallel size {self.dp} (world {world} over tp x pp = {cfg.tp} x {cfg.pp})")
        self.device = torch.device("cpu")
        if torch.cuda.is_available():  # one GPU per process, as torchrun numbers them
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        self.mesh = None
        if world > 1:
            from torch.distributed.device_mesh import init_device_mesh

            self.mesh = init_device_mesh(self.device.type, (cfg.pp, self.dp // cfg.ep, cfg.ep, cfg.tp),
                                         mesh_dim_names=("pp", "edp", "ep", "tp"))
            self.mesh["edp", "ep"]._flatten("dp")
        local = {n: self.mesh[n].get_local_rank() if self.mesh is not None else 0 for n in ("pp", "dp", "tp", "edp")}
        self.pp_rank, self.dp_rank, self.tp_rank, self.edp_rank = local["pp"], local["dp"], local["tp"], local["edp"]
        return rank, world

    def build_model(self) -> torch.nn.Module:
        cfg = self.cfg
        if cfg.lora_rank:
            raise ConfigurationError("--lora-rank: the Megatron-style trainer does not train peft adapters (its layers are "
                                     "split by tensor and pipeline rank); train LoRA with trainers.deepspeed, trainers.accelerate "
                                     "or trainers.base")
        full = build_model(replace(cfg, activation_checkpointing=False))  # the whole model, then this rank's part
        self.hf_config = full.config
        self.architecture = type(full).__name__
        self.full_param_groups = param_group_names(full)
        self.frozen = [n for n, p in full.named_parameters() if not p.requires_grad]
        self.tp_sharding = tensor_sharding(full, cfg.tp)
        # every stage's expert tensors, split over the ep ranks on their first dimension (for the manifest)
        self.split_experts = sorted(n for n, style in expert_plan(full).items() if style == "grouped_gemm") if cfg.ep > 1 else []
        self.layout = stage_layouts(full.config.num_hidden_layers, cfg.pp)[self.pp_rank]
        stage = CausalLMStage(full, self.layout).to(self.device)
        del full
        if cfg.tp > 1:
            apply_tensor_parallel(stage, self.mesh["tp"])
        self.expert_names: list[str] = []
        held = [n for n in self.split_experts if int(n.split(".")[2]) in self.layout.layers]  # model.layers.<i>....
        # a stage without MoE layers (dense first layers, --pp) has nothing to split; a model without any is refused there
        if cfg.ep > 1 and (held or not self.split_experts):
            self.expert_names = apply_expert_parallel(stage, self.mesh["ep"], self.mesh["tp"])
        self.experts = {id(stage.get_parameter(n)) for n in self.expert_names}
        if cfg.activation_checkpointing:
            enable_activation_checkpointing(stage, cfg.recompute_granularity)
        return stage

    def __init__(self, cfg: MegatronTrainerConfig):
        super().__init__(cfg)
        if cfg.batch_size % self.dp:
            raise ConfigurationError(f"--batch-size {cfg.batch_size} does not split evenly over {self.dp} data-parallel replicas")
        self.microbatches = cfg.microbatches or cfg.pp
        if (cfg.batch_size // self.dp) % self.microbatches:
            raise ConfigurationError(f"{cfg.batch_size // self.dp} samples per replica do not split into {self.microbatches} microbatches")
        self.schedule = self._build_schedule() if cfg.pp > 1 else None

    def _build_schedule(self):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        stage = PipelineStage(self.model, self.pp_rank, self.cfg.pp, self.device, group=self.mesh["pp"].get_group())
        kind = ScheduleGPipe if self.cfg.pipeline_schedule == "gpipe" else Schedule1F1B
        return kind(stage, self.microbatches, loss_fn=causal_lm_loss)

    def get_process_groups(self) -> dict[str, Any]:
        if self.mesh is None:
            return {}
        return {name: self.mesh[name].get_group() for name in ("pp", "dp", "tp", "ep", "edp")}

    def core_model(self) -> torch.nn.Module:
        return self.model

    # --- the adapter's view ------------------------------------------------------------------------
    def model_and_optimizer_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

        # flattened optimizer state: one entry per parameter ("state.<name>.exp_avg", "param_groups.<name>.lr"),
        # so stages holding other parameters than at save time still find theirs (torch's option for pipelines)
        options = StateDictOptions(flatten_optimizer_state_dict=True)
        return {"model": get_model_state_dict(self.model),
                "optimizer": get_optimizer_state_dict(self.model, self.optimizer, options=options)}

    def set_model_and_optimizer_state(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

        set_model_state_dict(self.model, state["model"])
        if "optimizer" in state:
            set_optimizer_state_dict(self.model, self.optimizer, state["optimizer"],
                                     options=StateDictOptions(flatten_optimizer_state_dict=True))

    def get_state_components(self) -> list[StateComponent]:
        return [
            # shards identical across a dp group (an edp group with experts split), different across tp, pp and
            # ep: one writer per group (DCP deduplicates the replicas); any other layout reshards on load
            StateComponent(interop_dcp.NATIVE_KEY, DCPModelOptimizer(self), SharingPattern.PER_GROUP,
                           process_group_name="edp" if self.cfg.ep > 1 else "dp", on_world_size_change=WorldSizePolicy.RESHARD),
            StateComponent("scheduler", self.scheduler, SharingPattern.REPLICATED, validate_replication=True),
            StateComponent("data", self.data, SharingPattern.GLOBAL),
            StateComponent("trainer", self.state, SharingPattern.GLOBAL),
            StateComponent("rng", self.rng, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.RESEED),
        ]

    def get_checkpoint_metadata(self) -> dict[str, Any]:
        return {
            "model": model_metadata(self.hf_config, self.architecture, None, self.frozen),
            "sharding": self.sharding_metadata().to_json(),
            "optimizer": {"class": type(self.optimizer).__name__, "param_names": self.full_param_groups},
        }

    def sharding_metadata(self) -> ShardingMetadata:
        cfg = self.cfg
        parallel = [n for n, size in (("dp", self.dp), ("tp", cfg.tp), ("pp", cfg.pp), ("ep", cfg.ep)) if size > 1]
        strategy = {(): Strategy.SINGLE, ("dp",): Strategy.DDP, ("tp",): Strategy.TENSOR_PARALLEL,
                    ("pp",): Strategy.PIPELINE_PARALLEL}.get(tuple(parallel), Strategy.HYBRID)
        layers = self.hf_config.num_hidden_layers
        return ShardingMetadata(
            strategy=strategy, world_size=self.world_size, precision=cfg.dtype, dp=self.dp, tp=cfg.tp, pp=cfg.pp, ep=cfg.ep,
            tensors=self.tp_sharding, expert_tensors=self.split_experts,
            pp_stage_of_layer={f"model.layers.{i}": s.stage for s in stage_layouts(layers, cfg.pp) for i in s.layers},
        )

    # --- the loop ----------------------------------------------------------------------------------
    def next_batch(self) -> torch.Tensor:
        per_replica = self.cfg.batch_size // self.dp
        return self.data.next_batch(self.dataset, per_replica, replica=self.dp_rank, num_replicas=self.dp)

    def _loss_parallel(self):
        import contextlib

        if self.cfg.tp > 1:
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()
        return contextlib.nullcontext()

    def train_step(self, batch: torch.Tensor) -> float:
        self.model.train()
        batch = batch.to(self.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]
        with self._loss_parallel():  # the backward too: it differentiates the vocabulary-parallel loss
            if self.schedule is None:
                loss = causal_lm_loss(self.model(inputs), targets)
                loss.backward()
                local = _mean([loss.detach()])
            else:
                losses: list[torch.Tensor] = []
                args = (inputs,) if self.layout.first else ()
                self.schedule.step(*args, target=targets if self.layout.last else None, losses=losses)
                local = _mean([x.detach() for x in losses]) if self.layout.last else None
        self._all_reduce_gradients()
        self.clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return self._global_loss(local)

    def _all_reduce_gradients(self) -> None:
        """Data parallelism: every replica steps on the mean of the replicas' gradients. An expert's gradient
        already sums its ep group's tokens (the all-to-all's backward brought them): it is summed over the
        ranks holding the same expert (edp, and tp whose ranks ran disjoint token slices) and divided by dp."""
        if self.dp == 1:
            return
        groups = {False: [self.mesh["dp"].get_group()],
                  True: [self.mesh[n].get_group() for n, size in (("edp", self.dp // self.cfg.ep), ("tp", self.cfg.tp)) if size > 1]}
        for p in self.model.parameters():
            if p.grad is not None:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                for group in groups[id(p) in self.experts]:
                    dist.all_reduce(grad, group=group)
                grad.div_(self.dp)

    def clip_gradients(self) -> None:
        """Megatron's clip_grad: the norm over every stage and tensor-parallel shard, each element counted once
        (a replicated norm weight on tp rank 0, data-parallel replicas on dp rank 0, an ep rank's experts on its
        edp rank 0 and tp rank 0), then torch's scaling."""
        if not self.cfg.max_grad_norm:
            return
        params = [p for p in self.model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        squares = torch.zeros((), dtype=torch.float32, device=self.device)
        for p, g, part in zip(params, grads, local):
            if id(p) in self.experts:
                counted = self.edp_rank == 0 and self.tp_rank == 0
            else:
                counted = self.dp_rank == 0 and (self.tp_rank == 0 or any(pl.is_shard() for pl in getattr(g, "placements", ())))
            if counted:
                squares += part.float().pow(2).sum()
        if self.mesh is not None:
            dist.all_reduce(squares)
        coef = torch.clamp(self.cfg.max_grad_norm / (squares.sqrt() + 1e-6), max=1.0)
        if local:
            torch._foreach_mul_(local, coef.to(local[0].dtype))

    def _global_loss(self, local: torch.Tensor | None) -> float:
        """The global batch's loss on every rank: the last stage's tp-rank-0 of each replica contributes."""
        if self.mesh is None:
            return float(local)
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.layout.last and self.tp_rank == 0:
            value += float(local) / self.dp
        dist.all_reduce(value)
        return float(value)

    def memory_stats(self) -> dict[str, Any]:
        """Every rank's memory and activation checkpoints: stages differ, so counts are summed over ranks."""
        count = memory.activation_checkpoints(self.model)
        gathered = self.checkpoints.collective.all_gather_object((memory.sample(self.rank), count))
        summary = memory.summarize([s for s, _ in gathered], sum(c for _, c in gathered))
        summary["activation_checkpoints_per_rank"] = [c for _, c in gathered]
        return summary

    # --- resuming from another format --------------------------------------------------------------
    primary_component = interop_dcp.NATIVE_KEY

    def import_writer(self):
        from converters import registry

        return registry.writes_as("interop-dcp", lambda ckpt, out: interop_dcp.write_interop_dcp(ckpt, out, overwrite=True))


def parse_config(argv: list[str] | None = None) -> MegatronTrainerConfig:
    return base_parse_config(argv, MegatronTrainerConfig, __doc__)


def main(argv: list[str] | None = None) -> None:
    configure_logging(argv)
    run(lambda: MegatronTrainer(parse_config(argv)))


if __name__ == "__main__":
    main()
