"""Tiny models of many Hugging Face architectures, built from configs with odd sizes (no hub): the cases of
tests/test_architectures.py. Each is (name, model_type, architecture, config overrides); norms and biases are
randomised so that a weight taken from the wrong place cannot pass for the right one."""

from __future__ import annotations

import torch
import transformers

V = 131  # an odd vocabulary: no size lines up by chance
LLAMA = dict(hidden_size=36, intermediate_size=52, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("llama", "LlamaForCausalLM", dict(LLAMA)),
    "llama-tied": ("llama", "LlamaForCausalLM", dict(LLAMA, tie_word_embeddings=True)),
    "mistral": ("mistral", "MistralForCausalLM", dict(LLAMA, sliding_window=16)),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", dict(LLAMA)),  # attention bias
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(LLAMA, head_dim=6)),  # q / k norms
    "gemma": ("gemma", "GemmaForCausalLM", dict(LLAMA, head_dim=6)),  # tied by default, scaled embedding
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(LLAMA, head_dim=6, sliding_window=16)),  # soft-capping
    "phi3": ("phi3", "Phi3ForCausalLM", dict(LLAMA, num_key_value_heads=6)),  # fused qkv and gate_up
    "opt": ("opt", "OPTForCausalLM", dict(hidden_size=36, ffn_dim=52, num_attention_heads=6, num_hidden_layers=2, vocab_size=V,
                                          word_embed_proj_dim=36, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "falcon": ("falcon", "FalconForCausalLM", dict(hidden_size=36, num_attention_heads=6, num_hidden_layers=2, vocab_size=V,
                                                   bos_token_id=1, eos_token_id=2)),  # parallel attention
    "bloom": ("bloom", "BloomForCausalLM", dict(hidden_size=36, n_head=6, n_layer=2, vocab_size=V, bos_token_id=1, eos_token_id=2,
                                                pad_token_id=0)),  # ALiBi
    "gpt2": ("gpt2", "GPT2LMHeadModel", dict(n_embd=36, n_head=6, n_layer=2, vocab_size=V, n_positions=64, bos_token_id=1,
                                             eos_token_id=2)),  # Conv1D
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM", dict(hidden_size=36, intermediate_size=52, num_attention_heads=6, num_hidden_layers=2,
                                                        vocab_size=V, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)),
    "bert": ("bert", "BertForMaskedLM", dict(hidden_size=36, intermediate_size=52, num_attention_heads=6, num_hidden_layers=2,
                                             vocab_size=V, max_position_embeddings=64, pad_token_id=0)),  # encoder
    "t5": ("t5", "T5ForConditionalGeneration", dict(d_model=36, d_ff=52, num_heads=6, d_kv=6, num_layers=2, vocab_size=V,
                                                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),  # encoder-decoder
    "llama-classifier": ("llama", "LlamaForSequenceClassification", dict(LLAMA, num_labels=3)),  # a classification head
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)),  # MoE
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                                                           shared_expert_intermediate_size=24)),  # MoE with a shared expert
}
MOE = ("mixtral", "qwen2_moe")  # per-expert files, fused expert modules: engine layouts are issue 19's


def build(name: str) -> transformers.PreTrainedModel:
    model_type, architecture, overrides = ARCHITECTURES[name]
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases start at 1 / 0: make each one its own
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    return model.eval()
