"""The reference Accelerate trainer: the base trainer's loop on ``Accelerator``, as DDP or FSDP2.

    accelerate launch --config_file examples/ddp.yaml examples/train_accelerate.py --steps 8
    accelerate launch --config_file examples/fsdp2.yaml examples/train_accelerate.py --steps 8
    torchrun --nproc_per_node 2 -m trainers.accelerate --fsdp --mixed-precision bf16 --steps 8

``--batch-size`` is the global batch, split evenly over the processes, so the data order and the losses do
not depend on their number. The learning-rate schedule is prepared with accelerate, which steps it once per
process per optimizer step; its horizons are scaled to match, so the learning rate at each optimizer step is
the same as the other trainers'. On a machine without a GPU, accelerate runs on CPU processes with gloo and,
for FSDP2, through ``trainers.accelerate_compat``.

Model, optimizer, scheduler, RNG states and registered objects are saved by ``accelerator.save_state`` into
``<checkpoint>/accelerate`` inside the commit protocol, so ``accelerator.load_state`` and
``accelerate merge-weights`` work on it directly. Resuming on another number of processes, or switching
between DDP and FSDP2, converts that directory in-process through ``converters.accelerate``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from converters import accelerate as accelerate_format
from converters import dcp as dcp_format
from converters.pickle_safety import numpy_allowlist, weights_only_loads
from interop import SharingPattern, StateComponent, WorldSizePolicy
from interop.sharding import ShardingMetadata, Strategy
from interop.state import NativeLoad
from interop.errors import ConfigurationError

from .accelerate_compat import enable_cpu_fsdp, has_accelerator
from .base import flag, BaseTrainer, TrainerConfig, configure_logging, param_group_names, run
from .base import parse_config as base_parse_config
from .comm_hooks import register_compression
from .staging import deferred_writes, run_all
from .state import OptimizerStateful, live_tensors

log = logging.getLogger(__name__)


@dataclass
class AccelerateTrainerConfig(TrainerConfig):
    fsdp: bool = flag(False, "FSDP2 (fsdp_version=2, sharded state dict) instead of DDP")
    mixed_precision: str = flag("no", "no | bf16")
    comm_hook: str = flag("none", "DDP gradient compression: none | fp16 | bf16 | powersgd")
    powersgd_rank: int = flag(1, "PowerSGD's matrix approximation rank")
    powersgd_start_iter: int = flag(2, "plain all-reduce before this iteration (DDP settles its buckets first)")
    local_sgd_steps: int = flag(0, "DDP: no gradient all-reduce; parameters averaged every K steps (0: off)")
    output_dir: str = "out/accelerate"


def _fsdp_requested(cfg: AccelerateTrainerConfig) -> bool:
    """``--fsdp``, or an ``accelerate launch`` config whose distributed type is FSDP."""
    return cfg.fsdp or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


class AccelerateState:
    """Model, optimizer, scheduler, RNG and registered objects, saved and loaded by accelerate itself, beside
    the manifest: ``accelerator.load_state(checkpoint)`` loads one of the run's checkpoints as it is."""

    native_top = True

    def __init__(self, trainer: "AccelerateTrainer"):
        self.trainer = trainer

    def save_native(self, directory: str) -> None:
        self.trainer.accelerator.save_state(directory)

    def stage_native(self, directory: str, group: Any = None) -> Callable[[], None]:
        """accelerate's ``save_state`` as it is, with what it hands its writers staged in memory now and written
        later: its DCP saves (FSDP2's sharded model and optimizer) over ``group`` (the commit's process group; see
        ``converters.dcp.stage_dcp``), and what it hands ``accelerate.utils.save`` (DDP's weights and optimizer,
        the scheduler, samplers) to that same function. The small files it writes with ``torch.save`` itself
        (RNG states, dataloader and scaler states) are written now."""
        import accelerate.checkpointing as checkpointing
        import torch.distributed.checkpoint as dcp
        from accelerate.state import PartialState

        writers: list[Callable[[], None]] = []
        blocking_dcp_save = dcp.save
        live = live_tensors(self.trainer.model, self.trainer.optimizer)  # for each of the DCP saves below

        def staged_dcp_save(state_dict, *, checkpoint_id=None, storage_writer=None, planner=None, **_):
            writers.append(dcp_format.stage_dcp(state_dict, checkpoint_id, group, storage_writer=storage_writer, planner=planner,
                                                live=live))

        def writes(obj, f, save_on_each_node: bool = False, **_) -> bool:
            process = PartialState()  # the process accelerate's save writes from
            return process.is_local_main_process if save_on_each_node else process.is_main_process

        dcp.save = staged_dcp_save  # accelerate's fsdp_utils calls dcp.save(...) through the module
        try:  # save_accelerator_state calls the save it imported
            with deferred_writes((checkpointing, "save"), writes=writes) as saves:
                self.save_native(directory)
        finally:
            dcp.save = blocking_dcp_save
        return run_all(writers + saves)

    def load_native(self, load: NativeLoad) -> None:
        trainer = self.trainer
        trust = trainer.cfg.trust_pickle
        acc = trainer.accelerator
        saved = accelerate_format.describe(load.directory)
        steps_per_step = int((load.manifest.optimizer or {}).get("scheduler_steps_per_step", saved.num_processes))
        source = load.directory
        # weights converted from a model (step 0) have no schedule, which load_state requires: this run's fresh one
        unscheduled = not load.manifest.step and not os.path.isfile(os.path.join(load.directory, accelerate_format.SCHEDULER_BIN))
        if (saved.num_processes, saved.fsdp, steps_per_step) != (trainer.world_size, trainer.fsdp, trainer.world_size) or unscheduled:
            log.warning(
                "converting %s (%s, %d processes) for this run (%s, %d processes)", load.directory,
                "FSDP2" if saved.fsdp else "DDP", saved.num_processes, "FSDP2" if trainer.fsdp else "DDP", trainer.world_size,
            )
            def convert() -> None:  # the manager has checked every digest; the reader screens every pickle
                ckpt = accelerate_format.read_accelerate(load.directory, trust, verify_digests=False)
                if unscheduled:
                    ckpt.extra_state[accelerate_format.SCHEDULER] = trainer.scheduler.scheduler.state_dict()
                accelerate_format.write_native(ckpt, load.scratch, trainer.world_size, trainer.fsdp)

            trainer.checkpoints.on_rank_zero(convert, what=f"converting {load.directory}")
            source = load.scratch
        # what load_state unpickles passes our restricted loaders first, and its torch.load runs weights-only
        accelerate_format.screen_save_state(source, trust)
        with weights_only_loads(trust, numpy_allowlist()):
            acc.load_state(source)


