"""A Megatron model's shape, as Megatron-LM's arguments describe it, and its Hugging Face config.

Megatron checkpoints keep the model's architecture in ``args`` (an argparse Namespace pickled into every
``model_optim_rng.pt``, and into ``common.pt`` of a torch_dist checkpoint). This module turns those arguments
into a Hugging Face config and back, and holds the padded vocabulary every Megatron format shares (which pipeline
stage holds which layers: :mod:`.megatron_pipeline`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from interop.errors import ConversionError

from .models.facts import check_counts, tied_groups
from .models.kept import kept
from .models.megatron_family import Family, family_for

DIVISIBLE_BY = 128  # Megatron-LM's --make-vocab-size-divisible-by default


def padded_vocab(vocab: int, tp: int, divisible_by: int = DIVISIBLE_BY) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: the vocabulary rounded up to a multiple of divisible_by x TP."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def _kept_config(raw: dict[str, Any]) -> dict[str, Any]:
    config = raw["config"]
    if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
        raise ValueError("not a config.json")
    return config


@dataclass(frozen=True)
class MegatronArch:
    family: str  # the Megatron name map's family (converters/models/): "llama", "qwen3", "gemma2", "gpt2", ...
    num_layers: int
    hidden: int
    heads: int
    groups: int  # num_query_groups (= heads without grouped-query attention)
    head_dim: int  # kv_channels
    ffn: int
    vocab: int  # the tokenizer's vocabulary, before Megatron pads it
    tied: bool
    gated: bool  # a gated MLP: fc1 holds [gate; up]
    norm: str  # "RMSNorm" or "LayerNorm"
    eps: float
    max_positions: int
    linear_bias: bool  # biases on proj / fc1 / fc2
    qkv_bias: bool
    rope_theta: float | None  # None: learned absolute positions (GPT-2)
    model_type: str = "llama"  # the Hugging Face model_type to export as
    rotary_percent: float = 1.0  # the part of each head rotary embeddings turn (Phi-3's partial_rotary_factor)
    options: tuple[tuple[str, Any], ...] = ()  # the family's config carried as Megatron args (soft-capping, windows)
    dense_first: int = 0  # a MoE model's dense layers before its first MoE layer (first_k_dense_replace)
    dense_ffn: int = 0  # their MLP's width (Megatron's --ffn-hidden-size beside --moe-ffn-hidden-size); 0 without them
    mtp_layers: int = 0  # multi-token-prediction layers after the decoder's (--mtp-num-layers); a Hugging Face source's are
    # those its checkpoint holds (transformers' save_pretrained drops them), counted by the writer (``megatron.mtp_held``)

    @property
    def spec(self) -> Family:
        return family_for(self.model_type)

    @property
    def experts(self) -> int:
        """Each MoE layer's experts (0: a dense model); carried as Megatron's ``--num-experts``."""
        return int(dict(self.options).get("num_experts") or 0)

    def is_moe_layer(self, layer: int) -> bool:
        """Whether ``layer`` (global index) is a MoE layer: all of a MoE model's but its first dense ones."""
        return bool(self.experts) and layer >= self.dense_first

    def check_tp(self, tp: int, where: str | None = None) -> None:
        """Megatron splits whole attention heads and whole query groups over tensor-parallel ranks."""
        sizes = (("attention heads", self.heads), ("query groups", self.groups), ("ffn size", self.ffn), ("dense layers' ffn size", self.dense_ffn))
        problems = [f"{n} {v}" for n, v in sizes if v % tp]
        if problems:
            raise ConversionError(
                f"{where + ': ' if where else ''}tensor-parallel size {tp} does not divide the model's {', '.join(problems)}"
            )

    # --- Hugging Face configs -------------------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config: dict[str, Any]) -> "MegatronArch":
        """Sizes through transformers' own config class (its attribute map reads GPT-2's ``n_embd`` as
        ``hidden_size``), ties from the model transformers builds, the structure from the family's map: asked once
        per config and installed transformers, then kept (``models.kept``), as :meth:`to_hf` is."""
        import json

        try:  # the family's table is this code too: an answer kept before it changed is not this one's
            key = json.dumps([config, repr(family_for(config.get("model_type")))], sort_keys=True, default=str)
        except (TypeError, ValueError):  # keys JSON cannot sort: asked every time
            return cls._asked_from_hf(config)

        def read(raw: dict[str, Any]) -> "MegatronArch":
            arch = cls.from_json(raw["arch"])
            if arch.model_type != config.get("model_type"):
                raise ValueError("kept for another model type")
            return arch

        return kept("megatron-arch", 4, key, lambda: cls._asked_from_hf(config), lambda arch: {"arch": arch.to_json()}, read)

    def to_json(self) -> dict[str, Any]:
        import dataclasses

        return {**dataclasses.asdict(self), "options": [list(o) for o in self.options]}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> "MegatronArch":
        """The inverse of :meth:`to_json`, each field checked (a TypeError or ValueError for a damaged one)."""
        import dataclasses

        fields = {f.name: f for f in dataclasses.fields(cls)}
        if not isinstance(raw, dict) or set(raw) != set(fields):
            raise ValueError("not a MegatronArch")
        kinds = {"family": str, "model_type": str, "norm": str, "tied": bool, "gated": bool, "linear_bias": bool, "qkv_bias": bool,
                 "eps": (int, float), "rotary_percent": (int, float), "rope_theta": (int, float, type(None))}
        for name, value in raw.items():
            if name == "options":
                if not isinstance(value, list) or not all(isinstance(o, list) and len(o) == 2 and isinstance(o[0], str) for o in value):
                    raise ValueError("options")
                continue
            kind = kinds.get(name, int)
            if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
                raise TypeError(f"{name}: {value!r}")
            if kind is int and value < (0 if name in ("dense_first", "dense_ffn", "mtp_layers") else 1):
                raise ValueError(f"{name}: {value!r}")
        try:
            fam = family_for(raw["model_type"])  # a family this code still maps, the one kept
        except ConversionError as exc:
            raise ValueError(str(exc)) from None
        if (fam.name, fam.gated, fam.norm) != (raw["family"], raw["gated"], raw["norm"]):
            raise ValueError(f"not {raw['model_type']}'s Megatron family")
        return cls(**{**raw, "options": tuple(tuple(o) for o in raw["options"])})

    @classmethod
    def _asked_from_hf(cls, config: dict[str, Any]) -> "MegatronArch":
        kind = config.get("model_type")
        fam = family_for(kind)
        import transformers

        causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(kind)
        heads = [a for a in config.get("architectures") or [] if a != causal]
        if heads:
            raise ConversionError(f"Megatron's GPT model is a causal LM ({causal}); this {heads[0]} has another head, "
                                  "which it has no place for")
        cfg = hf_config_object(config)
        act = next((getattr(cfg, a) for a in _ACTIVATION_KEYS if getattr(cfg, a, None)), None)
        if act not in fam.activation:
            raise ConversionError(f"{kind} with activation {act!r}: its Megatron map computes {fam.activation[0]} only")
        theta, percent = None, 1.0
        mla = bool(fam.megatron_args.get("multi_latent_attention"))
        scaling: tuple[tuple[str, Any], ...] = ()
        if fam.position_embedding is None:
            theta, percent, rope = _rope(cfg)
            scaling = _mla_rope(cfg, rope, kind) if mla else _rope_scaling(rope, kind, cfg.max_position_embeddings, percent)
        proj_bias, mlp_bias = _flag(cfg, fam.proj_bias), _flag(cfg, fam.linear_bias)
        if proj_bias != mlp_bias:
            raise ConversionError(f"{kind}: Megatron's --add-bias-linear gives the attention output projection and the MLP "
                                  f"biases together; this model has an output projection bias {proj_bias} but MLP biases {mlp_bias}")
        heads = cfg.num_attention_heads
        options = tuple((arg, getattr(cfg, attr, None)) for attr, arg in fam.config_args)
        experts = dict(options).get("num_experts")
        check_counts(cfg.num_hidden_layers, "config.json", experts if isinstance(experts, int) else 0,
                     int(getattr(cfg, "num_mtp_layers", 0) or 0) if fam.mtp else 0)
        options += scaling
        for attr, fixed in fam.fixed_config:
            if getattr(cfg, attr, fixed) != fixed:
                raise ConversionError(f"{kind} with {attr} {getattr(cfg, attr)!r}: megatron-core computes its Megatron map with {fixed}, "
                                      "no Megatron-LM argument says otherwise")
        if fam.window:
            options += _window_options(cfg)
        dense_first = 0
        if fam.experts:
            if getattr(cfg, "mlp_only_layers", None) or getattr(cfg, "decoder_sparse_step", 1) != 1:
                raise ConversionError(f"{kind} with dense layers among its MoE layers (mlp_only_layers, decoder_sparse_step): "
                                      "its Megatron map has MoE layers only")
            dense_first = int(getattr(cfg, fam.dense_first_attr) or 0) if fam.dense_first_attr else 0
            if dense_first >= cfg.num_hidden_layers:
                raise ConversionError(f"{kind} with {fam.dense_first_attr} {dense_first} of {cfg.num_hidden_layers} layers has no "
                                      "MoE layer; Megatron's MoE model needs one")
            options += _moe_options(fam, cfg, kind)
        return cls(
            family=fam.name, num_layers=cfg.num_hidden_layers, hidden=cfg.hidden_size, heads=heads,
            groups=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            ffn=getattr(cfg, fam.ffn_attr, None) or 4 * cfg.hidden_size, vocab=cfg.vocab_size,
            tied=bool(tied_groups(config)), gated=fam.gated, norm=fam.norm, eps=float(getattr(cfg, fam.eps_attr)),
            max_positions=cfg.max_position_embeddings, linear_bias=mlp_bias,
            qkv_bias=_flag(cfg, fam.qkv_bias), rope_theta=theta, model_type=kind, rotary_percent=percent, options=options,
            dense_first=dense_first, dense_ffn=cfg.intermediate_size if dense_first else 0,  # the dense layers: Llama's MLP
            mtp_layers=int(getattr(cfg, "num_mtp_layers", 0) or 0) if fam.mtp else 0,  # as the config declares them
        )

    def to_hf(self) -> dict[str, Any]:
        """A config.json built by transformers' config class from the sizes (what differs from its defaults): asked
        once per architecture and installed transformers, then kept (``models.kept``), since importing transformers
        costs every conversion of a Megatron checkpoint seconds."""
        import dataclasses
        import json

        key = json.dumps([dataclasses.asdict(self), repr(self.spec)], sort_keys=True, default=str)
        return kept("megatron-config", 3, key, self._asked_hf, lambda config: {"config": config}, _kept_config)

    def _asked_hf(self) -> dict[str, Any]:
        import transformers

        fam = self.spec
        if fam.linear_bias is False and self.linear_bias:
            raise ConversionError(f"{self.model_type} has no MLP or attention output biases; this checkpoint has them")
        if fam.linear_bias is True and not self.linear_bias:  # (GPT-OSS: Megatron-LM's own recipe trains without them)
            raise ConversionError(f"{self.model_type}'s MLP (its experts and router) always has biases, which transformers' model "
                                  "would fill at random; this checkpoint has none (--disable-bias-linear)")
        if fam.proj_bias == fam.qkv_bias and isinstance(fam.qkv_bias, str) and self.qkv_bias != self.linear_bias:
            raise ConversionError(f"{self.model_type}'s {fam.qkv_bias} gives q/k/v and the output projection biases together; "
                                  f"this checkpoint has q/k/v biases {self.qkv_bias} but linear biases {self.linear_bias}")
        kw: dict[str, Any] = dict(
            vocab_size=self.vocab, hidden_size=self.hidden, num_hidden_layers=self.num_layers, num_attention_heads=self.heads,
            max_position_embeddings=self.max_positions, tie_word_embeddings=self.tied, **{fam.eps_attr: self.eps},
            **{fam.ffn_attr: self.ffn if fam.ffn_attr != "n_inner" or self.ffn != 4 * self.hidden else None},
        )
        if fam.position_embedding is None:
            rope = {"rope_theta": self.rope_theta, "rope_type": "default", **_hf_rope_scaling(dict(self.options))}
            if self.rotary_percent != 1.0:
                rope["partial_rotary_factor"] = self.rotary_percent
            kw.update(num_key_value_heads=self.groups, head_dim=self.head_dim, rope_parameters=rope)
        for name, value in ((fam.qkv_bias, self.qkv_bias), (fam.linear_bias, self.linear_bias)):
            if isinstance(name, str):
                kw[name] = value
        options = dict(self.options)
        kw.update({attr: options[arg] for attr, arg in fam.config_args if options.get(arg) is not None or attr in fam.nullable})
        if fam.experts:
            kw.update(_moe_config(self, fam, options))
        if fam.window:
            kw.update(_window_config(options, self.num_layers))
        if fam.mtp:  # transformers' generic name for the count (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers)
            kw["num_mtp_layers"] = self.mtp_layers
        defaults = transformers.AutoConfig.for_model(self.model_type)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # a default token outside this vocabulary
            if isinstance(getattr(defaults, key, None), int) and getattr(defaults, key) >= self.vocab:
                kw[key] = None
        made = transformers.AutoConfig.for_model(self.model_type, **kw)
        config = made.to_diff_dict()
        config.pop("transformers_version", None)
        full = made.to_dict()
        config.update({k: full[k] for k in (*SHAPE_KEYS, *MTP_KEYS) if k in full})  # every size, even one equal to the class default
        causal = transformers.models.auto.modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
        return {"architectures": [causal[self.model_type]], "model_type": self.model_type, **config,
                "vocab_size": self.vocab, "tie_word_embeddings": self.tied}

    # --- Megatron-LM arguments ------------------------------------------------------------------------------
    @classmethod
    def from_args(cls, args: Any, where: str, grouped_gemm: bool = False) -> "MegatronArch":
        """From a checkpoint's ``args`` (a Namespace or its dict); ``where`` names the file for errors.
        ``grouped_gemm``: the format stores grouped-GEMM experts as SequentialMLP's (torch_dist does)."""
        a = args if isinstance(args, dict) else vars(args)
        try:
            heads = a["num_attention_heads"]
            rope = a.get("position_embedding_type", "learned_absolute") in ("rope", "yarn")
            groups = a.get("num_query_groups") if a.get("group_query_attention") else None
            swiglu = bool(a.get("swiglu"))
            norm = a.get("normalization", "LayerNorm")
            qkv_bias = bool(a.get("add_qkv_bias")) or bool(a.get("add_bias_linear", True))
            model_type = a.get("hf_model_type")
            experts = _count_arg(a, "num_experts", where)
            if model_type is None:  # a Megatron-LM run's own checkpoint: the family from its flags
                if experts and a.get("quick_geglu"):  # Megatron-LM's GPT-OSS recipe's experts
                    model_type = "gpt_oss"
                elif experts and a.get("moe_router_score_function") == "sigmoid":  # the families with a sigmoid router:
                    model_type = "deepseek_v3" if a.get("multi_latent_attention") else "glm4_moe"  # on MLA, on GQA
                elif experts and rope and swiglu and norm == "RMSNorm":
                    model_type = ("qwen3_moe" if a.get("qk_layernorm") else
                                  "qwen2_moe" if a.get("moe_shared_expert_intermediate_size") else "mixtral")
                elif rope and swiglu and norm == "RMSNorm":
                    model_type = "qwen3" if a.get("qk_layernorm") else (
                        "qwen2" if a.get("add_qkv_bias") and not a.get("add_bias_linear", True) else "llama")
                elif not rope and not swiglu and norm == "LayerNorm":
                    model_type = "gpt2"
                else:
                    raise ConversionError(
                        f"{where}: a model with position embedding {a.get('position_embedding_type')!r}, normalization {norm!r} "
                        f"and swiglu={swiglu} is neither Llama-like nor GPT-2-like; no Hugging Face name map fits it"
                    )
            fam = family_for(model_type)
            if experts:
                _check_moe(a, where, fam, grouped_gemm)
            if bool(experts) != bool(fam.experts):
                raise ConversionError(f"{where}: a {'MoE' if experts else 'dense'} model (--num-experts {experts}), but a "
                                      f"{model_type} model is {'dense' if experts else 'MoE'}; no Hugging Face name map fits it")
            carried = {arg for _, arg in fam.config_args}  # what the family's config says either way (GLM-4.5's use_qk_norm)
            for flag in ("qk_layernorm", "apply_layernorm_1p", "moe_shared_expert_gate", "multi_latent_attention"):  # structure the family's map must agree with
                if flag not in carried and bool(a.get(flag)) != bool(fam.megatron_args.get(flag)):
                    raise ConversionError(
                        f"{where}: the run {'used' if a.get(flag) else 'did not use'} --{flag.replace('_', '-')}, which a "
                        f"{model_type} model {'does not have' if a.get(flag) else 'needs'}; no Hugging Face name map fits it")
            for arg, plain in _COMPUTED.items():  # what megatron-core computes that the family's map fixes
                got, want = a.get(arg), fam.megatron_args.get(arg, plain)
                if arg not in carried and (plain if got is None else got) != want:
                    raise ConversionError(f"{where}: the run has --{arg.replace('_', '-')} {got!r}, a {model_type} model computes "
                                          f"with {want!r}; no Hugging Face name map fits it")
            for arg in fam.required_args:
                if _number_arg(a, arg, None, where, positive=True) is None:
                    raise ConversionError(f"{where}: the run has no --{arg.replace('_', '-')}, which every {model_type} model "
                                          "has; no Hugging Face config says its model")
            window = _window_args(a, where)
            if window and not fam.window:
                raise ConversionError(f"{where}: the run attends within a sliding window (--window-size {a.get('window_size')!r}), which "
                                      f"this converter's {model_type} map does not carry into a Hugging Face config")
            padded = a.get("padded_vocab_size")
            dense_first = _dense_first(a, where) if experts else 0
            mtp_layers = _count_arg(a, "mtp_num_layers", where)
            check_counts(_count_arg(a, "num_layers", where), where, experts, mtp_layers)
            if mtp_layers and not fam.mtp:
                raise ConversionError(f"{where}: the run has {mtp_layers} multi-token-prediction layer(s) (--mtp-num-layers), which a "
                                      f"{model_type} model's Hugging Face layout has no place for")
            return cls(
                family=fam.name, num_layers=a["num_layers"], hidden=a["hidden_size"], heads=heads, groups=groups or heads,
                head_dim=a.get("kv_channels") or a["hidden_size"] // heads,
                ffn=(experts and a.get("moe_ffn_hidden_size")) or a.get("ffn_hidden_size") or 4 * a["hidden_size"],
                vocab=a.get("vocab_size") or padded,
                tied=not a.get("untie_embeddings_and_output_weights", False), gated=fam.gated, norm=norm,
                eps=a.get("norm_epsilon", a.get("layernorm_epsilon", 1e-5)), max_positions=a.get("max_position_embeddings") or a.get("seq_length"),
                linear_bias=bool(a.get("add_bias_linear", True)), qkv_bias=qkv_bias,
                rope_theta=float(a.get("rotary_base", 10000)) if rope else None, model_type=model_type,
                rotary_percent=float(a.get("rotary_percent", 1.0)),
                options=tuple((arg, a.get(arg)) for _, arg in fam.config_args) + (_moe_args(a, fam) if experts else ())
                + (_mla_rope_args(a, where) if a.get("multi_latent_attention") else _rope_scaling_args(a, where)) + window,
                dense_first=dense_first, dense_ffn=(a.get("ffn_hidden_size") or 4 * a["hidden_size"]) if dense_first else 0,
                mtp_layers=mtp_layers,
            )
        except KeyError as exc:
            raise ConversionError(f"{where}: Megatron args lack {exc.args[0]!r}, so the model's shape is unknown") from None

    def to_args(self, tp: int, pp: int, **extra: Any) -> dict[str, Any]:
        """The Megatron-LM arguments that describe this model at TP x PP (``--`` flags with '-' as '_'), with
        the family's own (``--qk-layernorm``, ``--apply-layernorm-1p``, ``--openai-gelu``, soft-capping)."""
        rope = self.rope_theta is not None
        fam = self.spec
        args = {
            "num_layers": self.num_layers, "hidden_size": self.hidden, "ffn_hidden_size": self.ffn,
            "num_attention_heads": self.heads, "group_query_attention": self.groups != self.heads,
            "num_query_groups": self.groups, "kv_channels": self.head_dim, "max_position_embeddings": self.max_positions,
            "seq_length": self.max_positions, "position_embedding_type": "rope" if rope else "learned_absolute",
            "use_rotary_position_embeddings": rope, "rotary_base": int(self.rope_theta) if rope else 10000,
            "rotary_percent": self.rotary_percent, "normalization": self.norm, "norm_epsilon": self.eps,
            "swiglu": self.gated and "silu" in fam.activation,
            "untie_embeddings_and_output_weights": not self.tied, "add_bias_linear": self.linear_bias,
            "add_qkv_bias": self.qkv_bias, "vocab_size": self.vocab, "padded_vocab_size": padded_vocab(self.vocab, tp),
            "make_vocab_size_divisible_by": DIVISIBLE_BY, "tensor_model_parallel_size": tp,
            "pipeline_model_parallel_size": pp, "virtual_pipeline_model_parallel_size": None, "hf_model_type": self.model_type,
            "mtp_num_layers": self.mtp_layers or None,  # Megatron-LM's default: None (no MTP block)
            **fam.megatron_args, **dict(self.options),
        }
        if self.experts:  # megatron-core's SequentialMLP experts of the family's width, routed as the model routes
            args.update(moe_ffn_hidden_size=self.ffn, moe_grouped_gemm=False, moe_router_score_function="softmax",
                        moe_router_pre_softmax=bool(dict(self.options).get("moe_router_pre_softmax")), moe_layer_freq=1,
                        expert_model_parallel_size=1)
            args.update(fam.router_args)
            if self.dense_first:  # Megatron-LM's --moe-layer-freq "([0]*k+[1]*(n-k))", parsed to its list
                args.update(moe_layer_freq=[0] * self.dense_first + [1] * (self.num_layers - self.dense_first), ffn_hidden_size=self.dense_ffn)
        args.update(extra)
        return args


