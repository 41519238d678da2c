"""A torchrun worker running megatron-core 0.16.1 itself on CPU (gloo): a GPTModel shaped like the tests' Llama.

    save-legacy CKPT OUT: one AdamW step through megatron-core's FP32Optimizer, then each rank's file as
        Megatron-LM's save_checkpoint writes it with --ckpt-format torch (its generate_state_dict: args,
        checkpoint_version, iteration, model, optimizer, rng_state); then the logits on a fixed batch
        (OUT/logits.pt) and the uninterrupted run's remaining steps (OUT/losses.json, every step's loss).
    save-dist CKPT OUT: the same with megatron-core's own dist_checkpointing.save (torch_dist): args, iteration,
        model and optimizer as Megatron-LM's save_checkpoint hands them to it with --ckpt-format torch_dist.
    save-dist-distopt CKPT OUT / load-dist-distopt CKPT OUT: the same through torch_dist, the optimizer's
        sharded_state_dict in the 'fully_reshardable' layout (Megatron-LM's --dist-ckpt-optim-fully-reshardable), with
        the content metadata Megatron-LM saves and reads back.
    load-legacy-distopt CKPT OUT: the same model and optimizer at MCORE_TP (the rest data parallel) load a
        checkpoint we wrote with --use-distributed-optimizer as Megatron-LM does, then train on from step 1.
    save-legacy-distopt CKPT OUT (2 ranks, TP1 PP1: data parallel 2): the same through megatron-core's
        DistributedDataParallel and DistributedOptimizer (each rank a half of every batch, the optimizer state
        sharded over the two), saved as Megatron-LM does with --use-distributed-optimizer: model_optim_rng.pt
        and the gathered distrib_optim.pt (DistributedOptimizer.save_parameter_state).
    load-legacy[+optimizer] CKPT OUT, load-dist[+optimizer] CKPT OUT: load a checkpoint we wrote into megatron-core, then
        train on the same batches: from step 1 with its optimizer state (+optimizer), else from step 0 with a
        fresh optimizer. The losses go to OUT/losses.json.

Every load restores the RNG as Megatron-LM's load_checkpoint does (legacy: always; torch_dist: at the
checkpoint's own TP x PP), checking the CUDA and tracker states against megatron-core's own seeding.

MCORE_BF16=1 runs every scenario in bf16: Float16Module and megatron-core's Float16OptimizerWithFloat16Params, whose fp32
main params are the weights' truth.

megatron-core's CPU patches live here, in the tests only: its GPT model asks for the CUDA device and RNG
tracker where a CPU run has neither.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

VOCAB, PADDED, SEQ = 250, 256, 16
STEPS, LR = 3, 1e-2


def cpu_patches() -> None:
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.synchronize = lambda *a, **k: None
    real_tensor = torch.tensor

    def tensor(*args, **kwargs):  # FP32Optimizer keeps its loss scale on device='cuda'
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real_tensor(*args, **kwargs)

    torch.tensor = tensor
    from megatron.core.tensor_parallel import random as mrandom

    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


def distributed_optimizer_patches() -> None:
    """What megatron-core 0.16.1's DDP + DistributedOptimizer (and its bf16 optimizer) also need without CUDA,
    TransformerEngine or Apex."""
    real_zeros = torch.zeros

    def zeros(*args, **kwargs):  # clip_grads.get_grad_norm_fp32's dummy overflow buffer
        if kwargs.get("device") == "cuda":
            kwargs["device"] = "cpu"
        return real_zeros(*args, **kwargs)

    torch.zeros = zeros
    real_type = torch.Tensor.type

    def type_(self, *args, **kwargs):  # DistributedOptimizer accepts only torch.cuda.{Float,Half,BFloat16}Tensor
        out = real_type(self, *args, **kwargs)
        if not args and not kwargs and isinstance(out, str) and out.startswith("torch.") and ".cuda." not in out:
            return "torch.cuda." + out[len("torch."):]
        return out

    torch.Tensor.type = type_
    torch.Tensor.cuda = lambda self, *a, **k: self
    # without TE/Apex the inner optimizer is torch's AdamW, whose per-parameter state also holds 'step', which
    # distrib_optim.pt does not (the step is the param groups'): keep the one load_state_dict set
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    real_set = DistributedOptimizer._set_main_param_and_optimizer_states

    def set_states(self, model_param, tensors):
        if "step" not in tensors:
            group_index, group_order = self.model_param_group_index_map[model_param]
            main_param = self.optimizer.param_groups[group_index]["params"][group_order]
            if "step" in self.optimizer.state[main_param]:
                tensors = {**tensors, "step": self.optimizer.state[main_param]["step"]}
        return real_set(self, model_param, tensors)

    DistributedOptimizer._set_main_param_and_optimizer_states = set_states


def megatron_args(tp: int, pp: int) -> argparse.Namespace:
    """The Megatron-LM arguments of this model (the ones a converter reads), with a Megatron enum among them."""
    from megatron.core.transformer.enums import AttnBackend

    return argparse.Namespace(
        num_layers=2, hidden_size=48, ffn_hidden_size=100, num_attention_heads=4, group_query_attention=True,
        num_query_groups=2, kv_channels=12, max_position_embeddings=64, seq_length=SEQ, position_embedding_type="rope",
        rotary_base=10000, normalization="RMSNorm", norm_epsilon=1e-5, swiglu=True, untie_embeddings_and_output_weights=not TIED,
        add_bias_linear=False, add_qkv_bias=False, vocab_size=VOCAB, padded_vocab_size=PADDED, make_vocab_size_divisible_by=128,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, params_dtype=DTYPE, bf16=BF16, fp16=False,
        ckpt_format="torch", attention_backend=AttnBackend.auto, iteration=1,
    )


BF16 = os.environ.get("MCORE_BF16") == "1"
TIED = os.environ.get("MCORE_TIED") == "1"  # the output layer shares the embedding (Megatron-LM without --untie-...)
# --overlap-grad-reduce --ddp-bucket-size N: the distributed optimizer's buffer in buckets of about N parameters
BUCKET = int(os.environ.get("MCORE_BUCKET", "0")) or None
RNG_RESTORED = [False]  # whether a load restored the checkpoint's RNG (OUT/rng.json)
DTYPE = torch.bfloat16 if BF16 else torch.float32


def build(tp: int, pp: int):
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    ps.initialize_model_parallel(tp, pp)
    torch.manual_seed(0)
    cfg = TransformerConfig(
        num_layers=2, hidden_size=48, ffn_hidden_size=100, num_attention_heads=4, num_query_groups=2, kv_channels=12,
        normalization="RMSNorm", layernorm_epsilon=1e-5, gated_linear_unit=True, activation_func=torch.nn.functional.silu,
        add_bias_linear=False, use_cpu_initialization=True, params_dtype=DTYPE, bf16=BF16, hidden_dropout=0.0,
        attention_dropout=0.0, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, pipeline_dtype=DTYPE,
    )
    model = GPTModel(
        cfg, get_gpt_layer_local_spec(), vocab_size=PADDED, max_sequence_length=64, position_embedding_type="rope",
        share_embeddings_and_output_weights=TIED, pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
    )
    if BF16:  # what Megatron-LM's get_model does for --bf16
        from megatron.core.transformer.module import Float16Module

        model = Float16Module(cfg, model)
    return model


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)


def forward(model, tokens: torch.Tensor, labels: torch.Tensor | None = None):
    """(output, input): the last stage's logits (gathered over TP) or per-token loss, another stage's hidden
    states (sent on, as Megatron's pipeline schedule does), and the hidden states it received."""
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    from megatron.core.utils import get_attr_wrapped_model

    b, s = tokens.shape
    pos = torch.arange(s).expand(b, s)
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    received = None
    if not ps.is_pipeline_first_stage():
        received = torch.empty(s, b, 48, dtype=DTYPE)
        dist.recv(received, src=ps.get_pipeline_model_parallel_prev_rank())
        received.requires_grad_(True)
        get_attr_wrapped_model(model, "set_input_tensor")(received)
    out = model(tokens, pos, attention_mask=mask, labels=labels)
    if not ps.is_pipeline_last_stage():
        dist.send(out.detach().contiguous(), dst=ps.get_pipeline_model_parallel_next_rank())
    elif labels is None:
        out = gather_from_tensor_model_parallel_region(out)
    return out, received


def train_step(model, optimizer, step: int) -> float | None:
    """One step; the backward pass crosses pipeline stages as gradients sent back."""
    from megatron.core import parallel_state as ps

    data = batch(step)
    optimizer.zero_grad()
    out, received = forward(model, data[:, :-1], data[:, 1:])
    loss = None
    if ps.is_pipeline_last_stage():
        mean = out.float().mean()
        mean.backward()
        loss = float(mean)
    else:
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        torch.autograd.backward(out, grad)
    if received is not None:
        dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    expert_bias_step(model)
    optimizer.step()
    return loss


def expert_bias_step(model) -> None:
    """Megatron-LM's finalize_model_grads moves a sigmoid router's expert biases (--moe-router-enable-expert-bias,
    buffers) by the step's token counts, before the optimizer step."""
    from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias

    if getattr(model.config, "moe_router_enable_expert_bias", False):
        _update_router_expert_bias([model], model.config)


def megatron_param_groups(model):
    """megatron-core's optimizer config and parameter groups for this model, with the hyper-parameters
    Megatron's OptimizerParamScheduler sets at every step."""
    from megatron.core.optimizer import OptimizerConfig, _get_param_groups

    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8, clip_grad=0.0,
                             bf16=BF16)
    groups = _get_param_groups([model], config, None)
    for g in groups:
        g["weight_decay"] = config.weight_decay * g.get("wd_mult", 1.0)
    return config, groups


