"""A torchrun worker running megatron-core 0.16.1 on CPU (gloo) with Megatron-LM's pipeline splits: virtual stages
(the interleaved schedule: each rank holds MCORE_VPP model chunks) and uneven stages (MCORE_FIRST / MCORE_LAST
layers on the first / last stage; MCORE_ACCOUNT=embedding,loss: those counted as layers), over MCORE_LAYERS layers of mcore_worker's model at MCORE_TP x MCORE_PP (the
rest data parallel); MCORE_EXPERTS / MCORE_EP: its MoE twin, experts over expert-parallel ranks.

    save-legacy CKPT OUT / load-legacy CKPT OUT: megatron-core's FP32Optimizer over every chunk; each rank's
        model_optim_rng.pt as Megatron-LM's save_checkpoint writes it with --ckpt-format torch (model0, model1, ...
        with virtual stages).
    save-legacy-distopt / load-legacy-distopt: DistributedDataParallel per chunk (bucketing the first chunk only,
        as Megatron-LM's get_model does) and the DistributedOptimizer over them; distrib_optim.pt beside.
    save-dist-distopt / load-dist-distopt: the same through torch_dist, in MCORE_DISTOPT_LAYOUT
        (fully_reshardable, or Megatron-LM's default dp_reshardable).

A step runs one micro-batch through the chunks in the interleaved schedule's order (chunk v of every stage, then
v + 1), activations and gradients sent between stages; the losses (OUT/losses.json) are the whole batch's mean.
Loads restore the RNG as Megatron-LM does and train on from step 1.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from tests.mcore_worker import (
    DTYPE, LR, PADDED, STEPS, TIED, batch, cpu_patches, distributed_args, distributed_load, distributed_optimizer_patches,
    init_state_fn, legacy_path, megatron_lm_load_dir, megatron_lm_restore_rng, write_results,
)

LAYERS = int(os.environ.get("MCORE_LAYERS", "4"))
VPP = int(os.environ.get("MCORE_VPP", "1"))
FIRST = int(os.environ["MCORE_FIRST"]) if os.environ.get("MCORE_FIRST") else None
LAST = int(os.environ["MCORE_LAST"]) if os.environ.get("MCORE_LAST") else None
ACCOUNT = set(filter(None, os.environ.get("MCORE_ACCOUNT", "").split(",")))  # "embedding", "loss": counted as layers
LAYOUT = os.environ.get("MCORE_LAYOUT") or None  # --pipeline-model-parallel-layout (MCORE_VPP: its segments / PP)
BUCKET = int(os.environ.get("MCORE_BUCKET", "0")) or None
# a MoE model: MCORE_EXPERTS SequentialMLP experts (top-2 softmax routing) over MCORE_EP expert-parallel ranks
EXPERTS = int(os.environ.get("MCORE_EXPERTS", "0"))
EP = int(os.environ.get("MCORE_EP", "1"))
HIDDEN = 48


def vp(v: int) -> int | None:
    return v if VPP > 1 else None


def build(tp: int, pp: int) -> list:
    """This rank's model chunks, as Megatron-LM's get_model builds them (vp_stage v, pre/post-processing on the
    first chunk of the first stage and the last chunk of the last)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, pp, virtual_pipeline_model_parallel_size=vp(VPP), expert_model_parallel_size=EP)
    moe = dict(num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=100, moe_token_dispatcher_type="allgather",
               moe_router_load_balancing_type="none", moe_aux_loss_coeff=0.0, expert_model_parallel_size=EP) if EXPERTS else {}
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=LAYERS, hidden_size=HIDDEN, ffn_hidden_size=100, num_attention_heads=4, num_query_groups=2, kv_channels=12,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=DTYPE, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=DTYPE,
        virtual_pipeline_model_parallel_size=vp(VPP), num_layers_in_first_pipeline_stage=FIRST,
        num_layers_in_last_pipeline_stage=LAST, account_for_embedding_in_pipeline_split="embedding" in ACCOUNT,
        account_for_loss_in_pipeline_split="loss" in ACCOUNT, pipeline_model_parallel_layout=LAYOUT, **moe,
    )
    return [GPTModel(cfg, get_gpt_layer_local_spec(num_experts=EXPERTS or None), vocab_size=PADDED, max_sequence_length=64, position_embedding_type="rope",
                     share_embeddings_and_output_weights=TIED, pre_process=ps.is_pipeline_first_stage(False, vp(v)),
                     post_process=ps.is_pipeline_last_stage(False, vp(v)), vp_stage=vp(v))
            for v in range(VPP)]