# megatron-core MoE options whose weights or routing the Mixtral map does not express: refused, never half-read
_MOE_UNMAPPED = {
    # torch_dist stores grouped-GEMM experts under SequentialMLP's keys (megatron-core makes them interchangeable);
    # legacy files hold GroupedMLP's weight1 / weight2 or TEGroupedMLP's linear_fc1.weight<i>, not mapped
    "moe_grouped_gemm": (False, "grouped-GEMM experts in legacy files (weight1/weight2 or linear_fc1.weight<i>; "
                                "--ckpt-format torch_dist stores them as SequentialMLP's, which is read)"),
    "moe_use_legacy_grouped_gemm": (False, "GroupedMLP experts in legacy files (weight1/weight2; --ckpt-format torch_dist "
                                           "stores them as SequentialMLP's, which is read)"),
    "moe_shared_expert_intermediate_size": (None, "shared experts"),
    "moe_router_score_function": ("softmax", "a router score function other than softmax"),
    "moe_router_pre_softmax": (False, "softmax before the top-k"),
    "moe_router_enable_expert_bias": (False, "a router expert bias"),
    "moe_router_num_groups": (None, "group-limited routing"),
    "moe_layer_freq": (1, "dense layers among the MoE layers"),
    "moe_router_topk_scaling_factor": (None, "scaled top-k weights"),
    "moe_expert_capacity_factor": (None, "an expert capacity (dropped tokens)"),
    "moe_router_load_balancing_type": ("aux_loss", "another load-balancing router"),
}


