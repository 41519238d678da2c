"""megatron-core's own MoE GPT model on a torch_dist checkpoint we wrote.

    torchrun --nproc_per_node N tests/mcore_moe_worker.py logits CKPT [SAVE]
        load CKPT's weights, write the logits on CKPT/ids.pt to CKPT/mcore_logits.pt (the test compares them with
        transformers' on the source); with SAVE, megatron-core then saves the model itself
    torchrun --nproc_per_node N tests/mcore_moe_worker.py train-save CKPT SAVE
        load CKPT's weights, one AdamW step through megatron-core's optimizers, save model and optimizer to SAVE
        as Megatron-LM does, then the uninterrupted run's next steps (SAVE/losses.json)
    torchrun --nproc_per_node N tests/mcore_moe_worker.py load-train CKPT OUT
        load CKPT's weights and optimizer, train the same next steps (OUT/losses.json)

MCORE_GROUPED=1: GroupedMLP experts (--moe-grouped-gemm on the local spec), the grouped_gemm package's CUDA kernel
done in torch (grouped_gemm_on_cpu). MCORE_CKPT=torch: the same on Megatron-LM's legacy per-rank files
(--ckpt-format torch): each rank loads its own ``mp_rank_TT[_PPP][_EEE]/model_optim_rng.pt`` (model strictly, the ChainedOptimizer's list, the RNG as Megatron-LM's
load_checkpoint restores it) and saves as its save_checkpoint does (every expert-parallel rank its file);
MCORE_SAVE=torch|torch_dist saves in another format than it loads; both: legacy files to SAVE, torch_dist to SAVE_dist.

The model is built as Megatron-LM builds it from the checkpoint's arguments (megatron.training is not on PyPI):
the local spec with SequentialMLP experts (``--num-experts``; GroupedMLP with MCORE_GROUPED), experts over MCORE_EP ranks and
tensor parallelism over the rest, loaded with ``dist_checkpointing.load`` of its own sharded state dict (strict).
The optimizer is what megatron-core's ``get_megatron_optimizer`` makes of a MoE model: at EP > 1 a ChainedOptimizer
of the dense parameters' optimizer and the expert parameters' (its ``_get_param_groups`` split on
``is_expert_parallel``, which only EP > 1 sets), each megatron-core's FP32Optimizer around torch's AdamW. Saves take Megatron-LM's
arguments of its own run (no ``hf_model_type``). On CPU: the all-gather token dispatcher (the all-to-all one
opens CUDA streams when built), and megatron-core 0.16.1's router names ``te_general_gemm`` only when
Transformer Engine imports (set to None here, its own fallback).
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
from tests.mcore_worker import (  # noqa: E402
    STEPS, adam, cpu_patches, data_parallel_step, distributed_optimizer, distributed_optimizer_patches, init_state_fn, megatron_param_groups, train_step,
)


def iteration_dir(directory: str) -> str:
    with open(os.path.join(directory, "latest_checkpointed_iteration.txt")) as f:
        return os.path.join(directory, f"iter_{int(f.read()):07d}")


def grouped_gemm_on_cpu() -> None:
    """megatron-core's GroupedMLP (--moe-grouped-gemm on the local spec) calls the grouped_gemm package's CUDA
    kernel ``gmm(a, b, batch_sizes, trans_b)``: each group of rows of ``a`` times its own ``b[i]``. Here that
    product in torch, which is all the kernel computes; the layout (weight1 / weight2, their views and the
    sharded_state_dict's transposes) stays megatron-core's own."""
    from types import SimpleNamespace

    from megatron.core.transformer.moe import grouped_gemm_util as gg

    def gmm(a, b, batch_sizes, trans_b=False):
        pieces = torch.split(a, batch_sizes.tolist())
        return torch.cat([x @ (w.t() if trans_b else w) for x, w in zip(pieces, b)])

    gg.assert_grouped_gemm_is_available = lambda: None
    gg.ops = SimpleNamespace(gmm=gmm)


def mla_attention_on_cpu() -> None:
    """megatron-core 0.16.1's multi-latent attention hands its core attention the q/k and v head sizes
    (``k_channels``, ``v_channels``), which only Transformer Engine's attention takes. The local spec's
    DotProductAttention computes the same softmax(q k^T x scale) v for any q/k head size (MLA gives it the scale);
    here it takes them and lays its output out by v's head size. The rest (projections, norms, rotary embedding,
    sharded state dict) stays megatron-core's MLA. Without Transformer Engine installed its module also names
    TELinear as None where it asks isinstance(..., TELinear): a class no layer is an instance of, here. Its YaRN
    rotary embedding moves its frequencies to torch.cuda.current_device(): the CPU, here."""
    from megatron.core.models import backends
    from megatron.core.transformer import multi_latent_attention
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    torch.cuda.current_device = lambda: "cpu"  # where megatron-core's YaRN embedding puts its frequencies
    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.TELinear = type("TransformerEngineNotInstalled", (), {})

    class MLACoreAttention(DotProductAttention):
        def __init__(self, *args, k_channels=None, v_channels=None, **kwargs):
            super().__init__(*args, **kwargs)
            if v_channels is not None:  # (megatron-core's Attention base builds one without, which MLA then replaces)
                self.hidden_size_per_partition = v_channels * self.num_attention_heads_per_partition

    backends.LocalSpecProvider.core_attention = lambda self: MLACoreAttention


def build(args, tp: int, ep: int):
    from dataclasses import replace

    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec

    grouped = os.environ.get("MCORE_GROUPED") == "1"  # GroupedMLP experts (weight1 / weight2), megatron-core's layout
    if grouped:
        grouped_gemm_on_cpu()
    base = transformer_config(args, tp)
    config = replace(
        base, num_moe_experts=args.num_experts, moe_router_topk=args.moe_router_topk,
        moe_ffn_hidden_size=args.moe_ffn_hidden_size, moe_token_dispatcher_type="allgather", expert_model_parallel_size=ep,
        moe_router_pre_softmax=bool(getattr(args, "moe_router_pre_softmax", False)), moe_router_load_balancing_type="none",
        moe_shared_expert_intermediate_size=getattr(args, "moe_shared_expert_intermediate_size", None),
        moe_shared_expert_gate=bool(getattr(args, "moe_shared_expert_gate", False)),
        moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped, expert_tensor_parallel_size=ETP or tp,
        **{k: getattr(args, k) for k in CONFIG_ARGS if getattr(args, k, None) is not None},
    )
    for k, v in vars(base).items():  # YaRN's settings: attributes Megatron-LM sets on the config, not its fields
        if k.startswith("yarn_"):
            setattr(config, k, v)
    if getattr(args, "multi_latent_attention", False):  # DeepSeek-V3: megatron-core's config class for MLA
        from dataclasses import fields

        mla_attention_on_cpu()
        from megatron.core.transformer.transformer_config import MLATransformerConfig

        mla = {k: getattr(args, k) for k in MLA_ARGS if hasattr(args, k)}
        config = MLATransformerConfig(**{f.name: getattr(config, f.name) for f in fields(config) if f.init and f.name not in mla}, **mla)
    if isinstance(config.moe_layer_freq, list):  # dense layers first: Megatron-LM's per-layer specs
        spec = get_gpt_decoder_block_spec(config, use_transformer_engine=False)
    else:
        spec = get_gpt_layer_local_spec(num_experts=args.num_experts, moe_grouped_gemm=grouped, qk_layernorm=config.qk_layernorm,
                                        multi_latent_attention=config.multi_latent_attention)
    mtp_spec = None
    if getattr(args, "mtp_num_layers", None):  # --mtp-num-layers: Megatron-LM's gpt_builders, the last decoder layer's spec
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_layer_specs, get_gpt_mtp_block_spec

        torch.cuda.current_device = lambda: "cpu"  # where megatron-core's MTP loss tracker keeps its values
        config = replace(config, mtp_num_layers=args.mtp_num_layers)
        last = get_gpt_decoder_layer_specs(config, use_transformer_engine=False)[-1] if isinstance(config.moe_layer_freq, list) else spec
        mtp_spec = get_gpt_mtp_block_spec(config, last, use_transformer_engine=False)
    model = GPTModel(
        config, spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
        rotary_base=args.rotary_base, rotary_percent=getattr(args, "rotary_percent", 1.0),
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights, mtp_block_spec=mtp_spec,
    )
    if grouped:  # GroupedMLP's forward asserts bf16 (its kernel's dtype): the experts alone are told so, weights stay fp32
        import copy

        from megatron.core.transformer.moe.experts import GroupedMLP

        for module in model.modules():
            if isinstance(module, GroupedMLP):
                module.config = copy.copy(module.config)
                module.config.bf16 = True
    return model


# a sigmoid router with an expert bias, group-limited and scaled (GLM-4.5, DeepSeek-V3), dense layers first: as the
# checkpoint's arguments say
CONFIG_ARGS = ("moe_router_score_function", "moe_router_enable_expert_bias", "moe_router_num_groups", "moe_router_group_topk",
               "moe_router_topk_scaling_factor", "moe_router_dtype", "moe_layer_freq")
# multi-latent attention's sizes and rotary embedding (--multi-latent-attention: MLATransformerConfig)
MLA_ARGS = ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim", "rope_type", "rotary_base",
            "rotary_scaling_factor", "mscale", "mscale_all_dim")


def chained_optimizer(model):
    """get_megatron_optimizer's structure for a MoE model: dense and expert parameters in optimizers of their own."""
    from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer

    config, groups = megatron_param_groups(model)
    parts = [[g for g in groups if bool(g["is_expert_parallel"]) == expert] for expert in (False, True)]
    return ChainedOptimizer([FP32Optimizer(adam(p), config, init_state_fn) for p in parts if p])