def pipeline_args(tp: int, pp: int):
    """Megatron-LM's args of this run (after its validate_args): the model's, the distributed optimizer's and the
    pipeline split's flags."""
    args = distributed_args(tp, pp)
    args.num_layers = LAYERS
    args.virtual_pipeline_model_parallel_size = args.num_virtual_stages_per_pipeline_rank = vp(VPP)
    if LAYOUT:  # Megatron-LM's validate_args: the layout alone sets the virtual stages
        args.pipeline_model_parallel_layout, args.num_virtual_stages_per_pipeline_rank = LAYOUT, None
    args.decoder_first_pipeline_num_layers, args.decoder_last_pipeline_num_layers = FIRST, LAST
    args.account_for_embedding_in_pipeline_split = "embedding" in ACCOUNT
    args.account_for_loss_in_pipeline_split = "loss" in ACCOUNT
    if EXPERTS:
        args.num_experts, args.moe_router_topk, args.moe_ffn_hidden_size = EXPERTS, 2, 100
        args.moe_router_load_balancing_type, args.expert_model_parallel_size, args.moe_grouped_gemm = "none", EP, False
    return args


def step(chunks, optimizer, index: int, ddp: bool) -> float:
    """One step of the batch's data-parallel rows through every chunk (forward in schedule order, backward in
    reverse), then Megatron-LM's finalize_model_grads and the optimizer step; the whole batch's mean loss."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads
    from megatron.core.utils import get_attr_wrapped_model

    rows = batch(index)[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]
    tokens, labels = rows[:, :-1], rows[:, 1:]
    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    prev, nxt = ps.get_pipeline_model_parallel_prev_rank(), ps.get_pipeline_model_parallel_next_rank()
    if ddp:
        for c in chunks:
            c.zero_grad_buffer()
    optimizer.zero_grad()
    outs, received = [], []
    for v, chunk in enumerate(chunks):
        got = None
        if not ps.is_pipeline_first_stage(False, vp(v)):
            got = torch.empty(s, b, HIDDEN, dtype=DTYPE)
            dist.recv(got, src=prev)
            got.requires_grad_(True)
            get_attr_wrapped_model(chunk, "set_input_tensor")(got)
        out = chunk(tokens, pos, attention_mask=mask, labels=labels)
        if not ps.is_pipeline_last_stage(False, vp(v)):
            dist.send(out.detach().contiguous(), dst=nxt)
        outs.append(out)
        received.append(got)
    mean = torch.zeros(())
    for v in reversed(range(len(chunks))):
        if ps.is_pipeline_last_stage(False, vp(v)):
            mean = outs[v].float().mean()
            mean.backward()
        else:
            grad = torch.empty_like(outs[v])
            dist.recv(grad, src=nxt)
            torch.autograd.backward(outs[v], grad)
        if received[v] is not None:
            dist.send(received[v].grad.contiguous(), dst=prev)
    if ddp:
        for c in chunks:
            c.finish_grad_sync()
        _allreduce_word_embedding_grads(chunks, chunks[0].config)
    else:  # the plain optimizer: data-parallel gradients averaged, the tied embedding's summed over its two stages
        for c in chunks:
            for p in c.parameters():
                if p.grad is not None:
                    dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
                    p.grad /= ps.get_data_parallel_world_size()
        if TIED and ps.get_pipeline_model_parallel_world_size() > 1 and ps.is_rank_in_embedding_group():
            held = chunks[0] if ps.is_pipeline_first_stage() else chunks[-1]
            dist.all_reduce(held.shared_embedding_or_output_weight().grad, group=ps.get_embedding_group())
    ok, _, _ = optimizer.step()
    assert ok
    loss = mean.detach().clone()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def plain_optimizer(chunks):
    """megatron-core's FP32Optimizer over every chunk's parameters (_get_param_groups, chunk by chunk)."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups
    from megatron.core.optimizer.optimizer import FP32Optimizer

    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0)
    groups = _get_param_groups(chunks, config, None)
    for g in groups:
        g["weight_decay"] = config.weight_decay * g.get("wd_mult", 1.0)
    return FP32Optimizer(torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8), config, init_state_fn)


