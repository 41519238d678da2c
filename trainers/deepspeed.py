"""The reference DeepSpeed trainer: the base trainer's loop on ``deepspeed.initialize``, ZeRO stage 1, 2 or 3.

    deepspeed --num_gpus 2 examples/train_deepspeed.py --deepspeed_config examples/ds_zero2.json --steps 8
    torchrun --nproc_per_node 2 -m trainers.deepspeed --zero-stage 3 --dtype bfloat16 --steps 8

The DeepSpeed config is the user's own JSON (``--deepspeed_config``); without one, ``--zero-stage`` and
``--dtype`` build a minimal one. ``train_batch_size`` is the global batch, so the data order and the losses do
not depend on the number of ranks. On a machine without a GPU the trainer selects DeepSpeed's CPU accelerator
and gloo, and asks for torch's Adam instead of the fused one that would need compiling.

Model and optimizer are saved by DeepSpeed's own ``save_checkpoint`` into ``<checkpoint>/deepspeed`` inside the
commit protocol, so ``zero_to_fp32.py`` and ``engine.load_checkpoint`` work on it directly. Resuming on another
world size, ZeRO stage or precision converts that directory in-process through ``converters.deepspeed``.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from dataclasses import dataclass
from typing import Any, Callable

import torch

from converters import deepspeed as deepspeed_zero
from converters.deepspeed_writer import write_deepspeed, write_native
from converters.pickle_safety import real_globals, screen_pickles, weights_only_loads
from interop import SharingPattern, StateComponent, WorldSizePolicy
from interop.sharding import ShardingMetadata, Strategy
from interop.errors import TopologyError
from interop.logs import library_prints
from interop.background import staged
from interop.state import NativeLoad

from .base import flag, BETAS, BaseTrainer, TrainerConfig, config_parser, configure_logging, resolve_backend, run

log = logging.getLogger(__name__)


@dataclass
class DeepSpeedTrainerConfig(TrainerConfig):
    deepspeed_config: str | None = flag(None, "the user's DeepSpeed JSON; flags below only fill what it leaves out")
    zero_stage: int = flag(2, "ZeRO stage 1, 2 or 3 (when --deepspeed-config sets none)")
    output_dir: str = "out/deepspeed"


def _prepare_cpu() -> None:
    """DeepSpeed on a machine without CUDA: its CPU accelerator, and a process-group env for a bare launch."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if "RANK" not in os.environ:  # started as plain `python`: a group of one
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))


def unlink_cpu_shm_names() -> None:
    """Unlink this rank's name of DeepSpeed's CPU shared-memory allreduce buffer once every rank has mapped it.

    On the CPU accelerator, with all ranks on one machine, ``init_distributed`` makes one 66 MiB segment per rank
    (``ops/csrc/cpu/comm/shm.cpp``: ``/dev/shm/deepspeed_allreduce_buffer_<uid>_<addr>_<port>_<rank>``) and never
    unlinks it, so each run would leave its ranks' buffers in RAM until reboot. The mappings stay valid after the
    unlink; no rank opens a name again once the barrier shows every rank through its initialize."""
    import torch.distributed as dist

    if torch.cuda.is_available():  # the same answer on every rank: no rank waits in a barrier alone
        return
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{os.environ.get('MASTER_ADDR', '')}_" \
           f"{os.environ.get('MASTER_PORT', '')}_{dist.get_rank()}"
    dist.barrier()
    try:
        os.unlink(name)
    except FileNotFoundError:  # its ranks are not all local (LOCAL_SIZE): no segment was made
        pass


def deepspeed_config(cfg: DeepSpeedTrainerConfig) -> dict[str, Any]:
    """The user's config, completed: batch size, ZeRO stage and precision from flags where it has none."""
    if cfg.deepspeed_config:
        with open(cfg.deepspeed_config, encoding="utf-8") as f:
            config = json.load(f)
    else:
        config = {"zero_optimization": {"stage": cfg.zero_stage}}
        if cfg.dtype in ("bfloat16", "bf16"):
            config["bf16"] = {"enabled": True}
        elif cfg.dtype in ("float16", "fp16"):
            config["fp16"] = {"enabled": True}
    if "train_batch_size" not in config and "train_micro_batch_size_per_gpu" not in config:
        config["train_batch_size"] = cfg.batch_size
    config.setdefault("gradient_clipping", cfg.max_grad_norm)  # DeepSpeed's default is 1.0 too; the flag sets it
    config.setdefault("steps_per_print", 1 << 30)
    config.setdefault("zero_optimization", {"stage": 0})
    optimizer = config.get("optimizer")
    if optimizer and not torch.cuda.is_available() and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        optimizer.setdefault("params", {}).setdefault("torch_adam", True)
    return config


