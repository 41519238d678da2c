"""A Megatron model's shape, as Megatron-LM's arguments describe it, and its Hugging Face config.

Megatron checkpoints keep the model's architecture in ``args`` (an argparse Namespace pickled into every
``model_optim_rng.pt``, and into ``common.pt`` of a torch_dist checkpoint). This module turns those arguments
into a Hugging Face config and back, and holds the two layout rules every Megatron format shares: the padded
vocabulary and which pipeline stage owns which layers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from interop.errors import ConversionError

DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_vocab(vocab: int, tp: int, divisible_by: int = DIVISIBLE_BY) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: the vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def stage_layers(num_layers: int, pp: int) -> list[range]:
    """The global layer indices each pipeline stage holds (Megatron splits evenly; each stage numbers from 0)."""
    if num_layers % pp:
        raise ConversionError(f"{num_layers} layers do not split evenly over {pp} pipeline stages")
    per = num_layers // pp
    return [range(p * per, (p + 1) * per) for p in range(pp)]


@dataclass(frozen=True)
class MegatronArch:
    family: str  # "llama" (also mistral, qwen2) or "gpt2"
    num_layers: int
    hidden: int
    heads: int
    groups: int  # num_query_groups (= heads without grouped-query attention)
    head_dim: int  # kv_channels
    ffn: int
    vocab: int  # the tokenizer's vocabulary, before Megatron pads it
    tied: bool
    gated: bool  # SwiGLU: fc1 holds [gate; up]
    norm: str  # "RMSNorm" or "LayerNorm"
    eps: float
    max_positions: int
    linear_bias: bool  # biases on proj / fc1 / fc2
    qkv_bias: bool
    rope_theta: float | None  # None: learned absolute positions (GPT-2)
    model_type: str = "llama"  # the Hugging Face model_type to export as

    def check_tp(self, tp: int, where: str | None = None) -> None:
        """Megatron splits whole attention heads and whole query groups over tensor-parallel ranks."""
        problems = [f"{n} {v}" for n, v in (("attention heads", self.heads), ("query groups", self.groups), ("ffn size", self.ffn)) if v % tp]
        if problems:
            raise ConversionError(
                f"{where + ': ' if where else ''}tensor-parallel size {tp} does not divide the model's {', '.join(problems)}"
            )

    # --- Hugging Face configs -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "MegatronArch":
        kind = config.get("model_type")
        if kind == "gpt2":
            hidden = config["n_embd"]
            return cls(
                family="gpt2", num_layers=config["n_layer"], hidden=hidden, heads=config["n_head"], groups=config["n_head"],
                head_dim=hidden // config["n_head"], ffn=config.get("n_inner") or 4 * hidden, vocab=config["vocab_size"],
                tied=bool(config.get("tie_word_embeddings", True)), gated=False, norm="LayerNorm",
                eps=config.get("layer_norm_epsilon", 1e-5), max_positions=config["n_positions"], linear_bias=True,
                qkv_bias=True, rope_theta=None, model_type="gpt2",
            )
        if kind in ("llama", "mistral", "qwen2"):
            heads = config["num_attention_heads"]
            rope = config.get("rope_parameters") or {}
            if rope.get("rope_type", "default") != "default":
                raise ConversionError(f"rope scaling {rope.get('rope_type')!r} has no Megatron equivalent this converter writes")
            return cls(
                family="llama", num_layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                groups=config.get("num_key_value_heads") or heads,
                head_dim=config.get("head_dim") or config["hidden_size"] // heads, ffn=config["intermediate_size"],
                vocab=config["vocab_size"], tied=bool(config.get("tie_word_embeddings", False)), gated=True, norm="RMSNorm",
                eps=config.get("rms_norm_eps", 1e-6), max_positions=config.get("max_position_embeddings", 4096),
                linear_bias=bool(config.get("mlp_bias", False)),
                qkv_bias=kind == "qwen2" or bool(config.get("attention_bias", False)),
                rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))), model_type=kind,
            )
        raise ConversionError(f"model_type {kind!r} has no Megatron name map (llama, mistral, qwen2 and gpt2 do)")

    def to_hf(self) -> dict[str, Any]:
        """A config.json (only what differs from transformers' defaults matters; no transformers import)."""
        arch = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        config: dict[str, Any] = {"architectures": [arch[self.model_type]], "model_type": self.model_type, "vocab_size": self.vocab,
                                  "tie_word_embeddings": self.tied}
        if self.family == "gpt2":
            token = 50256 if self.vocab > 50256 else None  # GPT-2's <|endoftext|>, when the vocabulary has it
            config.update(n_positions=self.max_positions, n_embd=self.hidden, n_layer=self.num_layers, n_head=self.heads,
                          n_inner=self.ffn if self.ffn != 4 * self.hidden else None, layer_norm_epsilon=self.eps,
                          activation_function="gelu_new", bos_token_id=token, eos_token_id=token)
            return config
        if self.model_type == "qwen2" and self.linear_bias:
            raise ConversionError("qwen2 has no MLP biases; this checkpoint has them")
        config.update(
            hidden_size=self.hidden, intermediate_size=self.ffn, num_hidden_layers=self.num_layers, num_attention_heads=self.heads,
            num_key_value_heads=self.groups, head_dim=self.head_dim, hidden_act="silu", rms_norm_eps=self.eps,
            max_position_embeddings=self.max_positions, rope_theta=self.rope_theta,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
        )
        if self.model_type != "qwen2":
            config.update(attention_bias=self.qkv_bias, mlp_bias=self.linear_bias)
        return config

    # --- Megatron-LM arguments ------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any, where: str) -> "MegatronArch":
        """From a checkpoint's ``args`` (a Namespace or its dict); ``where`` names the file for errors."""
        a = args if isinstance(args, dict) else vars(args)
        try:
            heads = a["num_attention_heads"]
            rope = a.get("position_embedding_type", "learned_absolute") == "rope"
            groups = a.get("num_query_groups") if a.get("group_query_attention") else None
            swiglu = bool(a.get("swiglu"))
            norm = a.get("normalization", "LayerNorm")
            qkv_bias = bool(a.get("add_qkv_bias")) or bool(a.get("add_bias_linear", True))
            if rope and swiglu and norm == "RMSNorm":
                model_type = a.get("hf_model_type") or ("qwen2" if a.get("add_qkv_bias") and not a.get("add_bias_linear", True) else "llama")
                family = "llama"
            elif not rope and not swiglu and norm == "LayerNorm":
                model_type = family = "gpt2"
            else:
                raise ConversionError(
                    f"{where}: a model with position embedding {a.get('position_embedding_type')!r}, normalization {norm!r} "
                    f"and swiglu={swiglu} is neither Llama-like nor GPT-2-like; no Hugging Face name map fits it"
                )
            padded = a.get("padded_vocab_size")
            return cls(
                family=family, num_layers=a["num_layers"], hidden=a["hidden_size"], heads=heads, groups=groups or heads,
                head_dim=a.get("kv_channels") or a["hidden_size"] // heads,
                ffn=a.get("ffn_hidden_size") or 4 * a["hidden_size"], vocab=a.get("vocab_size") or padded,
                tied=not a.get("untie_embeddings_and_output_weights", False), gated=swiglu, norm=norm,
                eps=a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)), max_positions=a.get("max_position_embeddings") or a.get("seq_length"),
                linear_bias=bool(a.get("add_bias_linear", True)), qkv_bias=qkv_bias,
                rope_theta=float(a.get("rotary_base", 10000)) if rope else None, model_type=model_type,
            )
        except KeyError as exc:
            raise ConversionError(f"{where}: Megatron args lack {exc.args[0]!r}, so the model's shape is unknown") from None

    def to_args(self, tp: int, pp: int, **extra: Any) -> dict[str, Any]:
        """The Megatron-LM arguments that describe this model at TP x PP (``--`` flags with '-' as '_')."""
        rope = self.rope_theta is not None
        args = {
            "num_layers": self.num_layers, "hidden_size": self.hidden, "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads, "group_query_attention": self.groups != self.heads,
            "num_query_groups": self.groups, "kv_channels": self.head_dim, "max_position_embeddings": self.max_positions,
            "seq_length": self.max_positions, "position_embedding_type": "rope" if rope else "learned_absolute",
            "use_rotary_position_embeddings": rope, "rotary_base": int(self.rope_theta) if rope else 10000,
            "normalization": self.norm, "norm_epsilon": self.eps, "swiglu": self.gated,
            "untie_embeddings_and_output_weights": not self.tied, "add_bias_linear": self.linear_bias,
            "add_qkv_bias": self.qkv_bias, "vocab_size": self.vocab, "padded_vocab_size": padded_vocab(self.vocab, tp),
            "make_vocab_size_divisible_by": DIVISIBLE_BY, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": None, "hf_model_type": self.model_type,
        }
        args.update(extra)
        return args