def _check_moe(a: dict[str, Any], where: str, fam: Family, grouped_gemm: bool = False) -> None:
    """What the family's model has it maps (either routing order where its config says which, shared experts,
    its router's score function, expert bias and groups, dense layers first; grouped-GEMM experts where the format
    stores them as SequentialMLP's)."""
    mapped = {"moe_router_pre_softmax": fam.renormalised_attr is not None and not _sigmoid(fam),
              "moe_shared_expert_intermediate_size": fam.shared_experts,
              "moe_grouped_gemm": grouped_gemm, "moe_use_legacy_grouped_gemm": grouped_gemm, "moe_layer_freq": bool(fam.dense_layer),
              **{arg: _carries(fam, arg) for arg in _MOE_CARRIED}}
    for arg, value in fam.router_args.items():  # the family's router: a run's must be the same
        if arg in _MOE_UNMAPPED and a.get(arg, _MOE_UNMAPPED[arg][0]) != value:
            raise ConversionError(f"{where}: this MoE run has --{arg.replace('_', '-')} {a.get(arg, _MOE_UNMAPPED[arg][0])}, but a "
                                  f"{fam.name} model's router has {value}; no Hugging Face name map fits it")
        mapped[arg] = True
    if fam.shared_multiple_attr:
        _shared_multiple(_count_arg(a, "moe_shared_expert_intermediate_size", where), _count_arg(a, "moe_ffn_hidden_size", where), fam, where)
    _number_arg(a, "moe_router_topk_scaling_factor", None, where, positive=True)
    if fam.routing_groups and _count_arg(a, "moe_router_num_groups", where) > 1:
        _check_groups(_count_arg(a, "moe_router_topk", where), _count_arg(a, "moe_router_group_topk", where), where)
    for arg, (plain, what) in _MOE_UNMAPPED.items():
        value = a.get(arg, plain)
        if arg == "moe_layer_freq" and isinstance(value, (list, tuple)) and set(value) == {1}:
            continue  # every layer MoE, spelled as a pattern
        if arg == "moe_router_load_balancing_type" and value in ("none", "seq_aux_loss"):
            continue  # a training loss only: the routing is the same
        if value is not None and value != plain and not mapped.get(arg):
            raise ConversionError(f"{where}: this MoE run has {what} (--{arg.replace('_', '-')} {value}); the Megatron MoE "
                                  "map reads SequentialMLP experts with softmax top-k routing only")