class _StagingCheckpointEngine:
    """Stands in for a DeepSpeed engine's checkpoint engine during a staged save: ``save`` keeps a copy of the state
    dict in memory (storage sharing kept, so the file written later is what the engine would have written now);
    everything else is the engine's own."""

    def __init__(self, own: Any):
        self.own = own
        self.staged: list[tuple[Any, str]] = []

    def save(self, state_dict: Any, path: str) -> None:
        self.staged.append((staged(state_dict), path))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.own, name)


class DeepSpeedEngineState:
    """The engine's model and optimizer, saved and loaded by DeepSpeed itself (a native component). Its files
    lie beside the manifest (tag ``.``), so the run's ``latest`` naming ``checkpoint-<step>`` is the tag
    DeepSpeed reads: ``engine.load_checkpoint(output_dir)`` loads a run's newest checkpoint as it is."""

    native_top = True

    def __init__(self, trainer: "DeepSpeedTrainer"):
        self.trainer = trainer

    def save_native(self, directory: str) -> None:
        self.trainer.engine.save_checkpoint(directory, tag=".", save_latest=False)

    def stage_native(self, directory: str, group: Any = None) -> Callable[[], None]:
        """DeepSpeed's ``save_checkpoint`` as it is (its collectives, its choice of what each rank writes), with a
        checkpoint engine that copies each state dict it is handed into memory; the returned writer gives them to
        the engine's own checkpoint engine later, on the background thread."""
        engine = self.trainer.engine
        own = engine.checkpoint_engine
        staging = _StagingCheckpointEngine(own)
        engine.checkpoint_engine = staging
        try:
            self.save_native(directory)
        finally:
            engine.checkpoint_engine = own

        def write() -> None:
            for state, path in staging.staged:
                own.save(state, path)
            staging.staged.clear()

        return write

    def load_native(self, load: NativeLoad) -> None:
        trainer = self.trainer
        trust = trainer.cfg.trust_pickle
        info = deepspeed_zero.describe(load.directory, trust)
        target = deepspeed_zero.NativeLayout(trainer.world_size, trainer.zero_stage, trainer.precision)
        source = load.directory
        if not info.layout.loads_as(target):
            log.warning("converting %s (%s) to %s for this run", load.directory, info.layout.describe(), target.describe())
            def convert() -> None:  # the manager has checked every digest; the reader screens every pickle
                ckpt = deepspeed_zero.read_deepspeed(load.directory, trust, verify_digests=False)
                write_native(ckpt, load.scratch, target, ds_config=trainer.engine.config, step=load.manifest.step,
                             grouping="source")  # this trainer groups as its checkpoints do

            trainer.checkpoints.on_rank_zero(convert, what=f"converting {load.directory}")
            source = load.scratch
        # every rank's engine unpickles every rank's files (DeepSpeed reads all optimizer partitions): each file
        # passes the restricted loader first, the tag is the one we validated, and the engine's own torch.load
        # runs weights-only
        tag_dir = deepspeed_zero.locate(source)
        screen_pickles(sorted(glob.glob(os.path.join(tag_dir, "*.pt"))), trust, deepspeed_zero.DEEPSPEED_ALLOWLIST)
        saved_shapes = deepspeed_zero.param_shapes(source, trust)
        engine_shapes = [{n: tuple(s) for n, s in g.items()} for g in trainer.engine._get_zero_param_shapes()]
        if [list(g.items()) for g in saved_shapes] != [list(g.items()) for g in engine_shapes]:
            raise TopologyError(
                f"{source}: the checkpoint's parameter groups ({[len(g) for g in saved_shapes]} parameters) do not "
                f"match this engine's ({[len(g) for g in engine_shapes]}): different model, frozen set or grouping"
            )
        with weights_only_loads(trust, real_globals(deepspeed_zero.DEEPSPEED_ALLOWLIST)):
            path, _ = trainer.engine.load_checkpoint(os.path.dirname(tag_dir), tag=os.path.basename(tag_dir), load_lr_scheduler_states=False)
        if path is None:
            raise RuntimeError(f"deepspeed found no checkpoint to load in {source}")


