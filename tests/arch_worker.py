"""A user's script under torchrun, loading several converted models in one launch (the engines' start-up is the
slow part): for each ``HF_DIR=DST`` argument, the model built from HF_DIR's config.json with other random weights,
then the engine's own loader pointed at our output as a user points it:

- ``deepspeed``: ``deepspeed.initialize`` with ``model.parameters()`` and the config's optimizer at ZeRO ``STAGE``,
  ``engine.load_checkpoint(DST)``;
- ``accelerate``: ``Accelerator().prepare(model, AdamW(decay / no-decay groups))`` (DDP), ``load_state(DST)``;

then every weight and the logits on a fixed batch against the model transformers' own ``from_pretrained(HF_DIR)``
builds. Rank 0 prints one JSON line per model.

    torchrun --nproc_per_node=2 tests/arch_worker.py deepspeed STAGE HF_DIR=DST [HF_DIR=DST ...]
    torchrun --nproc_per_node=2 tests/arch_worker.py accelerate - HF_DIR=DST [HF_DIR=DST ...]
"""

from __future__ import annotations

import json
import sys

import torch


def model_class(config):
    import transformers

    return getattr(transformers, config.architectures[0])


def logits(model, config) -> torch.Tensor:
    ids = (torch.arange(14).reshape(2, 7) * 5) % config.vocab_size
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


def accelerate_load(model, dst: str):
    from accelerate import Accelerator

    from trainers.base import param_groups

    acc = Accelerator(cpu=True)
    optimizer = torch.optim.AdamW(param_groups(model, 0.01), lr=1e-3)
    prepared, _ = acc.prepare(model, optimizer)
    acc.load_state(dst)
    return acc.unwrap_model(prepared), dst, False


def check(engine: str, stage: int, hf_dir: str, dst: str) -> dict:
    import deepspeed
    import transformers

    config = transformers.AutoConfig.from_pretrained(hf_dir)
    cls = model_class(config)
    torch.manual_seed(1234)  # other weights than the checkpoint's: the load must replace every one
    model = cls._from_config(config).eval()
    module, loaded, gather = deepspeed_load(stage, model, dst) if engine == "deepspeed" else accelerate_load(model, dst)
    with deepspeed.zero.GatheredParameters(list(module.parameters()), enabled=gather):
        ours = {k: v.detach().clone() for k, v in module.state_dict().items()}
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

    deepspeed.init_distributed(dist_backend="gloo")
    engine, stage, pairs = sys.argv[1], sys.argv[2], [a.split("=", 1) for a in sys.argv[3:]]
    for hf_dir, dst in pairs:
        result = check(engine, int(stage) if stage != "-" else 0, hf_dir, dst)
        if dist.get_rank() == 0:
            print(json.dumps(result), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
