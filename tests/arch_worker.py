"""A user's script under torchrun, loading several converted models in one launch (the engines' start-up is the
slow part): for each ``HF_DIR=DST`` argument, the model built from HF_DIR's config.json with other random weights,
then the engine's own loader pointed at our output as a user points it:

- ``deepspeed``: ``deepspeed.initialize`` with ``model.parameters()`` and the config's optimizer at ZeRO ``STAGE``,
  ``engine.load_checkpoint(DST)``;
- ``accelerate``: ``Accelerator().prepare(model, AdamW(decay / no-decay groups))`` (DDP), ``load_state(DST)``;
- ``fsdp2``: the same with accelerate's FSDP2 plugin (``SHARDED_STATE_DICT``), the weights gathered by
  ``get_model_state_dict(full_state_dict=True)``;

then every weight and the logits on a fixed batch against the model transformers' own ``from_pretrained(HF_DIR)``
builds. Rank 0 prints one JSON line per model.

    torchrun --nproc_per_node=2 tests/arch_worker.py deepspeed STAGE HF_DIR=DST [HF_DIR=DST ...]
    torchrun --nproc_per_node=2 tests/arch_worker.py accelerate|fsdp2 - HF_DIR=DST [HF_DIR=DST ...]
"""

from __future__ import annotations

import json
import sys

import torch


def model_class(config):
    import transformers

    return getattr(transformers, config.architectures[0])


def logits(model, config) -> torch.Tensor:
    ids = (torch.arange(14).reshape(2, 7) * 5) % config.get_text_config().vocab_size
    extra = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
    with torch.no_grad():
        return model(input_ids=ids, **extra).logits.float()


def deepspeed_load(stage: int, model, dst: str):
    import deepspeed

    ds_config = {"train_batch_size": 2, "zero_optimization": {"stage": stage},
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config)
    loaded, _ = engine.load_checkpoint(dst)
    return engine.module, loaded, stage == 3


def accelerate_load(model, dst: str, fsdp: bool):
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    from trainers.accelerate_compat import enable_cpu_fsdp
    from trainers.base import param_groups

    plugin = None
    if fsdp:
        enable_cpu_fsdp()
        plugin = FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type="SHARDED_STATE_DICT")
    acc = Accelerator(cpu=True, fsdp_plugin=plugin)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3)
    prepared, _ = acc.prepare(model, optimizer)
    acc.load_state(dst)
    return (prepared if fsdp else acc.unwrap_model(prepared)), dst, False


def full_state(module, fsdp: bool) -> dict[str, torch.Tensor]:
    if not fsdp:
        return {k: v.detach().clone() for k, v in module.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def check(engine: str, stage: int, hf_dir: str, dst: str) -> dict:
    import deepspeed
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = model_class(config)
    torch.manual_seed(1234)  # other weights than the checkpoint's: the load must replace every one
    model = cls._from_config(config).eval()
    for p in model.parameters():  # trainable as from_pretrained leaves every loaded weight, one a module builds frozen
        p.requires_grad_(p.is_floating_point())  # too (Ernie 4.5 MoE's e_score_correction_bias: our note says so)
    fsdp = engine == "fsdp2"
    module, loaded, gather = deepspeed_load(stage, model, dst) if engine == "deepspeed" else accelerate_load(model, dst, fsdp)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=gather):
        ours = full_state(module, fsdp)
        ours_logits = logits(module.eval(), config)
    reference = cls.from_pretrained(hf_dir).eval()
    theirs = reference.state_dict()
    return {
        "hf": hf_dir, "loaded": loaded,
        "missing": sorted(set(theirs) - set(ours)), "unexpected": sorted(set(ours) - set(theirs)),
        "different": sorted(k for k in theirs if k in ours and not torch.equal(ours[k], theirs[k])),
        "logits_equal": bool(torch.equal(ours_logits, logits(reference, config))),
    }


def main() -> None:
    import deepspeed
    import torch.distributed as dist

    from trainers.deepspeed import unlink_cpu_shm_names

    deepspeed.init_distributed(dist_backend="gloo")
    unlink_cpu_shm_names()
    engine, stage, pairs = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
    for hf_dir, dst in pairs:
        try:
            result = check(engine, int(stage) if stage != "-" else 0, hf_dir, dst)
        except ValueError as exc:  # the engine cannot run this model at all (FSDP2 and T5's three-way tie): said, and
            # the next model goes on (every rank raises the same, before any collective is left half done)
            result = {"hf": hf_dir, "engine_error": str(exc).splitlines()[0]}
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