# router arguments a family carries from its config where it names them (config_args, routing_groups)
_MOE_CARRIED = ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk_scaling_factor")


# what megatron-core computes beyond the weights that a family's map fixes (Megatron-LM's defaults where its megatron_args set
# none), a run's must be its family's: GPT-OSS's activation (--quick-geglu --glu-linear-offset, its clamp a config
# value) and attention sinks (--softmax-type learnable)
_COMPUTED = {"quick_geglu": False, "glu_linear_offset": 0.0, "softmax_type": "vanilla", "activation_func_clamp_value": None}


def _window_options(cfg: Any) -> tuple[tuple[str, Any], ...]:
    """A config's sliding window as Megatron-LM's --window-size and --window-attn-skip-freq: transformers' window of W
    tokens (the token itself and W - 1 before it) is megatron-core's (W - 1, 0); the layers that have it are the
    config's layer_types' sliding ones: every layer (no skip frequency), all but each k-th (k), or a list."""
    window = getattr(cfg, "sliding_window", None)
    types = list(getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers)
    sliding = [int(t == "sliding_attention") for t in types]
    if window is None or not any(sliding):
        return ()
    if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= 2**31:
        raise ConversionError(f"{cfg.model_type} with sliding_window {window!r}: not a number of tokens (1 to 2**31)")
    freq: Any = [*sliding]
    if all(sliding):
        freq = None
    else:
        k = sliding.index(0) + 1
        if sliding == [int((i + 1) % k != 0) for i in range(len(sliding))]:
            freq = k
    return (("window_size", [int(window) - 1, 0]), ("window_attn_skip_freq", freq))