def distributed(chunks):
    """DistributedDataParallel per chunk (bucketing only the first, Megatron-LM's get_model) and megatron-core's
    DistributedOptimizer over them."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    distributed_optimizer_patches()
    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=BUCKET is not None, bucket_size=BUCKET)
    wrapped = [DistributedDataParallel(c.config, ddp_config, c, disable_bucketing=v > 0) for v, c in enumerate(chunks)]
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=0.0, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, wrapped)
    for g in optimizer.param_groups:
        g["weight_decay"], g["lr"] = config.weight_decay * g.get("wd_mult", 1.0), LR
    return wrapped, optimizer


def model_keys(chunks) -> list[str]:
    return ["model"] if len(chunks) == 1 else [f"model{v}" for v in range(len(chunks))]


def legacy(save: bool, path: str, tp: int, pp: int, ddp: bool) -> list[float]:
    """Megatron-LM's --ckpt-format torch save (after one step) or load (then steps 1..)."""
    from converters.megatron import load_megatron_file
    from megatron.core import parallel_state as ps

    # the plain optimizer here is one FP32Optimizer, its gradients averaged over the data-parallel group: not
    # megatron-core's ChainedOptimizer of a MoE model at EP > 1 (the -distopt scenarios run that)
    assert ddp or EP == 1, "a MoE model at EP > 1 runs the distributed optimizer here"
    chunks = build(tp, pp)
    chunks, optimizer = distributed(chunks) if ddp else (chunks, plain_optimizer(chunks))
    modules = [c.module for c in chunks] if ddp else chunks
    if save:
        losses = [step(chunks, optimizer, 0, ddp)]
        file = legacy_path(path, tp, pp, 1, EP)
        os.makedirs(os.path.dirname(file), exist_ok=True)
        if ddp:
            optimizer.save_parameter_state(os.path.join(os.path.dirname(file), "distrib_optim.pt"))
        if ps.get_expert_data_parallel_rank() == 0:  # Megatron-LM's save_checkpoint: a file per TP x PP x EP rank
            state = {"args": pipeline_args(tp, pp), "checkpoint_version": 3.0, "iteration": 1, "optimizer": optimizer.state_dict(),
                     "rng_state": [{"random_rng_state": __import__("random").getstate(),
                                    "np_rng_state": __import__("numpy").random.get_state(), "torch_rng_state": torch.get_rng_state()}]}
            state["args"].use_distributed_optimizer = ddp
            for key, m in zip(model_keys(chunks), modules):
                state[key] = m.state_dict_for_save_checkpoint()
            torch.save(state, file)
        dist.barrier()
        if dist.get_rank() == 0:
            with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")
        return losses + [step(chunks, optimizer, i, ddp) for i in range(1, STEPS)]
    _, iteration = megatron_lm_load_dir(path)
    file = legacy_path(path, tp, pp, iteration, EP)
    state = load_megatron_file(file)
    megatron_lm_restore_rng(state["rng_state"], state["args"].seed)
    for key, m in zip(model_keys(chunks), modules):  # Megatron-LM's load_checkpoint: model<i> into chunk i
        result = m.load_state_dict(state[key], strict=True)
        assert not result.missing_keys and not result.unexpected_keys, result
    optimizer.load_state_dict(state["optimizer"])
    if ddp:
        for inner in optimizer.chained_optimizers:  # one shared 'step' tensor otherwise (see mcore_worker)
            for s in inner.optimizer.state.values():
                s["step"] = s["step"].clone()
        with torch.no_grad():
            optimizer.load_parameter_state(os.path.join(os.path.dirname(file), "distrib_optim.pt"))
    return [step(chunks, optimizer, i, ddp) for i in range(1, STEPS)]


def torch_dist(save: bool, path: str, tp: int, pp: int) -> list[float]:
    """Megatron-LM's --ckpt-format torch_dist save / load with the distributed optimizer (see mcore_worker's
    dist_distributed): generate_state_dict's model<i> per chunk."""
    from megatron.core import dist_checkpointing, parallel_state as ps

    chunks, optimizer = distributed(build(tp, pp))
    layout = os.environ.get("MCORE_DISTOPT_LAYOUT", "fully_reshardable")
    metadata = {"distrib_optim_sharding_type": layout, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    group = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    if save:
        losses = [step(chunks, optimizer, 0, True)]
        directory = os.path.join(path, "iter_0000001")
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        args = pipeline_args(tp, pp)
        args.ckpt_format = "torch_dist"
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 1}
        for key, c in zip(model_keys(chunks), chunks):
            state[key] = c.module.sharded_state_dict(metadata={**metadata, **group})
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata={**metadata, **group})
        dist_checkpointing.save(state, directory, content_metadata=metadata)
        if dist.get_rank() == 0:
            with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")
        return losses + [step(chunks, optimizer, i, True) for i in range(1, STEPS)]
    directory, _ = megatron_lm_load_dir(path)
    loaded_metadata = dist_checkpointing.load_content_metadata(directory)
    assert loaded_metadata == metadata, loaded_metadata
    state = {key: c.module.sharded_state_dict(metadata={**loaded_metadata, **group}) for key, c in zip(model_keys(chunks), chunks)}
    loaded = distributed_load(state, optimizer, directory, tp, pp, {**loaded_metadata, **group})
    for key, c in zip(model_keys(chunks), chunks):
        if key in loaded:  # Megatron-LM's load_checkpoint: a chunk with nothing to load (an empty stage) is absent
            c.module.load_state_dict(loaded[key], strict=True)
    return [step(chunks, optimizer, i, True) for i in range(1, STEPS)]