class DeepSpeedTrainer(BaseTrainer):
    def init_distributed(self) -> tuple[int, int]:
        _prepare_cpu()
        import deepspeed

        with library_prints(self.cfg.verbose, __name__):  # its CPU communication op announces itself on stdout
            deepspeed.init_distributed(dist_backend=resolve_backend(self.cfg.backend))
        unlink_cpu_shm_names()
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def build_model(self) -> torch.nn.Module:
        from dataclasses import replace

        from .base import build_model

        return build_model(replace(self.cfg, dtype="float32"))  # DeepSpeed casts to its configured precision

    def build_optimizer(self, groups: list[dict[str, Any]]) -> torch.optim.Optimizer:
        import deepspeed

        self.ds_config = deepspeed_config(self.cfg)
        client = None
        if "optimizer" not in self.ds_config:
            client = torch.optim.AdamW(groups, lr=self.cfg.lr, betas=BETAS)
        self.engine, optimizer, _, lr_scheduler = deepspeed.initialize(
            model=self.model, optimizer=client, model_parameters=groups, config=self.ds_config
        )
        self.zero_stage = int(self.engine.zero_optimization_stage())
        self.precision = deepspeed_zero.precision_of_config(self.ds_config)
        self.engine_scheduler = lr_scheduler
        return getattr(optimizer, "optimizer", optimizer)  # the torch optimizer inside the ZeRO wrapper

    def build_scheduler(self):
        if self.engine_scheduler is not None:  # the config declares one; the engine steps it
            return self.engine_scheduler
        return super().build_scheduler()

    # --- the adapter's view ------------------------------------------------------------------------
    def get_state_components(self) -> list[StateComponent]:
        return [
            StateComponent("deepspeed", DeepSpeedEngineState(self), SharingPattern.PER_RANK,
                           on_world_size_change=WorldSizePolicy.RESHARD),
            StateComponent("scheduler", self.scheduler, SharingPattern.GLOBAL),
            StateComponent("data", self.data, SharingPattern.GLOBAL),
            StateComponent("trainer", self.state, SharingPattern.GLOBAL),
            StateComponent("rng", self.rng, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.RESEED),
        ]

    primary_component = deepspeed_zero.NATIVE_KEY

    def import_writer(self):
        layout = deepspeed_zero.NativeLayout(self.world_size, self.zero_stage, self.precision)
        from converters import registry

        return registry.writes_as("deepspeed", lambda ckpt, out: write_deepspeed(ckpt, out, layout, self.engine.config, overwrite=True,
                                                                                 grouping="source"))

    def sharding_metadata(self) -> ShardingMetadata:
        return ShardingMetadata(
            strategy=Strategy.ZERO,
            world_size=self.world_size,
            dp=self.world_size,
            precision=self.precision,
            master_precision="float32",
            zero_stage=self.zero_stage,
        )

    # --- the loop ----------------------------------------------------------------------------------
    def next_batch(self) -> torch.Tensor:
        per_rank = self.engine.train_micro_batch_size_per_gpu() * self.engine.gradient_accumulation_steps()
        return self.data.next_batch(self.dataset, per_rank, replica=self.rank, num_replicas=self.world_size)

    def train_step(self, batch: torch.Tensor) -> float:
        import torch.distributed as dist

        self.engine.train()
        losses = []
        for micro in batch.split(self.engine.train_micro_batch_size_per_gpu()):
            micro = micro.to(self.engine.device)
            loss = self.engine(input_ids=micro, labels=micro).loss
            self.engine.backward(loss)
            self.engine.step()
            losses.append(loss.detach().float())  # reduced on the engine's device: NCCL reduces GPU tensors only
        if self.engine_scheduler is None:
            self.scheduler.step()
        mean = torch.stack(losses).mean()
        dist.all_reduce(mean)  # the global batch's loss, whatever the number of ranks
        return float(mean) / self.world_size


def parse_config(argv: list[str] | None = None) -> DeepSpeedTrainerConfig:
    from dataclasses import fields

    parser = config_parser(DeepSpeedTrainerConfig, __doc__)
    parser.add_argument("--deepspeed_config", dest="deepspeed_config", help="DeepSpeed JSON config, as for any DeepSpeed script")
    parser.add_argument("--deepspeed", action="store_true", help="accepted for DeepSpeed launcher compatibility")
    args = vars(parser.parse_args(argv))
    return DeepSpeedTrainerConfig(**{f.name: args[f.name] for f in fields(DeepSpeedTrainerConfig)})


def main(argv: list[str] | None = None) -> None:
    configure_logging(argv)
    run(lambda: DeepSpeedTrainer(parse_config(argv)))


if __name__ == "__main__":
    main()