def _window_args(a: dict[str, Any], where: str) -> tuple[tuple[str, Any], ...]:
    """A run's --window-size / --window-attn-skip-freq as :func:`_window_options` gives them (none: no window), checked:
    a window of (w, 0) (a causal one), a skip frequency that is a count or a 0/1 list of its layers."""
    size, freq = a.get("window_size"), a.get("window_attn_skip_freq")
    if not size:
        return ()
    if (not isinstance(size, (list, tuple)) or len(size) != 2 or any(isinstance(v, bool) or not isinstance(v, int) for v in size)
            or size[0] < 0 or size[1] != 0):
        raise ConversionError(f"{where}: --window-size {size!r} is not a causal window (<tokens before>, 0)")
    layers = a.get("num_layers")
    if freq is not None and not (type(freq) is int and freq >= 1) and not (
            isinstance(freq, (list, tuple)) and len(freq) == layers and all(type(v) is int and v in (0, 1) for v in freq)):
        raise ConversionError(f"{where}: --window-attn-skip-freq {freq!r} is neither a count nor a 0/1 pattern of its {layers} layers")
    return (("window_size", [size[0], 0]), ("window_attn_skip_freq", list(freq) if isinstance(freq, (list, tuple)) else freq))


def _window_config(options: dict[str, Any], layers: int) -> dict[str, Any]:
    """The inverse of :func:`_window_options`: the config's sliding_window and layer_types."""
    size = options.get("window_size")
    if not size:
        return {"layer_types": ["full_attention"] * layers}
    freq = options.get("window_attn_skip_freq")
    sliding = ([bool(v) for v in freq] if isinstance(freq, list) else [True] * layers if freq is None
               else [(i + 1) % freq != 0 for i in range(layers)])
    return {"sliding_window": size[0] + 1, "layer_types": ["sliding_attention" if s else "full_attention" for s in sliding]}


def _count_arg(a: dict[str, Any], name: str, where: str) -> int:
    """A whole-number argument of an untrusted run (absent: 0), or one line naming it."""
    value = a.get(name) or 0
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConversionError(f"{where}: --{name.replace('_', '-')} {value!r} is not a count")
    return value


def _number_arg(a: dict[str, Any], name: str, default: Any, where: str, positive: bool = False) -> Any:
    """A real argument of an untrusted run, non-negative (``positive``: above 0), as a float; absent or None:
    ``default`` (Megatron-LM's), or one line naming it."""
    value = a.get(name)
    if value is None:
        return default
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0
            or (positive and value == 0)):
        raise ConversionError(f"{where}: --{name.replace('_', '-')} {value!r} is not a {'positive' if positive else 'non-negative'} number")
    return float(value)


def _moe_args(a: dict[str, Any], fam: Family) -> tuple[tuple[str, Any], ...]:
    """A run's MoE arguments a family keeps beyond its config_args, in :func:`_moe_options`' order (checked first by
    :func:`_check_moe`)."""
    out: tuple[tuple[str, Any], ...] = ()
    if fam.shared_multiple_attr:
        out += (("moe_shared_expert_intermediate_size", a.get("moe_shared_expert_intermediate_size")),)
    if fam.routing_groups and (a.get("moe_router_num_groups") or 1) > 1:
        out += (("moe_router_num_groups", a["moe_router_num_groups"]), ("moe_router_group_topk", a.get("moe_router_group_topk")))
    if fam.renormalised_attr and not _sigmoid(fam):
        out += (("moe_router_pre_softmax", bool(a.get("moe_router_pre_softmax"))),)
    return out