def megatron_core_split(n, pp, vpp, first, last, emb, loss):
    """megatron-core's [stage][chunk] [offset, count] (get_transformer_layer_offset, get_num_layers_to_build), or
    None where it refuses the setting or places the layers other than once each in chunk order (a split Megatron-LM's
    own argument checks refuse before megatron-core sees it)."""
    import itertools

    from megatron.core.transformer.transformer_block import get_num_layers_to_build
    from megatron.core.transformer.transformer_config import TransformerConfig
    from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

    if pp == 1 and (first is not None or last is not None or vpp > 1):
        return None  # Megatron-LM's validate_args refuses these
    try:
        cfg = TransformerConfig(num_layers=n, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                                virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None, num_layers_in_first_pipeline_stage=first,
                                num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=emb,
                                account_for_loss_in_pipeline_split=loss, pipeline_dtype=torch.float32)
        vp_ = (lambda v: v) if vpp > 1 else (lambda v: None)
        split = [[[get_transformer_layer_offset(cfg, vp_(v), p), get_num_layers_to_build(cfg, vp_(v), p)] for v in range(vpp)]
                 for p in range(pp)]
    except (ValueError, AssertionError, ZeroDivisionError):
        return None
    at = 0
    for v, p in itertools.product(range(vpp), range(pp)):
        offset, count = split[p][v]
        if offset != at or count < 0:
            return None
        at += count
    return split if at == n else None


def megatron_core_layout(n, pp, layout):
    """megatron-core's [stage][chunk] [offset, count] for a --pipeline-model-parallel-layout string (its
    TransformerConfig parses and checks it), or None where it or Megatron-LM's validate_args refuses it."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.enums import LayerType
    from megatron.core.transformer.transformer_config import TransformerConfig

    try:
        cfg = TransformerConfig(num_layers=n, hidden_size=8, num_attention_heads=2, pipeline_model_parallel_size=pp,
                                pipeline_model_parallel_layout=layout, pipeline_dtype=torch.float32)
    except (ValueError, AssertionError, NotImplementedError, KeyError, IndexError):
        return None
    vpp = cfg.virtual_pipeline_model_parallel_size or 1
    if vpp > 1 and pp == 1:
        return None  # Megatron-LM's validate_args refuses virtual stages without pipeline stages
    # what get_transformer_layer_offset / get_num_layers_to_build ask of the layout, for each rank (the layout
    # reads the virtual stage count from parallel_state, the rank where none is given)
    ps.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    layout, decoder = cfg.pipeline_model_parallel_layout, LayerType.decoder
    return [[[layout.get_layer_offset(decoder, v, p), layout.get_num_layers_to_build(decoder, v, p)] for v in range(vpp)]
            for p in range(pp)]


def main() -> None:
    if sys.argv[1] in ("grid", "layout-grid"):  # settings as JSON on stdin -> megatron-core's split of each on stdout
        import json
        import warnings

        warnings.filterwarnings("ignore")
        split = megatron_core_split if sys.argv[1] == "grid" else megatron_core_layout
        print(json.dumps([split(*setting) for setting in json.load(sys.stdin)]))
        return
    scenario, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tp, pp = int(os.environ["MCORE_TP"]), int(os.environ["MCORE_PP"])
    os.makedirs(out, exist_ok=True)
    dist.init_process_group("gloo")
    cpu_patches()
    if EXPERTS:
        from megatron.core.transformer.moe import moe_utils

        if not hasattr(moe_utils, "te_general_gemm"):  # megatron-core 0.16.1 names it only when TE imports
            moe_utils.te_general_gemm = None
    save = scenario.startswith("save")
    if scenario.endswith("dist-distopt"):
        losses = torch_dist(save, path, tp, pp)
    else:
        losses = legacy(save, path, tp, pp, ddp=scenario.endswith("distopt"))
    write_results(out, losses)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # megatron-core's checkpoint writer starts helper processes that import this module
    main()