def adam(groups) -> torch.optim.AdamW:
    return torch.optim.AdamW(groups, lr=LR, betas=(0.9, 0.95), eps=1e-8)


def init_state_fn(opt, config=None):
    """megatron.core.optimizer's for Adam: zero moments to load into."""
    for group in opt.param_groups:
        for p in group["params"]:
            if not opt.state[p]:
                opt.state[p]["exp_avg"] = torch.zeros_like(p.data)
                opt.state[p]["exp_avg_sq"] = torch.zeros_like(p.data)


def megatron_optimizer(model):
    """megatron-core's own non-distributed fp32 optimizer (its parameter groups, its state layout)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    config, groups = megatron_param_groups(model)
    adam_ = adam(groups)
    if BF16:
        from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

        distributed_optimizer_patches()  # the same CUDA tensor-type checks
        return Float16OptimizerWithFloat16Params(adam_, config, None, init_state_fn)
    return FP32Optimizer(adam_, config, init_state_fn)


def distributed_optimizer(model):
    """megatron-core's DistributedDataParallel and DistributedOptimizer, with the groups' hyper-parameters as
    megatron_optimizer's (what Megatron's OptimizerParamScheduler sets)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    ddp_config = DistributedDataParallelConfig(use_distributed_optimizer=True, overlap_grad_reduce=BUCKET is not None, bucket_size=BUCKET)
    ddp = DistributedDataParallel(model.config, ddp_config, model)
    config = OptimizerConfig(optimizer="adam", lr=LR, weight_decay=0.1, adam_beta1=0.9, adam_beta2=0.95, adam_eps=1e-8,
                             clip_grad=0.0, use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(config, [ddp])
    for g in optimizer.param_groups:
        g["weight_decay"], g["lr"] = config.weight_decay * g.get("wd_mult", 1.0), LR
    return ddp, optimizer


def data_parallel_step(ddp, optimizer, step: int) -> float:
    """One step with each data-parallel rank on its rows of the batch; the loss is the whole batch's mean (on the
    last pipeline stage; the backward pass crosses stages as gradients sent back). Then Megatron-LM's
    finalize_model_grads: the data-parallel reduction, and a tied embedding's gradients summed over the first and
    last stages; and a sigmoid router's expert biases moved by the step's token counts (--moe-router-enable-expert-bias)."""
    from megatron.core import parallel_state as ps
    from megatron.core.distributed.finalize_model_grads import _allreduce_word_embedding_grads

    rows = batch(step)[ps.get_data_parallel_rank()::ps.get_data_parallel_world_size()]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    out, received = forward(ddp, rows[:, :-1], rows[:, 1:])
    if ps.is_pipeline_last_stage():
        mean = out.float().mean()
        mean.backward()
    else:
        mean = torch.zeros(())
        grad = torch.empty_like(out)
        dist.recv(grad, src=ps.get_pipeline_model_parallel_next_rank())
        torch.autograd.backward(out, grad)
    if received is not None:
        dist.send(received.grad.contiguous(), dst=ps.get_pipeline_model_parallel_prev_rank())
    ddp.finish_grad_sync()
    _allreduce_word_embedding_grads([ddp], ddp.config)
    expert_bias_step(ddp)
    ok, _, _ = optimizer.step()
    assert ok
    loss = mean.detach().clone()
    dist.all_reduce(loss, group=ps.get_data_parallel_group())
    return float(loss) / ps.get_data_parallel_world_size()


def distributed_args(tp: int, pp: int) -> argparse.Namespace:
    """megatron_args with Megatron-LM's --use-distributed-optimizer [--overlap-grad-reduce --ddp-bucket-size N]."""
    from megatron.core import parallel_state as ps

    args = megatron_args(tp, pp)
    args.use_distributed_optimizer, args.data_parallel_size = True, ps.get_data_parallel_world_size()
    args.overlap_grad_reduce, args.ddp_bucket_size = BUCKET is not None, BUCKET
    return args


def save_distributed(path: str, tp: int, pp: int) -> list[float]:
    """Megatron-LM's save_checkpoint with --use-distributed-optimizer --ckpt-format torch, after one step."""
    from megatron.core import parallel_state as ps

    distributed_optimizer_patches()
    ddp, optimizer = distributed_optimizer(build(tp, pp))
    losses = [data_parallel_step(ddp, optimizer, 0)]
    file = legacy_path(path, tp, pp, 1)
    os.makedirs(os.path.dirname(file), exist_ok=True)
    optimizer.save_parameter_state(os.path.join(os.path.dirname(file), "distrib_optim.pt"))  # data-parallel rank 0 writes
    if ps.get_data_parallel_rank() == 0:
        args = distributed_args(tp, pp)
        torch.save({"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": ddp.module.state_dict_for_save_checkpoint(),
                    "optimizer": optimizer.state_dict()}, file)
    dist.barrier()
    if dist.get_rank() == 0:
        with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    losses += [data_parallel_step(ddp, optimizer, step) for step in range(1, STEPS)]
    return losses


def load_distributed(path: str, tp: int, pp: int) -> list[float]:
    """Megatron-LM's load_checkpoint with --use-distributed-optimizer: the model, the optimizer's param groups,
    then load_parameter_state(distrib_optim.pt); then train on from step 1 (pipeline size 1)."""
    from converters.megatron import load_megatron_file

    distributed_optimizer_patches()
    ddp, optimizer = distributed_optimizer(build(tp, pp))
    _, iteration = megatron_lm_load_dir(path)
    file = legacy_path(path, tp, pp, iteration)
    state = load_megatron_file(file)
    megatron_lm_restore_rng(state["rng_state"], state["args"].seed)
    result = ddp.module.load_state_dict(state["model"], strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    optimizer.load_state_dict(state["optimizer"])
    for inner in optimizer.chained_optimizers:  # without TE/Apex, load_state_dict gives every parameter one shared
        for s in inner.optimizer.state.values():  # 'step' tensor, which torch's AdamW would then advance once per parameter
            s["step"] = s["step"].clone()
    with torch.no_grad():  # an fp32 model's main params are views of its parameters
        optimizer.load_parameter_state(os.path.join(os.path.dirname(file), "distrib_optim.pt"))
    return [data_parallel_step(ddp, optimizer, step) for step in range(1, STEPS)]


def dist_distributed(save: bool, path: str, tp: int, pp: int) -> list[float]:
    """Megatron-LM's torch_dist save / load with --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable:
    the optimizer's sharded_state_dict takes the content metadata (saved in common.pt, read back on load)."""
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.utils import unwrap_model

    distributed_optimizer_patches()
    ddp, optimizer = distributed_optimizer(build(tp, pp))
    layout = os.environ.get("MCORE_DISTOPT_LAYOUT", "fully_reshardable")  # or Megatron-LM's default, dp_reshardable
    metadata = {"distrib_optim_sharding_type": layout, "singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if save:
        losses = [data_parallel_step(ddp, optimizer, 0)]
        directory = os.path.join(path, "iter_0000001")
        if dist.get_rank() == 0:
            os.makedirs(directory, exist_ok=True)
        dist.barrier()
        group = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
        model_sd = unwrap_model(ddp).sharded_state_dict(metadata={**metadata, **group})
        args = distributed_args(tp, pp)
        args.ckpt_format = "torch_dist"
        state = {"args": args, "checkpoint_version": 3.0, "iteration": 1, "model": model_sd}
        state["optimizer"] = optimizer.sharded_state_dict(state, metadata={**metadata, **group})
        dist_checkpointing.save(state, directory, content_metadata=metadata)
        if dist.get_rank() == 0:
            with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
                f.write("1")
        return losses + [data_parallel_step(ddp, optimizer, step) for step in range(1, STEPS)]
    directory, _ = megatron_lm_load_dir(path)
    loaded_metadata = dist_checkpointing.load_content_metadata(directory)
    assert loaded_metadata == metadata, loaded_metadata  # what the checkpoint says its layout is
    group = {"dp_cp_group": ps.get_data_parallel_group(with_context_parallel=True)}
    model_sd = unwrap_model(ddp).sharded_state_dict(metadata={**loaded_metadata, **group})
    loaded = distributed_load({"model": model_sd}, optimizer, directory, tp, pp, {**loaded_metadata, **group})
    unwrap_model(ddp).load_state_dict(loaded["model"], strict=True)
    return [data_parallel_step(ddp, optimizer, step) for step in range(1, STEPS)]


def distributed_load(state: dict, optimizer, directory: str, tp: int, pp: int, metadata: dict) -> dict:
    """Megatron-LM's torch_dist load of the model entries in ``state`` and of the DistributedOptimizer's state (loaded
    into it here), the RNG restored at the checkpoint's own TP x PP. Returns the loaded state for the model."""
    from megatron.core import dist_checkpointing

    for inner in optimizer.chained_optimizers:  # what TE/Apex's Adam allocates up front; torch's AdamW (with its
        for g in inner.optimizer.param_groups:  # per-parameter step) only at its first step
            for p in g["params"]:
                inner.optimizer.state[p] = {"exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p), "step": torch.tensor(0.0)}
    state["optimizer"] = optimizer.sharded_state_dict(state, is_loading=True, metadata=metadata)
    rng, ckpt_args = rng_request(directory, tp, pp)
    if rng is not None:
        state["rng_state"] = rng
    loaded = dist_checkpointing.load(state, directory)
    if rng is not None:  # one state per TP x PP rank: data-parallel rank 0's, whose expert rank is 0
        megatron_lm_restore_rng(loaded["rng_state"], ckpt_args.seed, saver_ep_rank=0)
    with torch.no_grad():
        optimizer.load_state_dict(loaded["optimizer"])
    for inner in optimizer.chained_optimizers:  # TE / Apex's Adam keeps the step in its groups (where the checkpoint
        for g in inner.optimizer.param_groups:  # has it); torch's AdamW per parameter, which dp_reshardable's load
            for p in g["params"]:  # leaves at its value before the load: set it from the group, as TE's Adam reads it
                inner.optimizer.state[p]["step"] = torch.tensor(float(g["step"]))
    return loaded


def megatron_lm_restore_rng(rng_state, seed: int, saver_ep_rank: int | None = None) -> None:
    """Megatron-LM's load_checkpoint RNG restore (no --no-load-rng, no --data-parallel-random-init): python's,
    numpy's and torch's generators from rng_state[0], the tracker's streams into megatron-core's tracker, exiting on
    an empty tracker. torch.cuda.set_rng_state cannot run on CPU: each CUDA state is checked for the layout of
    torch's CUDA generator (16 bytes: the seed, the Philox offset) and, our sources being CPU runs, for the seeds
    megatron-core's own model_parallel_cuda_manual_seed gives this rank (Megatron-LM's seed + 100 x pipeline rank).
    ``saver_ep_rank``: the expert-parallel rank whose state the checkpoint holds for every expert rank (torch_dist
    keeps one rng_state per TP x PP rank, data-parallel rank 0's: expert rank 0's), else this rank's own."""
    import random
    import struct

    import numpy as np
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import random as mrandom

    (state,) = rng_state
    random.setstate(state["random_rng_state"])
    np.random.set_state(state["np_rng_state"])
    torch.set_rng_state(state["torch_rng_state"])
    assert state["rng_tracker_states"], "Megatron-LM: Unable to load rng state from checkpoint ... exiting"
    for cuda in (state["cuda_rng_state"], *state["rng_tracker_states"].values()):
        assert cuda.dtype == torch.uint8 and tuple(cuda.shape) == (16,), cuda
    rank_seed = seed + 100 * ps.get_pipeline_model_parallel_rank()
    current = [None]
    encode = lambda s: torch.tensor(list(struct.pack("<Qq", s, 0)), dtype=torch.uint8)  # noqa: E731
    saved = torch.cuda.manual_seed, torch.cuda.get_rng_state, mrandom._set_cuda_rng_state
    torch.cuda.manual_seed = lambda s: current.__setitem__(0, s)
    torch.cuda.get_rng_state = lambda *a, **k: encode(current[0] or 0)
    mrandom._set_cuda_rng_state = lambda *a, **k: None
    try:
        mrandom.model_parallel_cuda_manual_seed(rank_seed, force_reset_rng=True, ep_rank=saver_ep_rank)
        expected = mrandom.get_cuda_rng_tracker().get_states()
    finally:
        torch.cuda.manual_seed, torch.cuda.get_rng_state, mrandom._set_cuda_rng_state = saved
    assert torch.equal(state["cuda_rng_state"], encode(rank_seed))
    assert expected.keys() == state["rng_tracker_states"].keys(), (expected.keys(), state["rng_tracker_states"].keys())
    for name, value in expected.items():
        assert torch.equal(value, state["rng_tracker_states"][name]), name
    mrandom.get_cuda_rng_tracker().set_states(state["rng_tracker_states"])
    RNG_RESTORED[0] = True


def rng_request(directory: str, tp: int, pp: int):
    """The rng_state object Megatron-LM's torch_dist load asks for: only at the checkpoint's own TP x PP, and only
    when its args do not say no_save_rng. Returns (the ShardedObject or None, the checkpoint's args)."""
    from megatron.core import dist_checkpointing, parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    args = dist_checkpointing.load_common_state_dict(directory)["args"]
    if (args.tensor_model_parallel_size, args.pipeline_model_parallel_size) != (tp, pp) or getattr(args, "no_save_rng", False):
        return None, args
    t, p = ps_ranks()
    return ShardedObject("rng_state", [{}], (pp, tp), (p, t), replica_id=ps.get_data_parallel_rank(with_context_parallel=True)), args


def megatron_lm_load_dir(load: str) -> tuple[str, int]:
    """What Megatron-LM's ``--load DIR`` reads (training/checkpointing.py's read_metadata and
    get_checkpoint_name; megatron.training is not on PyPI): the tracker file in DIR names the iteration."""
    with open(os.path.join(load, "latest_checkpointed_iteration.txt")) as f:
        text = f.read().strip()
    iteration = 0 if text == "release" else int(text)
    return os.path.join(load, "release" if text == "release" else f"iter_{iteration:07d}"), iteration


def legacy_path(root: str, tp: int, pp: int, iteration: int, ep: int = 1) -> str:
    """Megatron-LM's get_checkpoint_name for this rank (_EEE: its expert-parallel rank, at EP > 1)."""
    from megatron.core import parallel_state as ps

    t, p = ps_ranks()
    name = f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else "") + (f"_{ps.get_expert_model_parallel_rank():03d}" if ep > 1 else "")
    return os.path.join(root, f"iter_{iteration:07d}", name, "model_optim_rng.pt")


def write_results(out: str, losses: list[float]) -> None:
    """The last rank's losses (OUT/losses.json) and whether the load restored the RNG (OUT/rng.json)."""
    if dist.get_rank() == dist.get_world_size() - 1:
        write_json(os.path.join(out, "losses.json"), losses)
        write_json(os.path.join(out, "rng.json"), {"restored": RNG_RESTORED[0]})


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f)


def save_logits(model, out: str) -> None:
    """Logits of the model as it is now, on a fixed batch, from the last stage (full vocabulary)."""
    model.eval()
    with torch.no_grad():
        logits, _ = forward(model, batch(99)[:, :-1])
    if dist.get_rank() == dist.get_world_size() - 1:
        torch.save(logits, os.path.join(out, "logits.pt"))
    model.train()


def main() -> None:
    scenario, path, out = sys.argv[1], sys.argv[2], sys.argv[3]
    tp, pp = int(os.environ["MCORE_TP"]), int(os.environ["MCORE_PP"])
    dist.init_process_group("gloo")
    cpu_patches()
    if scenario in ("save-dist-distopt", "load-dist-distopt"):
        write_results(out, dist_distributed(scenario.startswith("save"), path, tp, pp))
        dist.barrier()
        dist.destroy_process_group()
        return
    if scenario in ("save-legacy-distopt", "load-legacy-distopt"):
        write_results(out, save_distributed(path, tp, pp) if scenario.startswith("save") else load_distributed(path, tp, pp))
        dist.barrier()
        dist.destroy_process_group()
        return
    model = build(tp, pp)
    optimizer = megatron_optimizer(model)
    rank = dist.get_rank()
    losses = []
    if scenario.startswith("save"):
        model.train()
        losses.append(train_step(model, optimizer, 0))
        if scenario == "save-legacy":
            state = {"args": megatron_args(tp, pp), "checkpoint_version": 3.0, "iteration": 1,
                     "model": model.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                     "rng_state": [{"random_rng_state": __import__("random").getstate(),
                                    "np_rng_state": __import__("numpy").random.get_state(), "torch_rng_state": torch.get_rng_state()}]}
            file = legacy_path(path, tp, pp, 1)
            os.makedirs(os.path.dirname(file), exist_ok=True)
            torch.save(state, file)
            dist.barrier()
            if rank == 0:
                with open(os.path.join(path, "latest_checkpointed_iteration.txt"), "w") as f:
                    f.write("1")
        else:
            from megatron.core import dist_checkpointing

            if rank == 0:
                os.makedirs(path, exist_ok=True)
            dist.barrier()
            sharded = model.sharded_state_dict()
            state = {"args": megatron_args(tp, pp), "checkpoint_version": 3.0, "iteration": 1, "model": sharded,
                     "optimizer": optimizer.sharded_state_dict(sharded)}
            dist_checkpointing.save(state, path)
        save_logits(model, out)
    else:  # load-legacy / load-dist: a checkpoint we wrote; with-optimizer resumes it, otherwise a fresh optimizer
        with_optimizer = scenario.endswith("+optimizer")
        if scenario.startswith("load-legacy"):  # Megatron-LM's --load PATH: the tracker, then this rank's file
            from converters.megatron import load_megatron_file

            _, iteration = megatron_lm_load_dir(path)
            state = load_megatron_file(legacy_path(path, tp, pp, iteration))
            megatron_lm_restore_rng(state["rng_state"], state["args"].seed)  # legacy: always, without --no-load-rng
            result = model.load_state_dict(state["model"], strict=True)
            assert not result.missing_keys and not result.unexpected_keys, result
            if with_optimizer:
                optimizer.load_state_dict(state["optimizer"])
        else:
            from megatron.core import dist_checkpointing

            sharded = model.sharded_state_dict()
            state = {"model": sharded}
            if with_optimizer:
                state["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=True)
            rng, ckpt_args = rng_request(megatron_lm_load_dir(path)[0], tp, pp)
            if rng is not None:
                state["rng_state"] = rng
            loaded = dist_checkpointing.load(state, megatron_lm_load_dir(path)[0])
            if rng is not None:
                megatron_lm_restore_rng(loaded["rng_state"], ckpt_args.seed)
            model.load_state_dict(loaded["model"], strict=True)
            if with_optimizer:
                optimizer.load_state_dict(loaded["optimizer"])
        model.train()
    first = 1 if scenario.startswith("save") or scenario.endswith("+optimizer") else 0
    losses += [train_step(model, optimizer, step) for step in range(first, STEPS)]
    write_results(out, losses)
    dist.barrier()
    dist.destroy_process_group()


def ps_ranks() -> tuple[int, int]:
    from megatron.core import parallel_state as ps

    return ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()


if __name__ == "__main__":  # megatron-core's checkpoint writer starts helper processes that import this module
    main()
