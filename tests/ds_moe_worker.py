"""A model with DeepSpeed's own MoE layers (deepspeed.moe.layer.MoE, experts split over expert-parallel ranks,
tokens dispatched by all-to-all on gloo), trained and saved by real DeepSpeed: what tests/test_deepspeed_moe.py
reads and writes.

    train STAGE EP STEPS OUT: train STEPS steps, save_checkpoint(OUT, tag="ckpt"); every parameter's fp32 weight
        and Adam moments as the engine holds them (each expert under its global number) to OUT/truth.pt
    load STAGE EP CKPT OUT: load_checkpoint(CKPT) into a fresh model, the same dump to OUT/truth.pt, then one
        more step's loss
"""

from __future__ import annotations

import json
import os
import sys

import deepspeed
import torch
from deepspeed.moe.layer import MoE
from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
from deepspeed.utils import safe_get_full_fp32_param

VOCAB, HIDDEN, FFN, EXPERTS, LAYERS = 50, 16, 24, 4, 2


class Net(torch.nn.Module):
    def __init__(self, ep: int):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, HIDDEN)
        self.moe = torch.nn.ModuleList([
            MoE(HIDDEN, torch.nn.Sequential(torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)),
                num_experts=EXPERTS, ep_size=ep, k=1, min_capacity=16) for _ in range(LAYERS)])
        self.head = torch.nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        h, aux = self.emb(ids), 0.0
        for layer in self.moe:
            out, loss, _ = layer(h)
            h, aux = h + out, aux + loss
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), ids.flatten()) + 0.01 * aux


def engine_for(stage: int, ep: int):
    from trainers.deepspeed import unlink_cpu_shm_names

    deepspeed.init_distributed("gloo")
    unlink_cpu_shm_names()
    torch.manual_seed(0)
    model = Net(ep)
    groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()), "name": "dense"})
    config = {"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def batch(engine, step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(1000 * step + engine.global_rank))


def global_name(engine, name: str) -> str:
    """An expert parameter's name with its global expert number, as DeepSpeed's expert files name it."""
    marker = ".deepspeed_moe.experts.deepspeed_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    layer = engine.module.get_submodule(head)
    local, rest = tail.split(".", 1)
    rank = deepspeed.utils.groups._get_expert_parallel_rank(layer.expert_group_name)
    return f"{head}{marker}{rank * layer.num_local_experts + int(local)}.{rest}"


def full_state(engine, p: torch.nn.Parameter, key: str) -> torch.Tensor:
    """deepspeed.utils.safe_get_full_optimizer_state, for groups whose state DeepSpeed keeps padded: it raises
    "exp_avg not found in optimizer state fragment" for the expert group, whose state is longer than its fp32
    partition. The same gather (tensor_fragment.get_full_hp_param), with the state cut to the partition."""
    buffer = torch.zeros(p.numel(), dtype=torch.float32)
    mapping = p._hp_mapping
    if mapping is not None:
        ptr = mapping.hp_fragment.untyped_storage().data_ptr()
        flat = next(f for f in engine.optimizer.single_partition_of_fp32_groups if f.untyped_storage().data_ptr() == ptr)
        state = engine.optimizer.optimizer.state[flat][key].flatten()
        address, lp = mapping.hp_fragment_address, mapping.lp_fragment_address
        buffer.narrow(0, lp.start, lp.numel).copy_(state.narrow(0, address.start, address.numel))
    torch.distributed.all_reduce(buffer, group=p._dp_group)
    return buffer.reshape(p.shape)


def dump(engine, path: str) -> None:
    """Each rank's parameters under global names (every call is collective: all ranks make all of them)."""
    out = {}
    for name, p in engine.module.named_parameters():
        entry = {"w": safe_get_full_fp32_param(p).clone()}
        for key in ("exp_avg", "exp_avg_sq"):
            entry[key] = full_state(engine, p, key)
        out[global_name(engine, name)] = entry
    torch.save(out, f"{path}.rank{engine.global_rank}")


def main() -> None:
    mode, stage, ep = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    engine = engine_for(stage, ep)
    if mode == "train":
        steps, out = int(sys.argv[4]), sys.argv[5]
        for step in range(steps):
            loss = engine(batch(engine, step))
            engine.backward(loss)
            engine.step()
        engine.save_checkpoint(out, tag="ckpt")
        dump(engine, os.path.join(out, "truth.pt"))
    else:
        ckpt, out = sys.argv[4], sys.argv[5]
        path, _ = engine.load_checkpoint(ckpt, load_module_strict=True)
        os.makedirs(out, exist_ok=True)
        dump(engine, os.path.join(out, "truth.pt"))
        loss = engine(batch(engine, 99))
        if engine.global_rank == 0:
            print(json.dumps({"loaded": path, "loss": float(loss)}), flush=True)


if __name__ == "__main__":
    main()
