"""megatron-core's own MoE GPT model loads a torch_dist checkpoint we wrote and writes its logits, which the test
compares with transformers' on the source.

    torchrun --nproc_per_node N tests/mcore_moe_worker.py CKPT_DIR [SAVE_DIR]  (CKPT_DIR/ids.pt in, CKPT_DIR/mcore_logits.pt out)

With SAVE_DIR, megatron-core then saves the model itself (``dist_checkpointing.save`` of its sharded state dict at
this EP x TP, with the arguments as a Megatron-LM run of its own has them: no ``hf_model_type``).

The model is built as Megatron-LM builds it from the checkpoint's arguments (megatron.training is not on PyPI):
the local spec with SequentialMLP experts (``--num-experts``, no grouped GEMM), experts over MCORE_EP ranks and
tensor parallelism over the rest (``--expert-model-parallel-size``, ``--tensor-model-parallel-size``), loaded
with ``dist_checkpointing.load`` of the model's own sharded state dict, every key present. On CPU: the
all-gather token dispatcher (the all-to-all one opens CUDA streams when built), and megatron-core 0.16.1's
router names ``te_general_gemm`` only when Transformer Engine imports (set to None here, its own fallback).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.mcore_family_worker import transformer_config  # noqa: E402
from tests.mcore_worker import cpu_patches  # noqa: E402


def main() -> None:
    from dataclasses import replace

    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.moe import moe_utils

    directory = sys.argv[1]
    dist.init_process_group("gloo")
    cpu_patches()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    ep = int(os.environ.get("MCORE_EP", "1"))
    tp = dist.get_world_size() // ep
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep)
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
        iteration_dir = os.path.join(directory, f"iter_{int(f.read()):07d}")
    args = dist_checkpointing.load_common_state_dict(iteration_dir)["args"]
    config = replace(
        transformer_config(args, tp), num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
        moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0,
    )
    model = GPTModel(
        config, get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=False), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
    )
    loaded = dist_checkpointing.load({"model": model.sharded_state_dict()}, iteration_dir)
    model.load_state_dict(loaded["model"], strict=True)
    model.eval()
    ids = torch.load(os.path.join(directory, "ids.pt"))
    b, s = ids.shape
    with torch.no_grad():
        out = model(ids, torch.arange(s).expand(b, s), attention_mask=torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1))
    logits = gather_from_tensor_model_parallel_region(out)[..., : args.vocab_size]
    experts = [n for n, _ in model.named_parameters() if ".local_experts." in n]
    if len(sys.argv) > 2:
        save = os.path.join(sys.argv[2], "iter_0000001")
        if dist.get_rank() == 0:
            os.makedirs(save)
        dist.barrier()
        own = {k: v for k, v in vars(args).items() if k not in ("hf_model_type", "hf_config")}
        own.update(expert_model_parallel_size=ep, tensor_model_parallel_size=tp, world_size=tp * ep)
        own = argparse.Namespace(**own)
        dist_checkpointing.save({"model": model.sharded_state_dict(), "args": own, "checkpoint_version": 3.0, "iteration": 1}, save)
        if dist.get_rank() == 0:
            with open(os.path.join(sys.argv[2], "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")
    if dist.get_rank() == 0:
        torch.save(logits, os.path.join(directory, "mcore_logits.pt"))
    print(json.dumps({"rank": dist.get_rank(), "ep_rank": ps.get_expert_model_parallel_rank(), "local_experts": len(experts)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
