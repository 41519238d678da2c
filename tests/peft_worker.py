"""A user's own LoRA fine-tuning script on real DeepSpeed, started by torchrun (nothing of ours in it).

    torchrun --nproc_per_node 2 tests/peft_worker.py BASE OUT STAGE

BASE is a tiny Llama's save_pretrained directory. The script wraps it with peft's LoRA (r=4, alpha=8, q_proj and
v_proj), runs deepspeed.initialize with ZeRO-STAGE and AdamW, trains 3 steps, and saves as users do: the engine's
save_checkpoint(OUT), then peft's model.save_pretrained(OUT) (adapter_config.json, and adapter_model.safetensors:
under ZeRO-3 the partitioned, empty adapter tensors: DeepSpeed #7900, PEFT #2892). OUT/logits.pt: the trained
model's logits on OUT/../ids.pt (ZeRO-3: parameters gathered).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

STEPS, LR = 3, 1e-2


def main() -> None:
    import deepspeed
    import transformers
    from peft import LoraConfig, get_peft_model

    base, out, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
    from trainers.deepspeed import unlink_cpu_shm_names

    deepspeed.init_distributed("gloo")
    unlink_cpu_shm_names()
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "optimizer": {"type": "AdamW", "params": {"lr": LR, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad], config=config)
    vocab = model.config.vocab_size
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 + 10 * step + dist.get_rank())
        ids = torch.randint(0, vocab, (2, 9), generator=g)
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(out)
    model.save_pretrained(out)  # what a user adds: the adapter directory (peft's own save)
    ids = torch.load(os.path.join(os.path.dirname(out), "ids.pt"))
    model.eval()
    params = list(model.parameters()) if stage == 3 else []
    with deepspeed.zero.GatheredParameters(params), torch.no_grad():
        logits = model(input_ids=ids).logits
    if dist.get_rank() == 0:
        torch.save(logits, os.path.join(out, "logits.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
