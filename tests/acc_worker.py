"""Worker for the Accelerate tests, started by torchrun: real Accelerator, prepare, save_state and load_state.

    torchrun --nproc_per_node N tests/acc_worker.py train [trainer flags]   # our trainer: train/resume, save, JSON
    torchrun --nproc_per_node N tests/acc_worker.py load_state SRC OUT [--fsdp]
        # a plain accelerate script (no interop): prepare, accelerator.load_state(SRC), then the full model and
        # optimizer state gathered to rank 0 and saved to OUT for the test to compare

The model is ds_worker's odd Llama: awkward sizes, tied embeddings, a frozen MLP and a persistent buffer.
"""

from __future__ import annotations

import os
import sys

import torch

from trainers.accelerate import AccelerateTrainer, parse_config
from trainers.accelerate_compat import enable_cpu_fsdp
from trainers.base import BETAS, param_groups, run, shutdown

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from odd_model import odd_model  # noqa: E402


class OddTrainer(AccelerateTrainer):
    def build_model(self) -> torch.nn.Module:
        return odd_model()


def load_state(src: str, out: str, fsdp: bool) -> None:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from transformers import get_linear_schedule_with_warmup

    plugin = None
    if fsdp:
        enable_cpu_fsdp()
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    torch.manual_seed(0)  # a different initialisation from the run's: everything must come from the checkpoint
    model = odd_model()
    optimizer = torch.optim.AdamW(param_groups(model, 0.1), lr=3e-3, betas=BETAS)
    scheduler = get_linear_schedule_with_warmup(optimizer, 2 * acc.num_processes, 4 * acc.num_processes)
    model, optimizer, scheduler = acc.prepare(model, optimizer, scheduler)
    acc.load_state(src)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = {
        "model": get_model_state_dict(model, options=options),
        "optimizer": get_optimizer_state_dict(model, optimizer, options=options),
        "scheduler": scheduler.scheduler.state_dict(),
        "distributed_type": acc.distributed_type.value,
    }
    if acc.is_main_process:
        torch.save(state, out)
    shutdown()


if __name__ == "__main__":
    scenario, args = sys.argv[1], sys.argv[2:]
    if scenario == "train":
        run(lambda: OddTrainer(parse_config(args)))
    elif scenario == "load_state":
        load_state(args[0], args[1], "--fsdp" in args[2:])
    else:
        raise SystemExit(f"unknown scenario {scenario!r}")
    # As in ds_worker: every scenario has left its process group and committed its files; skip C++ static
    # destructors, where a gloo CPU process now and then aborts ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