class LocalSGDCounter:
    """accelerate's LocalSGD step counter, registered with ``register_for_checkpointing`` (custom_checkpoint_0.pkl)."""

    def __init__(self, local_sgd):
        self.local_sgd = local_sgd

    def state_dict(self) -> dict[str, int]:
        return {"num_steps": self.local_sgd.num_steps, "local_sgd_steps": self.local_sgd.local_sgd_steps}

    def load_state_dict(self, state: dict[str, int]) -> None:
        if int(state["local_sgd_steps"]) != self.local_sgd.local_sgd_steps:
            log.warning("local SGD: checkpoint averaged every %s steps, this run every %s", state["local_sgd_steps"],
                        self.local_sgd.local_sgd_steps)
        self.local_sgd.num_steps = int(state["num_steps"])


class AccelerateTrainer(BaseTrainer):
    def init_distributed(self) -> tuple[int, int]:
        from accelerate import Accelerator
        from accelerate.utils import FullyShardedDataParallelPlugin

        self.fsdp = _fsdp_requested(self.cfg)
        plugin = None
        if self.fsdp:
            enable_cpu_fsdp()
            plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT", reshard_after_forward=True)
        handlers = []
        if self.cfg.comm_hook == "powersgd":
            from accelerate.utils import DistributedDataParallelKwargs

            # DDP re-buckets parameters in gradient order after its first iteration, so a restarted process would
            # run its first PowerSGD step on another bucket layout than the run it continues (same maths, other
            # rounding). With find_unused_parameters DDP keeps its first layout: resume is bit-exact.
            handlers.append(DistributedDataParallelKwargs(find_unused_parameters=True))
        self.accelerator = Accelerator(cpu=not has_accelerator(), fsdp_plugin=plugin, mixed_precision=self.cfg.mixed_precision,
                                       kwargs_handlers=handlers)
        acc = self.accelerator
        if self.fsdp and acc.distributed_type.value != "FSDP":
            raise RuntimeError(f"asked for FSDP2 but accelerate set up {acc.distributed_type.value} (one process without torchrun?)")
        return acc.process_index, acc.num_processes

    def build_scheduler(self):
        from transformers import get_linear_schedule_with_warmup

        n = self.world_size  # accelerate steps a prepared scheduler once per process
        return get_linear_schedule_with_warmup(self.optimizer, self.cfg.warmup_steps * n, max(self.cfg.steps, 1) * n)

    def __init__(self, cfg: AccelerateTrainerConfig):
        super().__init__(cfg)
        if cfg.batch_size % self.world_size:
            raise ConfigurationError(f"--batch-size {cfg.batch_size} does not split evenly over {self.world_size} processes")
        if self.fsdp and (cfg.comm_hook != "none" or cfg.local_sgd_steps):
            raise ConfigurationError("--comm-hook and --local-sgd-steps apply to DDP; FSDP2 shards instead of all-reducing whole gradients")
        self.group_names = param_group_names(self.model)
        self.model, self.optimizer, self.scheduler = self.accelerator.prepare(self.model, self.optimizer, self.scheduler)
        self.powersgd = None
        if cfg.comm_hook != "none":
            named = {p: n for n, p in self.core_model().named_parameters()}
            self.powersgd = register_compression(self.model, cfg.comm_hook, named, rank=cfg.powersgd_rank,
                                                 start_iter=cfg.powersgd_start_iter)
        self.local_sgd = None
        if cfg.local_sgd_steps:
            from accelerate.local_sgd import LocalSGD

            self.local_sgd = LocalSGD(self.accelerator, self.model, cfg.local_sgd_steps)
            self.accelerator.register_for_checkpointing(LocalSGDCounter(self.local_sgd))

    def core_model(self) -> torch.nn.Module:
        return self.accelerator.unwrap_model(self.model)

    # --- the adapter's view ------------------------------------------------------------------------
    def get_state_components(self) -> list[StateComponent]:
        components = [
            StateComponent("accelerate", AccelerateState(self), SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.RESHARD),
            StateComponent("data", self.data, SharingPattern.GLOBAL),
            StateComponent("trainer", self.state, SharingPattern.GLOBAL),
            StateComponent("rng", self.rng, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.RESEED),
        ]
        if self.powersgd is not None:  # error feedback and warm-start matrices: each rank's own
            components.append(StateComponent("powersgd", self.powersgd, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.DROP))
        if self.local_sgd is not None:  # between averaging steps each rank's Adam moments are its own; accelerate saves rank 0's
            components.append(StateComponent("local_optimizer", OptimizerStateful(self.core_model(), self.optimizer.optimizer),
                                             SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.DROP))
        return components

    def get_checkpoint_metadata(self) -> dict[str, Any]:
        meta = super().get_checkpoint_metadata()
        meta["optimizer"] = {
            "class": type(self.optimizer.optimizer).__name__,
            "param_names": self.group_names,
            "scheduler_steps_per_step": self.world_size,
        }
        return meta

    primary_component = accelerate_format.NATIVE_KEY

    def import_writer(self):
        from converters import registry

        return registry.writes_as("accelerate", lambda ckpt, out: accelerate_format.write_accelerate(ckpt, out, self.world_size, self.fsdp,
                                                                                                     overwrite=True))

    def sharding_metadata(self) -> ShardingMetadata:
        return ShardingMetadata(
            strategy=Strategy.FSDP if self.fsdp else Strategy.DDP,
            world_size=self.world_size,
            dp=self.world_size,
            precision="bfloat16" if self.cfg.mixed_precision == "bf16" else "float32",
            master_precision="float32" if self.cfg.mixed_precision == "bf16" else None,
            sharding_strategy="full_shard" if self.fsdp else None,
        )

    # --- the loop ----------------------------------------------------------------------------------
    def next_batch(self) -> torch.Tensor:
        per_rank = self.cfg.batch_size // self.world_size
        return self.data.next_batch(self.dataset, per_rank, replica=self.rank, num_replicas=self.world_size)

    def train_step(self, batch: torch.Tensor) -> float:
        import contextlib

        import torch.distributed as dist

        self.model.train()
        batch = batch.to(self.accelerator.device)
        local = self.model.no_sync() if self.local_sgd is not None else contextlib.nullcontext()
        with local:  # local SGD: each process steps on its own gradients
            loss = self.model(input_ids=batch, labels=batch).loss
            self.accelerator.backward(loss)
        self.clip_gradients()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.local_sgd is not None:
            self.local_sgd.step()  # averages the parameters every local_sgd_steps steps
        mean = loss.detach().float()  # reduced where it is: NCCL reduces GPU tensors only
        if dist.is_initialized():
            dist.all_reduce(mean)  # the global batch's loss, whatever the number of processes
        return float(mean) / self.world_size


    def clip_gradients(self) -> None:
        if self.cfg.max_grad_norm:  # accelerate's: the norm over every process's shards (FSDP2) or replicas (DDP)
            self.accelerator.clip_grad_norm_(self.model.parameters(), self.cfg.max_grad_norm)

    def save(self, wait: bool = True) -> str:
        sgd = self.local_sgd
        if sgd is not None and sgd.num_steps % sgd.local_sgd_steps:
            # accelerate saves rank 0's parameters; between averaging steps the ranks' differ. Average first, as
            # leaving LocalSGD's context does; the step counter keeps the schedule.
            log.info("local SGD: averaging parameters before saving (step %d of a %d-step period)",
                     sgd.num_steps % sgd.local_sgd_steps, sgd.local_sgd_steps)
            sgd._sync_and_avg_model_params()
        return super().save(wait)


def parse_config(argv: list[str] | None = None) -> AccelerateTrainerConfig:
    return base_parse_config(argv, AccelerateTrainerConfig, __doc__)


def main(argv: list[str] | None = None) -> None:
    configure_logging(argv)
    run(lambda: AccelerateTrainer(parse_config(argv)))


if __name__ == "__main__":
    main()
