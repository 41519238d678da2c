"""megatron-core's own GPT model, built as Megatron-LM builds it from the arguments in our checkpoint, loads
each family's Megatron checkpoint and writes its logits, which the test compares with transformers' on the source.

Run by tests/test_megatron_families.py under torch.distributed.run (TP = the world size, PP 1):

    mcore_family_worker.py MEGATRON_DIR ...    (MEGATRON_DIR/ids.pt in, MEGATRON_DIR/mcore_logits.pt out)

The TransformerConfig is what Megatron-LM's ``core_transformer_config_from_args`` makes of the arguments this
test reads (megatron.training is not on PyPI): ``--swiglu`` -> gated SiLU, ``--openai-gelu`` -> the tanh GELU,
``--qk-layernorm``, ``--apply-layernorm-1p``, biases, norms, rotary base, percent, Llama 3.x scaling and YaRN
(its ``yarn_*`` config fields as Megatron-LM's ``_apply_yarn_config_from_args`` sets them), tied embeddings.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tests.mcore_worker import cpu_patches  # noqa: E402


# GPT-OSS's activation (quick-GEGLU with an offset and a clamp), attention sinks (a learnable softmax offset) and window
GPT_OSS_ARGS = ("glu_linear_offset", "activation_func_clamp_value", "softmax_type", "window_size", "window_attn_skip_freq")


def transformer_config(args, tp: int):
    import torch.nn.functional as F
    from megatron.core.activations import fast_gelu
    from megatron.core.transformer.transformer_config import TransformerConfig

    gpt_oss = {k: getattr(args, k) for k in GPT_OSS_ARGS if getattr(args, k, None) is not None}
    if "window_size" in gpt_oss:  # (a list in the arguments we write; Megatron-LM's parser makes a tuple)
        gpt_oss["window_size"] = tuple(gpt_oss["window_size"])
    if args.swiglu:
        activation = F.silu
    elif getattr(args, "quick_geglu", False):  # GPT-OSS's experts: Megatron-LM's --quick-geglu
        from megatron.core.activations import quick_gelu

        activation = quick_gelu
    elif getattr(args, "openai_gelu", False):
        activation = fast_gelu
    else:
        activation = F.gelu
    config = TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size, ffn_hidden_size=args.ffn_hidden_size,
        num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups if args.group_query_attention else None, kv_channels=args.kv_channels,
        normalization=args.normalization, layernorm_epsilon=args.norm_epsilon, gated_linear_unit=args.swiglu or bool(getattr(args, "quick_geglu", False)),
        activation_func=activation, add_bias_linear=args.add_bias_linear, add_qkv_bias=args.add_qkv_bias,
        qk_layernorm=getattr(args, "qk_layernorm", False), layernorm_zero_centered_gamma=getattr(args, "apply_layernorm_1p", False),
        use_cpu_initialization=True, params_dtype=torch.float32, hidden_dropout=0.0, attention_dropout=0.0,
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, **gpt_oss,
    )
    if config.window_size:  # megatron-core's sliding-window mask (its unfused softmax's) is made on device 'cuda': the CPU's here
        from megatron.core.fusions import fused_softmax

        def window_mask(sq: int, skv: int, window) -> torch.Tensor:
            m = torch.ones(sq, skv, dtype=torch.bool)
            return ~torch.tril(torch.triu(m, diagonal=skv - sq - window[0]), diagonal=skv - sq + window[1])

        fused_softmax.get_sliding_window_causal_mask = window_mask
    if args.position_embedding_type == "yarn":  # as Megatron-LM's _apply_yarn_config_from_args sets them
        for attr, arg in (("rotary_scaling_factor", "rotary_scaling_factor"), ("original_max_position_embeddings", "yarn_original_max_position_embeddings"),
                          ("beta_fast", "yarn_beta_fast"), ("beta_slow", "yarn_beta_slow"), ("mscale", "mscale"), ("mscale_all_dim", "mscale_all_dim"),
                          ("correction_range_round_to_int", "yarn_correction_range_round_to_int")):
            setattr(config, f"yarn_{attr}", getattr(args, arg))
        torch.cuda.current_device = lambda: "cpu"  # where megatron-core's YaRN embedding puts its frequencies
    return config


def mcore_logits(megatron_dir: str, ids: torch.Tensor) -> tuple[torch.Tensor, list[str], list[str]]:
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

    from converters.megatron import load_megatron_file

    tp = dist.get_world_size()
    with open(os.path.join(megatron_dir, "latest_checkpointed_iteration.txt")) as f:
        iteration = int(f.read())
    rank = ps.get_tensor_model_parallel_rank()
    state = load_megatron_file(os.path.join(megatron_dir, f"iter_{iteration:07d}", f"mp_rank_{rank:02d}", "model_optim_rng.pt"))
    args = state["args"]
    config = transformer_config(args, tp)
    model = GPTModel(
        config, get_gpt_layer_local_spec(qk_layernorm=config.qk_layernorm), vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, position_embedding_type=args.position_embedding_type,
        rotary_percent=args.rotary_percent, rotary_base=args.rotary_base,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        # Llama 3.x's scaling: the flag as Megatron-LM's GPT builder passes it, the factor as the arguments say
        rope_scaling=bool(getattr(args, "use_rope_scaling", False)), rope_scaling_factor=getattr(args, "rope_scaling_factor", 8.0),
    )
    if hasattr(model, "rotary_pos_emb"):  # its rotary frequencies, for the test to hold beside transformers'
        torch.save(model.rotary_pos_emb.inv_freq, os.path.join(megatron_dir, "mcore_inv_freq.pt"))
    result = model.load_state_dict(state["model"], strict=False)
    model.eval()
    b, s = ids.shape
    mask = torch.triu(torch.ones(1, 1, s, s, dtype=torch.bool), 1)
    with torch.no_grad():
        out = model(ids, torch.arange(s).expand(b, s), attention_mask=mask)
    logits = gather_from_tensor_model_parallel_region(out)[..., : args.vocab_size]
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    return logits, missing, list(result.unexpected_keys)


def main() -> None:
    """Each model's logits on ``ids`` (saved by the test beside its checkpoint) to MEGATRON_DIR/mcore_logits.pt.
    transformers' own logits are the test's, taken in its clean process: after megatron-core's CPU patches and
    model-parallel setup, transformers' first forward in a process drifts by ~1e-3 (seen on 0.16.1)."""
    from megatron.core import parallel_state as ps

    dist.init_process_group("gloo")
    cpu_patches()
    ps.initialize_model_parallel(dist.get_world_size(), 1)
    for megatron_dir in sys.argv[1:]:
        ids = torch.load(os.path.join(megatron_dir, "ids.pt"))
        logits, missing, unexpected = mcore_logits(megatron_dir, ids)
        if dist.get_rank() == 0:
            torch.save(logits, os.path.join(megatron_dir, "mcore_logits.pt"))
            print(json.dumps({"checkpoint": megatron_dir, "missing": missing, "unexpected": unexpected}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