def _sigmoid(fam: Family) -> bool:
    return fam.router_args.get("moe_router_score_function") == "sigmoid"


def _carries(fam: Family, arg: str) -> bool:
    groups = ("moe_router_num_groups", "moe_router_group_topk") if fam.routing_groups else ()
    return arg in groups or arg in {a for _, a in fam.config_args}


def _check_groups(topk: int, group_topk: int, where: str) -> None:
    """megatron-core ranks expert groups by the sum of their top topk / group_topk scores; transformers' DeepSeek-V3
    router (and GLM-4.5's) by their top 2: the same routing only where topk / group_topk is 2."""
    if group_topk < 1 or topk % group_topk or topk // group_topk != 2:
        raise ConversionError(f"{where}: group-limited routing of top-{topk} over {group_topk} groups: megatron-core ranks groups by "
                              f"their best {topk}/{group_topk} scores, transformers by their best 2; they route alike only "
                              "where the top-k is twice the groups picked")


def _moe_options(fam: Family, cfg: Any, kind: str) -> tuple[tuple[str, Any], ...]:
    """A MoE config's routing and shared experts as Megatron-LM arguments (beyond the family's config_args)."""
    out: tuple[tuple[str, Any], ...] = ()
    topk = int(cfg.num_experts_per_tok)
    if fam.shared_multiple_attr:
        shared = int(getattr(cfg, fam.shared_multiple_attr) or 0)
        out += (("moe_shared_expert_intermediate_size", shared * getattr(cfg, fam.ffn_attr) if shared else None),)
    if fam.routing_groups:
        groups, picked = (getattr(cfg, a) for a in fam.routing_groups)
        if groups and groups > 1:
            _check_groups(topk, int(picked or 0), f"{kind} ({fam.routing_groups[0]} {groups}, {fam.routing_groups[1]} {picked})")
            out += (("moe_router_num_groups", int(groups)), ("moe_router_group_topk", int(picked)))
    if fam.renormalised_attr:
        renormalised = bool(getattr(cfg, fam.renormalised_attr))
        if not _sigmoid(fam):  # Megatron's routing order: softmax over every expert first, or over the top-k
            out += (("moe_router_pre_softmax", not renormalised),)
        elif topk > 1 and not renormalised:
            raise ConversionError(f"{kind} with {fam.renormalised_attr}=False: megatron-core renormalises a sigmoid router's "
                                  "top-k scores always; no Megatron argument routes as this model does")
    return out


def _moe_config(arch: "MegatronArch", fam: Family, options: dict[str, Any]) -> dict[str, Any]:
    """The inverse of :func:`_moe_options` and of the dense layers' arguments: the MoE config's attributes."""
    kw: dict[str, Any] = {}
    if fam.renormalised_attr:
        kw[fam.renormalised_attr] = True if _sigmoid(fam) else not options.get("moe_router_pre_softmax", False)
    if fam.shared_multiple_attr:
        kw[fam.shared_multiple_attr] = _shared_multiple(options.get("moe_shared_expert_intermediate_size") or 0, arch.ffn, fam)
    if fam.routing_groups:
        kw.update(zip(fam.routing_groups, (options.get("moe_router_num_groups") or 1, options.get("moe_router_group_topk") or 1)))
    if fam.dense_first_attr:
        kw[fam.dense_first_attr] = arch.dense_first
        if arch.dense_first:
            kw["intermediate_size"] = arch.dense_ffn
    return kw


def _shared_multiple(shared: int, ffn: int, fam: Family, where: str | None = None) -> int:
    """How many routed experts wide the shared experts are (the family's config says so: n_shared_experts)."""
    if ffn and shared % ffn:
        raise ConversionError(f"{where + ': ' if where else ''}shared experts {shared} wide: a {fam.name} model's are a multiple "
                              f"of a routed expert's width ({ffn}, its {fam.ffn_attr})")
    return shared // ffn if ffn else 0


def _dense_first(a: dict[str, Any], where: str) -> int:
    """How many dense layers come before the MoE ones in Megatron-LM's --moe-layer-freq (1: none; a pattern list);
    other patterns (every other layer MoE) have no Hugging Face config that says them."""
    freq = a.get("moe_layer_freq", 1)
    if freq is None or (type(freq) is int and freq == 1):
        return 0
    if isinstance(freq, (list, tuple)) and all(type(v) is int and v in (0, 1) for v in freq) and len(freq) == a.get("num_layers"):
        k = list(freq).index(1) if 1 in freq else len(freq)
        if list(freq) == [0] * k + [1] * (len(freq) - k) and k < len(freq):
            return k
    raise ConversionError(f"{where}: --moe-layer-freq {freq!r}: only dense layers first, then MoE layers ([0]*k+[1]*(n-k)), "
                          "is a Hugging Face model's (first_k_dense_replace)")


SHAPE_KEYS = {  # the sizes the arguments decide, whatever a recorded config says
    "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "n_embd", "n_layer", "n_head", "n_inner", "n_positions", "max_position_embeddings", "tie_word_embeddings",
}

# where a config.json counts multi-token-prediction layers: transformers' num_mtp_layers, stored under its config class's
# attribute-map name (DeepSeek-V3's and GLM-4.5's num_nextn_predict_layers); the arguments decide it where they have MTP layers
MTP_KEYS = ("num_nextn_predict_layers", "num_mtp_layers")

_ACTIVATION_KEYS = ("hidden_activation", "hidden_act", "activation_function")


def hf_config_object(config: dict[str, Any]) -> Any:
    """transformers' config class for ``config`` (its defaults filled in, its attribute names mapped)."""
    import transformers

    try:
        return transformers.AutoConfig.for_model(**config)
    except Exception as exc:  # noqa: BLE001 - any failure means the same: transformers cannot read this config
        raise ConversionError(f"transformers cannot read this {config.get('model_type')!r} config: {exc}") from None


def _flag(cfg: Any, name: str | bool) -> bool:
    return name if isinstance(name, bool) else bool(getattr(cfg, name, False))


