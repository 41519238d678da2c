"""The test model of the multi-process tests: a tiny Llama with awkward sizes (hidden 45, intermediate 101: flat
groups and norms do not divide evenly by the world size), tied embeddings, a frozen MLP and a persistent buffer."""

from __future__ import annotations

import torch

from trainers.base import freeze

FROZEN = "model.layers.0.mlp"


def odd_model() -> torch.nn.Module:
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=45, intermediate_size=101, num_hidden_layers=2, num_attention_heads=3,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
    )
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.model.register_buffer("calibration", torch.linspace(-1.0, 1.0, 7))  # persistent, odd-sized
    return freeze(model, FROZEN)