# --expert-tensor-parallel-size: the experts' own tensor-parallel size (Megatron-LM's default: the TP size)
ETP = int(os.environ["MCORE_ETP"]) if os.environ.get("MCORE_ETP") else None
# --use-distributed-optimizer: torch_dist in its fully_reshardable or dp_reshardable layout; legacy files (MCORE_CKPT=torch,
# any value) with distrib_optim.pt
DISTOPT = os.environ.get("MCORE_DISTOPT")


def distopt_metadata() -> dict:
    from megatron.core import parallel_state as ps

    return {"distrib_optim_sharding_type": DISTOPT, "singleton_local_shards": False, "chained_optim_avoid_prefix": True,
            "dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}


def own_args(args, tp: int, ep: int, iteration: int) -> argparse.Namespace:
    """The arguments of a Megatron-LM run of its own (no Hugging Face model type or config)."""
    own = {k: v for k, v in vars(args).items() if k not in ("hf_model_type", "hf_config")}
    own.update(expert_model_parallel_size=ep, tensor_model_parallel_size=tp, world_size=tp * ep, iteration=iteration,
               expert_tensor_parallel_size=ETP or tp,
               moe_grouped_gemm=os.environ.get("MCORE_GROUPED") == "1")
    return argparse.Namespace(**own)


def legacy_file(directory: str, iteration: int, tp: int, ep: int) -> str:
    """Megatron-LM's get_checkpoint_name: mp_rank_TT, _PPP with pipeline stages (none here), _EEE with expert ranks."""
    from megatron.core import parallel_state as ps

    name = f"mp_rank_{ps.get_tensor_model_parallel_rank():02d}" + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else "")
    return os.path.join(directory, f"iter_{iteration:07d}", name, "model_optim_rng.pt")