def _rope(cfg: Any) -> tuple[float, float, dict[str, Any]]:
    """(rotary base, rotary percent, rope_parameters): the full-attention layers' where the config has one per
    layer type. Its scaling is the caller's (:func:`_rope_scaling`, :func:`_mla_rope`)."""
    rope = dict(getattr(cfg, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = rope.get("full_attention") or next(iter(rope.values()))
    percent = rope.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None))
    return float(rope.get("rope_theta", 10000.0)), float(percent if percent is not None else 1.0), rope


# Llama 3.x's frequency scaling as megatron-core's RotaryEmbedding._apply_scaling computes it: Megatron-LM sets
# only its factor (--use-rope-scaling --rope-scaling-factor); the rest are that function's defaults
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _unmapped_scaling(rope: dict[str, Any]) -> ConversionError:
    return ConversionError(f"rope scaling {rope.get('rope_type')!r} has no Megatron equivalent this converter writes")


def _rope_scaling(rope: dict[str, Any], kind: str, max_positions: int, percent: float) -> tuple[tuple[str, Any], ...]:
    """A rotary model's frequency scaling as Megatron-LM's arguments: Llama 3.x's (``rope_type`` llama3:
    ``--use-rope-scaling --rope-scaling-factor``, as Megatron-LM's own Llama-3 import sets them) and YaRN
    (``--position-embedding-type yarn`` with its ``--yarn-*`` fields, Qwen's long-context configs). Other kinds
    (linear interpolation's ``--rotary-seq-len-interpolation-factor`` never reaches Megatron-LM's GPT model), or
    fields megatron-core fixes set otherwise, are refused in one line."""
    kind_ = rope.get("rope_type", "default")
    if kind_ == "default":
        return ()
    if kind_ == "yarn":
        return _gpt_yarn(rope, kind, max_positions, percent)
    if kind_ != "llama3":
        raise _unmapped_scaling(rope)
    for key, fixed in LLAMA3_FIXED.items():
        if rope.get(key) != fixed:
            raise ConversionError(f"{kind} with llama3 rope scaling: {key} {rope.get(key)}; megatron-core's Llama 3.x scaling "
                                  f"computes with {fixed} (Megatron-LM has no argument for it)")
    return (("use_rope_scaling", True), ("rope_scaling_factor", float(rope["factor"])))


def _gpt_yarn(rope: dict[str, Any], kind: str, max_positions: int, percent: float) -> tuple[tuple[str, Any], ...]:
    """YaRN on a GPT model's attention (megatron-core's YarnRotaryEmbedding, its config's ``yarn_*`` fields, as
    Megatron-LM sets them from ``--rotary-scaling-factor --yarn-original-max-position-embeddings --yarn-beta-fast
    --yarn-beta-slow --mscale --mscale-all-dim --[no-]yarn-correction-range-round-to-int``). The softmax scale is
    unscaled on both sides; only the cos/sin factor must agree (:func:`_yarn_scales`)."""
    where = f"{kind} with YaRN rotary scaling"
    if percent != 1.0:
        raise ConversionError(f"{where} on {percent:g} of each head: megatron-core's YaRN embedding spans the whole head")
    original = rope.get("original_max_position_embeddings")
    if not isinstance(original, int) or original <= 0:
        raise ConversionError(f"{where}: original_max_position_embeddings {original!r} is not a context length")
    factor = float(rope.get("factor") or max_positions / original)
    mscale, all_dim = _yarn_scales(rope, factor, where)
    return (("position_embedding_type", "yarn"), ("rotary_scaling_factor", factor), ("yarn_original_max_position_embeddings", original),
            ("yarn_beta_fast", float(rope.get("beta_fast") or 32.0)), ("yarn_beta_slow", float(rope.get("beta_slow") or 1.0)),
            ("mscale", mscale), ("mscale_all_dim", all_dim), ("yarn_correction_range_round_to_int", bool(rope.get("truncate", True))))


def _rope_scaling_args(a: dict[str, Any], where: str) -> tuple[tuple[str, Any], ...]:
    """A run's rotary scaling arguments (:func:`_rope_scaling`'s), where it set them; Megatron-LM's defaults for
    the YaRN fields it left unset (YarnRotaryEmbedding's)."""
    yarn = a.get("position_embedding_type") == "yarn"
    if yarn and a.get("use_rope_scaling"):
        raise ConversionError(f"{where}: --position-embedding-type yarn with --use-rope-scaling, which no Hugging Face "
                              "rope_parameters say together")
    if yarn:
        original = a.get("yarn_original_max_position_embeddings") or 4096
        if isinstance(original, bool) or not isinstance(original, int) or original <= 0:
            raise ConversionError(f"{where}: --yarn-original-max-position-embeddings {original!r} is not a context length")
        rounded = a.get("yarn_correction_range_round_to_int")
        return (("position_embedding_type", "yarn"), ("rotary_scaling_factor", _number_arg(a, "rotary_scaling_factor", 1.0, where)),
                ("yarn_original_max_position_embeddings", original),
                ("yarn_beta_fast", _number_arg(a, "yarn_beta_fast", 32.0, where)), ("yarn_beta_slow", _number_arg(a, "yarn_beta_slow", 1.0, where)),
                ("mscale", _number_arg(a, "mscale", 1.0, where)), ("mscale_all_dim", _number_arg(a, "mscale_all_dim", 0.0, where)),
                ("yarn_correction_range_round_to_int", rounded is not False))
    if not a.get("use_rope_scaling"):
        return ()
    return (("use_rope_scaling", True), ("rope_scaling_factor", _number_arg(a, "rope_scaling_factor", LLAMA3_GPT_FACTOR, where)))


# the factor Megatron-LM's GPT builder (gpt_builders.py) computes Llama 3.x scaling with: it hands GPTModel
# --use-rope-scaling but not --rope-scaling-factor, so megatron-core's default is what a pretrain_gpt run uses
LLAMA3_GPT_FACTOR = 8.0


def rope_scaling_notes(options: dict[str, Any]) -> list[str]:
    """What a Megatron-LM run would compute unlike the arguments say (a note on the output)."""
    factor = options.get("rope_scaling_factor")
    if options.get("use_rope_scaling") and factor != LLAMA3_GPT_FACTOR:
        return [f"--rope-scaling-factor {factor:g} written; Megatron-LM's GPT builder hands megatron-core's GPTModel only "
                f"--use-rope-scaling (factor {LLAMA3_GPT_FACTOR:g}): a run must pass rope_scaling_factor={factor:g} itself"]
    return []


