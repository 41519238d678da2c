"""Megatron name maps: one small declarative table per model family, in the spirit of Megatron-Bridge's
mapping registry. A family says which Hugging Face tensors make each Megatron tensor and how (fused,
transposed, split over tensor-parallel ranks), and what its config means in Megatron's terms; the split
and fuse arithmetic itself is ``converters/megatron_map.py``'s, shared by every family.

Why hand-written: no installed library maps Hugging Face names onto megatron-core's (Megatron-Bridge does,
but needs CUDA and Transformer Engine). Everything else about the model (its class, ties, sizes through the
config class's own attribute names) is still asked of transformers.

Adding a family is adding one module beside this one that calls :func:`register`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from interop.errors import ConversionError

# how a Megatron tensor is split over tensor-parallel ranks
ROWS, COLS, GATED, VOCAB, REPLICATED = "rows", "cols", "gated", "vocab", "replicated"
# how Hugging Face tensors are fused into it
ONE = "one"  # the tensor itself
T = "t"  # transposed (transformers' Conv1D stores (in, out))
QKV = "qkv"  # q, k, v: Megatron interleaves them per query group
PACKED_QKV = "packed_qkv"  # one [q; k; v] tensor (Phi-3's qkv_proj, GPT-2's c_attn bias)
PACKED_QKV_T = "packed_qkv_t"  # the same, stored (in, out) (GPT-2's c_attn weight)
CAT = "cat"  # gate and up stacked: [gate; up]
# gate and up interleaved (GPT-OSS's gate_up_proj: gate in the even columns, up in the odd), stored (in, out) with ``_T``:
# megatron-core's fc1 holds [gate; up]
INTERLEAVED, INTERLEAVED_T = "interleaved", "interleaved_t"
# multi-latent attention's rows that feed rotary embeddings: each head's [nope; rope] (q) or [latent; rope] (the kv
# down-projection); megatron-core rotates the rope rows' even/odd pairs (transformers' rope_interleave), a model
# that rotates halves has them stored interleaved
ROPE_Q, ROPE_KV = "rope_q", "rope_kv"


@dataclass(frozen=True)
class Param:
    """One Megatron tensor of a layer (names relative to ``decoder.layers.<i>.`` and the family's HF layer prefix)."""

    megatron: str
    hf: tuple[str, ...]
    split: str
    fuse: str = ONE
    # a MegatronArch flag the tensor exists under ("linear_bias", "qkv_bias", "layernorm", "qk_layernorm", "q_lora",
    # "no_q_lora": multi-latent attention's query with or without its low-rank bottleneck)
    when: str | None = None
    norm_of: str | None = None  # Transformer Engine fuses this norm into that linear (``<linear>.layer_norm_<p>``)
    buffer: bool = False  # a persistent buffer (the router's expert bias): in the model's state, not a parameter
    # an expert's tensor that Hugging Face stores with every expert of the layer along its first dimension (GPT-OSS's
    # ``mlp.experts.gate_up_proj``, named without "{e}"): each expert's slice is read and written as its own
    stacked: bool = False


def expert_name(stacked: str, expert: int) -> str:
    """The name an expert's slice of a stacked tensor goes by inside a conversion (``mlp.experts.gate_up_proj`` ->
    ``mlp.experts.3.gate_up_proj``, as a model with one module per expert would name it); never written."""
    module, _, leaf = stacked.rpartition(".")
    return f"{module}.{expert}.{leaf}"


# A multi-token-prediction (MTP) layer, megatron-core's MultiTokenPredictionLayer (``mtp.layers.<k>.``, Megatron-LM's
# --mtp-num-layers): its own norms and projection around a transformer layer of the family's (``transformer_layer.``, the
# last decoder layer's kind), then its final norm; embedding and output layer are the model's. Hugging Face checkpoints keep
# MTP layer k after the decoder's (``model.layers.<num_hidden_layers + k>.``) under these names, with copies of the
# embedding and head (``MTP_COPIES``): the names transformers' MtpModel loads (its "MtpModel" conversion mapping, which
# renames them to its modules' enorm / hnorm / eh_proj / mtp_block / post_norm); hand-written as the rest of these tables.
MTP = (
    Param("enorm.weight", ("enorm.weight",), REPLICATED),
    Param("hnorm.weight", ("hnorm.weight",), REPLICATED),
    Param("eh_proj.weight", ("eh_proj.weight",), ROWS),  # column-parallel: [embedding; hidden] in, hidden out
)
MTP_LAYER = "transformer_layer."
MTP_FINAL_NORM = Param("final_layernorm.weight", ("shared_head.norm.weight",), REPLICATED)
MTP_COPIES = {"embed_tokens.weight": "embedding", "shared_head.head.weight": "output"}  # the family's attribute they copy


def norm(megatron_module: str, hf_module: str, norm_of: str | None = None) -> tuple[Param, ...]:
    """A norm's weight (and bias, for LayerNorm)."""
    return (Param(f"{megatron_module}.weight", (f"{hf_module}.weight",), REPLICATED, norm_of=norm_of),
            Param(f"{megatron_module}.bias", (f"{hf_module}.bias",), REPLICATED, when="layernorm", norm_of=norm_of))


@dataclass(frozen=True)
class Family:
    """A model family's Megatron map. ``layer`` is in megatron-core's module order for the local spec (its
    optimizer numbers parameters in it); Transformer Engine's order moves each ``norm_of`` norm to just
    before its linear's weight."""

    name: str
    model_types: tuple[str, ...]  # the Hugging Face model types it maps
    embedding: str  # Hugging Face names
    final_norm: str  # module
    output: str
    layer_prefix: str  # "model.layers.{i}."
    layer: tuple[Param, ...]
    experts: tuple[Param, ...] = ()  # a MoE layer's tensors of each expert ("{e}" in both names), after ``layer``'s
    # the layers of a MoE model before its first MoE layer (DeepSeek-V3's and GLM-4.5's first_k_dense_replace, the
    # config attribute ``dense_first_attr``; Megatron's --moe-layer-freq [0]*k+[1]*(n-k)): their tensors
    dense_layer: tuple[Param, ...] = ()
    dense_first_attr: str | None = None
    # the config attribute giving the shared experts' width as a multiple of a routed expert's (n_shared_experts);
    # None: the config gives it itself (config_args), or there are none
    shared_multiple_attr: str | None = None
    # the config attributes of group-limited routing (DeepSeek-V3's n_group, topk_group: --moe-router-num-groups,
    # --moe-router-group-topk); None: the family routes over all experts at once
    routing_groups: tuple[str, str] | None = None
    # the config attribute saying whether the top-k routing weights are renormalised (Qwen3-MoE's norm_topk_prob);
    # None: always (Mixtral). Megatron's --moe-router-pre-softmax is its negation (softmax over all, then top-k)
    renormalised_attr: str | None = None

    @property
    def shared_experts(self) -> bool:
        """Whether its MoE layers have megatron-core's shared experts (``mlp.shared_experts``)."""
        return any(p.megatron.startswith("mlp.shared_experts.") for p in self.layer)

    @property
    def router_args(self) -> dict[str, Any]:
        """The router's Megatron-LM arguments the family sets (its score function, expert bias, router dtype)."""
        return {k: v for k, v in self.megatron_args.items() if k.startswith("moe_router_")}
    position_embedding: str | None = None  # learned absolute positions; None: rotary
    norm: str = "RMSNorm"
    eps_attr: str = "rms_norm_eps"  # the config's attribute for the norm's epsilon
    ffn_attr: str = "intermediate_size"  # and for the MLP's width
    activation: tuple[str, ...] = ("silu",)  # the config activations this family's Megatron MLP computes
    gated: bool = True
    qk_norm: bool = False
    qkv_bias: str | bool = "attention_bias"  # a config attribute, or fixed
    proj_bias: str | bool = "attention_bias"  # the attention output projection's bias
    linear_bias: str | bool = "mlp_bias"  # the MLP's; Megatron's --add-bias-linear is this and proj_bias at once
    megatron_args: dict[str, Any] = field(default_factory=dict)  # Megatron-LM arguments the family sets
    config_args: tuple[tuple[str, str], ...] = ()  # (HF config attribute, Megatron arg) carried as they are
    nullable: tuple[str, ...] = ()  # those of them whose None means something (MLA's q_lora_rank: no bottleneck)
    beyond_megatron_lm: str | None = None  # what Megatron-LM's arguments cannot express (a note on the output)
    # multi-token-prediction layers in DeepSeek-V3's layout (``MTP``), counted by transformers' config (``num_mtp_layers``)
    mtp: bool = False
    # (config attribute, value): what the family's Megatron computation fixes (GPT-OSS's swiglu_alpha: quick_gelu's 1.702);
    # a config with another value is refused in one line
    fixed_config: tuple[tuple[str, Any], ...] = ()
    # sliding-window attention written as Megatron-LM's --window-size / --window-attn-skip-freq (the config's
    # sliding_window and layer_types); other families' windows are said in a note, not written
    window: bool = False
    # Megatron-LM arguments (positive numbers) a run must set to be this family's: what its Hugging Face model cannot be
    # without (GPT-OSS clamps its experts' activation always: a run without --activation-func-clamp-value is another model)
    required_args: tuple[str, ...] = ()


_FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    for model_type in family.model_types:
        _FAMILIES[model_type] = family
    return family


def _load_all() -> None:
    from . import deepseek_v3, gemma, glm4_moe, gpt2, gpt_oss, llama, mixtral, phi3, qwen2_moe, qwen3, qwen3_moe  # noqa: F401 - each registers its families


def family_for(model_type: str | None) -> Family:
    """The family mapping ``model_type``; one line naming it when none does."""
    _load_all()
    if model_type in _FAMILIES:
        return _FAMILIES[model_type]
    raise ConversionError(f"model_type {model_type!r} has no Megatron name map (families with one: "
                          f"{', '.join(sorted(_FAMILIES))}); convert it to universal, hf, deepspeed, accelerate or dcp")


def families() -> dict[str, Family]:
    _load_all()
    return dict(_FAMILIES)