def save_legacy(model, optimizer, args, directory: str, iteration: int, tp: int, ep: int) -> None:
    """Megatron-LM's save_checkpoint with --ckpt-format torch: each (TP, EP) rank's state (every rank here is its
    expert data-parallel group's rank 0), the optimizer's state_dict (a ChainedOptimizer's: a list)."""
    import random

    import numpy as np

    file = legacy_file(directory, iteration, tp, ep)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    rng = {"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(), "torch_rng_state": torch.get_rng_state()}
    if DISTOPT:  # --use-distributed-optimizer: distrib_optim.pt beside, each part written by its DP group's rank 0
        args.use_distributed_optimizer = True
        optimizer.save_parameter_state(os.path.join(os.path.dirname(file), "distrib_optim.pt"))
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "model": getattr(model, "module", model).state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                "rng_state": [rng]}, file)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def save(model, optimizer, args, directory: str, iteration: int) -> None:
    from megatron.core import dist_checkpointing

    path = os.path.join(directory, f"iter_{iteration:07d}")
    if dist.get_rank() == 0:
        os.makedirs(path)
    dist.barrier()
    metadata = distopt_metadata() if DISTOPT else None
    sharded = getattr(model, "module", model).sharded_state_dict(metadata=metadata)
    state = {"model": sharded, "args": args, "checkpoint_version": 3.0, "iteration": iteration}
    if optimizer is not None:
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    if DISTOPT:
        args.use_distributed_optimizer, args.ckpt_format = True, "torch_dist"
        content = {k: v for k, v in metadata.items() if k != "dp_cp_group"}
        dist_checkpointing.save(state, path, content_metadata=content)
    else:
        dist_checkpointing.save(state, path)
    if dist.get_rank() == 0:
        with open(os.path.join(directory, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write(str(iteration))


def main() -> None:
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.transformer.moe import moe_utils

    scenario, directory = sys.argv[1], sys.argv[2]
    out = sys.argv[3] if len(sys.argv) > 3 else None
    dist.init_process_group("gloo")
    cpu_patches()
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    ep = int(os.environ.get("MCORE_EP", "1"))
    tp = dist.get_world_size() // ep
    ps.initialize_model_parallel(tp, 1, expert_model_parallel_size=ep, expert_tensor_parallel_size=ETP)
    source = iteration_dir(directory)
    legacy = os.environ.get("MCORE_CKPT") == "torch"
    save_as = os.environ.get("MCORE_SAVE", os.environ.get("MCORE_CKPT", "torch_dist"))  # torch, torch_dist or both
    if legacy:
        from converters.megatron import load_megatron_file
        from tests.mcore_worker import megatron_lm_restore_rng

        state = load_megatron_file(legacy_file(directory, int(os.path.basename(source)[5:]), tp, ep))
        args = state["args"]
    else:
        args = dist_checkpointing.load_common_state_dict(source)["args"]
    torch.manual_seed(0)
    model = build(args, tp, ep)
    optimizer = None
    if scenario != "logits":
        distributed_optimizer_patches()  # ChainedOptimizer's step takes the grad norm with a CUDA buffer
        if DISTOPT:
            model, optimizer = distributed_optimizer(model)  # Megatron-LM's DDP + get_megatron_optimizer: chained at EP > 1
        else:
            optimizer = chained_optimizer(model)
    if legacy:
        megatron_lm_restore_rng(state["rng_state"], args.seed)
        result = getattr(model, "module", model).load_state_dict(state["model"], strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
        if scenario == "load-train":
            assert isinstance(state["optimizer"], list) == (ep > 1), type(state["optimizer"])  # a ChainedOptimizer of two at EP > 1
            optimizer.load_state_dict(state["optimizer"])
            if DISTOPT:  # then Megatron-LM's load_parameter_state (mcore_worker.load_distributed)
                for inner in optimizer.chained_optimizers:
                    for st in inner.optimizer.state.values():
                        st["step"] = st["step"].clone()
                with torch.no_grad():
                    optimizer.load_parameter_state(os.path.join(os.path.dirname(legacy_file(directory, int(os.path.basename(source)[5:]), tp, ep)),
                                                                "distrib_optim.pt"))
    else:
        metadata = distopt_metadata() if DISTOPT and scenario == "load-train" else None
        if metadata is not None:
            assert dist_checkpointing.load_content_metadata(source) == {k: v for k, v in metadata.items() if k != "dp_cp_group"}
            for inner in optimizer.chained_optimizers:  # what TE/Apex's Adam allocates up front (mcore_worker.dist_distributed)
                for g in inner.optimizer.param_groups:
                    for p in g["params"]:
                        inner.optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(0.0)}
        sharded = getattr(model, "module", model).sharded_state_dict(metadata=metadata)
        request = {"model": sharded}
        if scenario == "load-train":
            request["optimizer"] = optimizer.sharded_state_dict(request, is_loading=True, metadata=metadata)
        loaded = dist_checkpointing.load(request, source)
        getattr(model, "module", model).load_state_dict(loaded["model"], strict=True)
        if scenario == "load-train":
            with torch.no_grad():
                optimizer.load_state_dict(loaded["optimizer"])
            if DISTOPT:
                for inner in optimizer.chained_optimizers:  # torch's AdamW keeps the step per parameter (see mcore_worker)
                    for g in inner.optimizer.param_groups:
                        for p in g["params"]:
                            inner.optimizer.state[p]["step"] = torch.tensor(float(g["step"]))
    step = data_parallel_step if DISTOPT else train_step
    experts = [n for n, _ in model.named_parameters() if ".mlp.experts." in n]  # SequentialMLP's per expert, GroupedMLP's 2
    with open(os.path.join(directory, f"rank{dist.get_rank()}.json"), "w") as f:  # each rank its own file: prints interleave
        json.dump({"rank": dist.get_rank(), "ep_rank": ps.get_expert_model_parallel_rank(), "local_experts": len(experts)}, f)
    if scenario == "logits":
        model.eval()
        ids = torch.load(os.path.join(directory, "ids.pt"))
        b, s = ids.shape
        mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
        if getattr(args, "mtp_num_layers", None):  # the main and each MTP layer's hidden states, through the output layer
            held = {}
            model.mtp.register_forward_hook(lambda module, inputs, output: held.setdefault("states", output))
            with torch.no_grad():  # (with MTP layers, GPTModel's forward needs labels: any)
                model(ids, torch.arange(s).expand(b, s), attention_mask=mask, labels=ids)
                each = [gather_from_tensor_model_parallel_region(model.output_layer(h)[0]).transpose(0, 1)[..., : args.vocab_size]
                        for h in torch.chunk(held["states"], 1 + args.mtp_num_layers, dim=0)]
            logits = each[0]
            if dist.get_rank() == 0:
                torch.save(torch.stack(each[1:]), os.path.join(directory, "mcore_mtp_logits.pt"))
        else:
            with torch.no_grad():
                logits = model(ids, torch.arange(s).expand(b, s), attention_mask=mask)
            logits = gather_from_tensor_model_parallel_region(logits)[..., : args.vocab_size]
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(directory, "mcore_logits.pt"))
        if out is not None:
            save(model, None, own_args(args, tp, ep, 1), out, 1)
    else:
        model.train()
        if tp > 1:  # MoELayer refuses to train at TP > 1 without --sequence-parallel (a performance guard: gloo has no
            # reduce-scatter for it on CPU); with no dropout, no token drop and no aux loss its eval forward is the same math
            from megatron.core.transformer.moe.moe_layer import MoELayer

            for module in model.modules():
                if isinstance(module, MoELayer):
                    module.train(False)
        losses = []
        if scenario == "train-save":
            step(model, optimizer, 0)
            if save_as in ("torch", "both"):
                save_legacy(model, optimizer, own_args(args, tp, ep, 1), out, 1, tp, ep)
            if save_as in ("torch_dist", "both"):
                save(model, optimizer, own_args(args, tp, ep, 1), out + ("_dist" if save_as == "both" else ""), 1)
        losses += [step(model, optimizer, i) for i in range(1, STEPS)]
        if dist.get_rank() == 0:
            with open(os.path.join(out, "losses.json"), "w") as f:
                json.dump(losses, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