def _hf_rope_scaling(options: dict[str, Any]) -> dict[str, Any]:
    """transformers' rope_parameters for a run's rotary scaling (empty for none): Llama 3.x's, YaRN (a GPT model's
    with its own fields, multi-latent attention's with the ones megatron-core fixes)."""
    if options.get("use_rope_scaling"):
        return {"rope_type": "llama3", "factor": options["rope_scaling_factor"], **LLAMA3_FIXED}
    if options.get("position_embedding_type") == "yarn":
        fields = {"original_max_position_embeddings": options["yarn_original_max_position_embeddings"],
                  "beta_fast": options["yarn_beta_fast"], "beta_slow": options["yarn_beta_slow"],
                  **({} if options["yarn_correction_range_round_to_int"] else {"truncate": False})}
        return _hf_yarn(options["rotary_scaling_factor"], options["mscale"], options["mscale_all_dim"], fields)
    if options.get("rope_type") == "yarn":
        return _hf_yarn(options["rotary_scaling_factor"], options["mscale"], options["mscale_all_dim"], MLA_YARN_FIXED)
    return {}


# megatron-core MLATransformerConfig's YaRN fields Megatron-LM has no argument for (its --yarn-* flags feed other
# models' YaRN only): every Megatron-LM MLA run computes with these, so a model with others cannot be its run
MLA_YARN_FIXED = {"original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0}


def _yarn_mscale(factor: float, mscale: float) -> float:
    """YaRN's attention-scale term, as transformers' and megatron-core's yarn_get_mscale compute it."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _concentration(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """The factor megatron-core's MLA multiplies cos and sin by (its _yarn_get_concentration_factor)."""
    return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))


def _mla_rope(cfg: Any, rope: dict[str, Any], kind: str) -> tuple[tuple[str, Any], ...]:
    """Multi-latent attention's rotary scaling as Megatron-LM's arguments: none (``--rope-type rope``) or YaRN
    (``--rope-type yarn --rotary-scaling-factor --mscale --mscale-all-dim``), chosen so that megatron-core computes
    transformers' frequencies, cos/sin factor and softmax scale exactly; what it cannot is refused in one line."""
    if rope.get("rope_type", "default") == "default":
        return (("rope_type", "rope"),)
    if rope.get("rope_type") != "yarn":  # megatron-core's MLA has no other scaling
        raise _unmapped_scaling(rope)
    where = f"{kind} with YaRN rotary scaling"
    for key, fixed in MLA_YARN_FIXED.items():
        got = rope.get(key) or (None if key == "original_max_position_embeddings" else fixed)
        if got != fixed:
            raise ConversionError(f"{where}: {key} {got}; a Megatron-LM run's multi-latent attention computes with {fixed} "
                                  "(megatron-core's MLATransformerConfig default: Megatron-LM has no argument for it)")
    if rope.get("truncate", True) is False:
        raise ConversionError(f"{where}: truncate false; megatron-core's MLA rounds the correction range to integers")
    factor = float(rope.get("factor") or cfg.max_position_embeddings / rope["original_max_position_embeddings"])
    mscale, all_dim = _yarn_scales(rope, factor, where)
    return (("rope_type", "yarn"), ("rotary_scaling_factor", factor), ("mscale", mscale), ("mscale_all_dim", all_dim))


def _yarn_scales(rope: dict[str, Any], factor: float, where: str) -> tuple[float, float]:
    """megatron-core's --mscale / --mscale-all-dim for transformers' YaRN: cos and sin are scaled by
    attention_factor, else mscale / mscale_all_dim's ratio where both are set, else yarn_get_mscale(factor);
    megatron-core scales them by the ratio always, and (multi-latent attention only, as DeepSeek's models in
    transformers) the softmax by --mscale-all-dim's term squared. So --mscale-all-dim is mscale_all_dim, and
    --mscale the first of mscale, 1 whose ratio is transformers' factor exactly; none: one line."""
    mscale, mscale_all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    wanted = rope.get("attention_factor")
    if wanted is None:
        wanted = _concentration(factor, mscale, mscale_all_dim) if mscale and mscale_all_dim else _yarn_mscale(factor, 1.0)
    all_dim = float(mscale_all_dim or 0.0)
    fits = [float(m) for m in (mscale, 1.0) if m is not None and _concentration(factor, float(m), all_dim) == wanted]
    if not fits:
        raise ConversionError(f"{where}: an attention factor {wanted:g} beside mscale_all_dim {all_dim:g}, which megatron-core's "
                              "--mscale / --mscale-all-dim cannot give together")
    return fits[0], all_dim


def _mla_rope_args(a: dict[str, Any], where: str) -> tuple[tuple[str, Any], ...]:
    """A run's MLA rotary arguments (:func:`_mla_rope`'s), Megatron-LM's defaults where it records none (YaRN:
    --rope-type's default for MLA; --rotary-scaling-factor 1, --mscale 1, --mscale-all-dim 0)."""
    kind = a.get("rope_type") or "yarn"
    if kind == "rope":
        return (("rope_type", "rope"),)
    if kind != "yarn":
        raise ConversionError(f"{where}: --rope-type {kind!r} is neither rope nor yarn")
    return (("rope_type", "yarn"), ("rotary_scaling_factor", _number_arg(a, "rotary_scaling_factor", 1.0, where)),
            ("mscale", _number_arg(a, "mscale", 1.0, where)), ("mscale_all_dim", _number_arg(a, "mscale_all_dim", 0.0, where)))


def _hf_yarn(factor: float, mscale: float, all_dim: float, fields: dict[str, Any]) -> dict[str, Any]:
    """transformers' YaRN rope_parameters for megatron-core's: its factor, ``fields`` (the original context, the
    betas), mscale and mscale_all_dim, and the cos/sin factor itself where transformers would not compute
    megatron-core's from them."""
    out = {"rope_type": "yarn", "factor": factor, **fields, "mscale": mscale, "mscale_all_dim": all_dim}
    theirs = _concentration(factor, mscale, all_dim) if mscale and all_dim else _yarn_mscale(factor, 1.0)
    if theirs != _concentration(factor, mscale, all_dim):
        out["attention_factor"] = _concentration(factor, mscale, all_dim)
    return out
