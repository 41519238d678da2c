"""Worker for the DeepSpeed tests, started by torchrun: real deepspeed.initialize and save_checkpoint.

    torchrun --nproc_per_node 2 tests/ds_worker.py layouts OUT           # one short run per stage x precision
    torchrun --nproc_per_node N tests/ds_worker.py train [trainer flags]  # train (and resume), save, print JSON
    torchrun --nproc_per_node N tests/ds_worker.py reload [trainer flags] # resume, save at once, train on
    torchrun --nproc_per_node N tests/ds_worker.py user-load SRC OUT CONFIG single|decay
        # a user's own script, no trainer of ours: deepspeed.initialize(model, model_parameters=model.parameters()
        # (single) or transformers' decay / no-decay groups (decay), config=CONFIG), load_checkpoint(SRC), save to OUT
    torchrun --nproc_per_node N tests/ds_worker.py staged OUT [trainer flags]
        # at step 2 a blocking save into OUT/blocking, then a staged one into OUT/staged whose background write is
        # held until step 3 has changed every parameter and optimizer tensor in place
    torchrun --nproc_per_node N tests/ds_worker.py load SRC OUT [trainer flags]
        # a user's script: engine.load_checkpoint(SRC) (load_universal if the config says so), nothing of ours
        # in between; the engine then saves natively to OUT for the test to read; prints JSON

The model is a tiny Llama with awkward sizes (hidden 45, intermediate 101: flat groups and norms do not divide
evenly by the world size), tied embeddings, a frozen MLP and a persistent buffer.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from trainers.base import run, shutdown
from trainers.deepspeed import DeepSpeedTrainer, DeepSpeedTrainerConfig, parse_config, unlink_cpu_shm_names

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from odd_model import odd_model  # noqa: E402
LAYOUTS = [(stage, dtype) for dtype in ("float32", "bfloat16") for stage in (1, 2, 3)]


class OddTrainer(DeepSpeedTrainer):
    def build_model(self) -> torch.nn.Module:
        return odd_model()


def layouts(out: str) -> None:
    for stage, dtype in LAYOUTS:
        cfg = DeepSpeedTrainerConfig(zero_stage=stage, dtype=dtype, steps=2, batch_size=4, seq_len=16,
                                     output_dir=os.path.join(out, f"z{stage}-{dtype}"))
        trainer = OddTrainer(cfg)
        trainer.train()
        trainer.save()
    shutdown()


def reload(cfg: DeepSpeedTrainerConfig) -> None:
    """Resume, save straight away (what the load produced), then train on: the test checks both."""
    trainer = OddTrainer(cfg)
    step = trainer.resume(cfg.resume)
    trainer.checkpoints.name_format = "loaded-{step}"
    trainer.save()
    trainer.checkpoints.name_format = "checkpoint-{step}"
    losses = trainer.train()
    if trainer.rank == 0:
        print(json.dumps({"resumed_at": step, "losses": losses}), flush=True)
    shutdown()


def load(src: str, out: str, cfg: DeepSpeedTrainerConfig) -> None:
    """What DeepSpeed's own load_checkpoint (or load_universal) makes of SRC, pointed at it as a user would,
    saved back by the engine for the test to read."""
    trainer = OddTrainer(cfg)
    engine = trainer.engine
    loaded, _ = engine.load_checkpoint(src)
    engine.save_checkpoint(out, tag="loaded")
    groups = engine.optimizer.optimizer.param_groups  # the torch optimizer's groups (ZeRO-3: one per sub-group)
    if trainer.rank == 0:
        print(json.dumps({"loaded": loaded, "global_steps": engine.global_steps,
                          "weight_decay": [g["weight_decay"] for g in groups], "lr": [g["lr"] for g in groups]}), flush=True)
    shutdown()


def user_load(src: str, out: str, config: str, grouping: str) -> None:
    import deepspeed
    import transformers

    deepspeed.init_distributed(dist_backend="gloo")
    unlink_cpu_shm_names()
    torch.manual_seed(0)  # other weights than the checkpoint's: the load must replace them all
    model = odd_model()
    if grouping == "single":
        params = model.parameters()
    else:
        decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        params = [{"params": [p for n, p in named if n in decay]}, {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
    with open(config) as f:
        ds_config = json.load(f)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config)
    loaded, _ = engine.load_checkpoint(src)
    engine.save_checkpoint(out, tag="loaded")
    if engine.global_rank == 0:
        print(json.dumps({"loaded": loaded, "global_steps": engine.global_steps,
                          "groups": len(engine.optimizer.optimizer.param_groups)}), flush=True)
    shutdown()


def staged(out: str, cfg: DeepSpeedTrainerConfig) -> None:
    import threading

    import interop.checkpoint as manager_module
    from interop import CheckpointManager

    trainer = OddTrainer(cfg)
    trainer.train(until=2)
    CheckpointManager(os.path.join(out, "blocking"), trainer).save(2)
    gate = threading.Event()
    real = manager_module.PendingCommit

    class HeldCommit(real):  # the background work starts only once the gate opens
        def __init__(self, work, name):
            super().__init__(lambda: (gate.wait(), work())[1], name)

    manager_module.PendingCommit = HeldCommit
    later = CheckpointManager(os.path.join(out, "staged"), trainer)
    later.save(2, wait=False, stage=True)
    losses = trainer.train(until=3)  # the engine's tensors change in place while the staged state waits
    gate.set()
    later.wait()
    if trainer.rank == 0:
        print(json.dumps({"losses": losses}), flush=True)
    shutdown()


if __name__ == "__main__":
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "layouts":
        layouts(args[0])
    elif scenario == "train":
        run(lambda: OddTrainer(parse_config(args)))
    elif scenario == "reload":
        reload(parse_config(args))
    elif scenario == "user-load":
        user_load(*args)
    elif scenario == "staged":
        staged(args[0], parse_config(args[1:]))
    elif scenario == "load":
        load(args[0], args[1], parse_config(args[2:]))
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    # Every scenario has left the process group and its files are committed. About one exit in ten of a
    # DeepSpeed CPU run aborts in native teardown ("terminate called without an active exception") after all
    # work is done; leaving without running C++ static destructors keeps that from failing a finished test.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
