"""Megatron name maps per model family (converters/models/): each family's tiny model through Megatron legacy
and torch_dist at TP2 x PP2 and back is bit-exact, and megatron-core's own GPT model, built as Megatron-LM
builds it from the arguments we write, loads our checkpoint and gives transformers' logits.

megatron-core can build Llama, Mistral, Qwen2, Qwen3 (``--qk-layernorm``), Phi-3 and GPT-2 on a CPU with its
local spec. Gemma's zero-centred norms need Apex or Transformer Engine (its torch norm refuses
``layernorm_zero_centered_gamma``), and its embedding scaling and Gemma 2/3's post-norms and soft-capping
are Megatron-Bridge's modules, not megatron-core's: those families are checked by the round trip, by the
arguments they carry, and by the note their output says it with.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch
import transformers

from converters import registry
from converters.megatron import load_megatron_file
from converters.megatron_arch import MegatronArch
from converters.models.megatron_family import families
from interop.errors import ConversionError
from tests.architectures import ARCHITECTURES, build, logits, spec
from tests.conftest import ROOT, run_workers, worker_env

MAPPED = [n for n, (model_type, *_) in ARCHITECTURES.items() if model_type in families() and "classifier" not in n]
MCORE = ["llama", "llama3", "qwen2", "qwen3", "qwen3_yarn", "phi3", "gpt2"]  # what megatron-core's local spec builds on a CPU


def convert(src, dst, target: str, **extra) -> list[str]:
    ckpt = registry.read(str(src))[1]
    registry.writer(target).write(ckpt, str(dst), registry.Options(extra=extra))
    return ckpt.notes


def exact_back(tmp_path, name: str, target: str) -> list[str]:
    """HF -> target at TP2 x PP2 -> HF: every weight and the logits bit-exact. Returns the writer's notes."""
    model = build(name)
    model.save_pretrained(tmp_path / "hf")
    notes = convert(tmp_path / "hf", tmp_path / "meg", target, tp=2, pp=2)
    convert(tmp_path / "meg", tmp_path / "back", "hf")
    back = getattr(transformers, spec(name)[1]).from_pretrained(tmp_path / "back").eval()
    theirs = model.state_dict()
    assert {k: bool(torch.equal(t, theirs[k])) for k, t in back.state_dict().items()} == {k: True for k in theirs}
    assert torch.equal(logits(back, back.config), logits(model, model.config))
    return notes


# under a second each: every family by default; a MoE family's legacy files are refused (tests/test_megatron_moe.py)
PAIRS = [(n, t) for n in MAPPED for t in ("megatron", "megatron-dist") if not (t == "megatron" and families()[ARCHITECTURES[n][0]].experts)]


@pytest.mark.parametrize(("name", "target"), PAIRS, ids=[f"{t}-{n}" for n, t in PAIRS])
def test_family_through_megatron_and_back_is_exact(tmp_path, name, target):
    notes = exact_back(tmp_path, name, target)
    beyond = families()[ARCHITECTURES[name][0]].beyond_megatron_lm
    assert any(beyond in n for n in notes) if beyond else not any("Megatron-Bridge" in n for n in notes)
    window = ARCHITECTURES[name][2].get("sliding_window")
    said = window is not None and not families()[ARCHITECTURES[name][0]].window  # (GPT-OSS's is written: --window-size)
    assert any(f"sliding_window {window}: not written as a Megatron argument" in n for n in notes) == said
    assert any("sliding_window" in n for n in notes) == said, notes  # none for a window not attended with


def test_family_arguments_are_megatron_lms(tmp_path):
    """The arguments a family sets: Qwen3's --qk-layernorm, Gemma's --apply-layernorm-1p and soft-capping under
    Megatron-Bridge's names, GPT-2's --openai-gelu, Phi-3's rotary percent; and the q/k norms' names."""
    expect = {
        "qwen3": {"qk_layernorm": True, "swiglu": True},
        "gemma2": {"apply_layernorm_1p": True, "swiglu": False, "attn_logit_softcapping": 50.0,
                   "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 256},
        "gemma3": {"apply_layernorm_1p": True, "qk_layernorm": True},
        "gpt2": {"openai_gelu": True, "swiglu": False, "normalization": "LayerNorm"},
        "phi3": {"rotary_percent": 1.0, "swiglu": True, "add_qkv_bias": False},
    }
    for name, wanted in expect.items():
        build(name).save_pretrained(tmp_path / name / "hf")
        convert(tmp_path / name / "hf", tmp_path / name / "meg", "megatron", tp=1, pp=1)
        state = load_megatron_file(str(tmp_path / name / "meg" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"))
        args = vars(state["args"])
        assert {k: args.get(k) for k in wanted} == wanted, name
        if "qk_layernorm" in wanted:
            assert "decoder.layers.0.self_attention.q_layernorm.weight" in state["model"]
            assert "decoder.layers.0.self_attention.k_layernorm.weight" in state["model"]


def test_megatron_core_builds_each_family_from_our_arguments_and_gives_transformers_logits(tmp_path):
    """One launch of 2 gloo processes at TP2: megatron-core's GPTModel with the local spec, configured from the
    arguments in our rank files, loads each model (every parameter, none left over) and its logits are
    transformers' on the source within fp32 rounding, its rotary frequencies transformers' (Llama 3.1's scaled)."""
    reference, dirs, frequencies = {}, [], {}
    for name in MCORE:
        model = build(name)
        model.save_pretrained(tmp_path / name / "hf")
        rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
        if rotary is not None and rotary.rope_type != "yarn":  # (megatron-core's YaRN keeps its frequencies in two halves)
            frequencies[str(tmp_path / name / "meg")] = rotary.inv_freq
        meg = tmp_path / name / "meg"
        convert(tmp_path / name / "hf", meg, "megatron", tp=2, pp=1, transformer_impl="local")
        ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
        torch.save(ids, meg / "ids.pt")
        with torch.no_grad():
            reference[str(meg)] = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / name / "hf").eval()(input_ids=ids).logits
        dirs.append(str(meg))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "mcore_family_worker.py"), *dirs]
    done = run_workers(cmd, worker_env(), timeout=900)
    results = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["checkpoint"] for r in results] == dirs
    for r in results:
        assert r["missing"] == [] and r["unexpected"] == [], r
        ours = torch.load(f"{r['checkpoint']}/mcore_logits.pt")
        torch.testing.assert_close(ours, reference[r["checkpoint"]], rtol=0, atol=1e-5, msg=lambda m, c=r["checkpoint"]: f"{c}: {m}")
        if r["checkpoint"] in frequencies:  # (Llama 3.x's scaling moves logits little over a few positions: its frequencies)
            torch.testing.assert_close(torch.load(f"{r['checkpoint']}/mcore_inv_freq.pt"), frequencies[r["checkpoint"]], rtol=1e-6, atol=0)


def test_llama3_rope_scaling_is_megatron_lms_flags(tmp_path):
    """Llama 3.x's rotary scaling as Megatron-LM's own Llama-3 import sets it (--use-rope-scaling
    --rope-scaling-factor; megatron-core's frequencies are transformers', test above): every weight and the logits
    back exactly, and the same rope_parameters. A factor other than the 8 Megatron-LM's GPT builder computes with
    (Llama 3.2's 32) is written with a note; fields megatron-core fixes, set otherwise, and scalings Megatron-LM's
    GPT model has no argument for are refused in one line."""
    notes = exact_back(tmp_path, "llama3", "megatron")
    assert not any("rope-scaling" in n for n in notes), notes
    args = vars(load_megatron_file(str(tmp_path / "meg" / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt"))["args"])
    assert (args["use_rope_scaling"], args["rope_scaling_factor"]) == (True, 8.0)
    model = build("llama3")
    assert json.loads((tmp_path / "back" / "config.json").read_text())["rope_parameters"] == model.config.rope_parameters
    model.config.rope_parameters = {**model.config.rope_parameters, "factor": 32.0}
    model.save_pretrained(tmp_path / "factor32")
    notes = convert(tmp_path / "factor32", tmp_path / "meg32", "megatron-dist", tp=1, pp=1)
    assert ("--rope-scaling-factor 32 written; Megatron-LM's GPT builder hands megatron-core's GPTModel only --use-rope-scaling "
            "(factor 8): a run must pass rope_scaling_factor=32 itself") in notes, notes
    config = build("llama3").config.to_dict()
    for change, message in ((dict(low_freq_factor=2.0), "llama with llama3 rope scaling: low_freq_factor 2.0; megatron-core's Llama 3.x "
                                                        "scaling computes with 1.0 (Megatron-LM has no argument for it)"),
                            (dict(rope_type="linear"), "rope scaling 'linear' has no Megatron equivalent this converter writes")):
        with pytest.raises(ConversionError, match=re.escape(message)):
            MegatronArch._asked_from_hf({**config, "rope_parameters": {**config["rope_parameters"], **change}})
    args = {**args, "hf_model_type": None}
    assert MegatronArch.from_args(args, "f").to_hf()["rope_parameters"] == model.config.rope_parameters | {"factor": 8.0}  # a run's own
    with pytest.raises(ConversionError, match=re.escape("model_optim_rng.pt: --rope-scaling-factor 'x' is not a non-negative number")):
        MegatronArch.from_args({**args, "rope_scaling_factor": "x"}, "model_optim_rng.pt")  # an untrusted run's: one line


def test_yarn_is_megatron_lms_yarn_flags(tmp_path):
    """Qwen's long-context YaRN as Megatron-LM's --position-embedding-type yarn and its fields (megatron-core's
    logits are transformers', test above): every weight and the logits back exactly. YaRN on part of each head
    (megatron-core's spans the whole head) and a run that sets Llama 3.x's scaling beside it are refused in one line."""
    exact_back(tmp_path, "qwen3_yarn", "megatron-dist")
    args = vars(load_megatron_file(str(tmp_path / "meg" / "iter_0000000" / "common.pt"))["args"])
    wanted = {"position_embedding_type": "yarn", "rotary_scaling_factor": 4.0, "yarn_original_max_position_embeddings": 32,
              "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0, "yarn_correction_range_round_to_int": False}
    assert {k: args.get(k) for k in wanted} == wanted
    config = build("qwen3_yarn").config.to_dict()
    with pytest.raises(ConversionError, match=re.escape("qwen3 with YaRN rotary scaling on 0.5 of each head: megatron-core's YaRN")):
        MegatronArch._asked_from_hf({**config, "rope_parameters": {**config["rope_parameters"], "partial_rotary_factor": 0.5}})
    with pytest.raises(ConversionError, match=re.escape("common.pt: --position-embedding-type yarn with --use-rope-scaling")):
        MegatronArch.from_args({**args, "use_rope_scaling": True}, "common.pt")


def test_a_family_without_a_map_is_refused_in_one_line(tmp_path):
    build("falcon").save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match=r"model_type 'falcon' has no Megatron name map \(families with one: .*qwen3"):
        convert(tmp_path / "hf", tmp_path / "meg", "megatron", tp=1, pp=1)
    assert not (tmp_path / "meg").exists()
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(tmp_path / "hf"), str(tmp_path / "meg"),
                           "--to", "megatron-dist"], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 2 and "has no Megatron name map" in done.stderr.strip().splitlines()[-1], done.stderr
    assert not (tmp_path / "meg").exists()


def test_an_activation_the_map_does_not_compute_is_refused(tmp_path):
    """A Llama config with GELU would come out of Megatron's SwiGLU as another model: refused."""
    name = "llama"
    config = transformers.AutoConfig.for_model("llama", architectures=["LlamaForCausalLM"], **{**ARCHITECTURES[name][2], "hidden_act": "gelu"})
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match="llama with activation 'gelu': its Megatron map computes silu only"):
        convert(tmp_path / "hf", tmp_path / "meg", "megatron", tp=1, pp=1)


def test_biases_megatron_cannot_express_are_refused_and_the_ones_it_can_are_exact(tmp_path):
    """Megatron's --add-bias-linear gives the attention output projection and the MLP their biases together: a Llama
    with attention_bias and mlp_bias converts exactly (o_proj's bias included); one with attention_bias alone is
    refused in one line (before, its o_proj bias was left out with a note, and the model's outputs changed)."""
    from tests import architectures

    both = dict(architectures.LLAMA, attention_bias=True, mlp_bias=True)
    architectures.ARCHITECTURES["llama-biased"] = ("llama", "LlamaForCausalLM", both)
    try:
        exact_back(tmp_path / "both", "llama-biased", "megatron")
        architectures.ARCHITECTURES["llama-biased"] = ("llama", "LlamaForCausalLM", dict(both, mlp_bias=False))
        build("llama-biased").save_pretrained(tmp_path / "attn" / "hf")
        with pytest.raises(ConversionError, match="llama: Megatron's --add-bias-linear gives the attention output projection "
                                                  "and the MLP biases together; this model has an output projection bias True "
                                                  "but MLP biases False"):
            convert(tmp_path / "attn" / "hf", tmp_path / "attn" / "meg", "megatron", tp=1, pp=1)
    finally:
        del architectures.ARCHITECTURES["llama-biased"]


def test_megatron_arguments_a_family_does_not_have_are_refused():
    """A Megatron-LM run's own checkpoint says its structure in flags: zero-centred norms (--apply-layernorm-1p) on a
    model the flags otherwise make Llama-like would be copied off by one; refused, naming the flag."""
    from converters.megatron_arch import MegatronArch

    args = MegatronArch.from_hf(build("llama").config.to_dict()).to_args(1, 1)
    args.pop("hf_model_type")
    assert MegatronArch.from_args(args, "args").model_type == "llama"
    with pytest.raises(ConversionError, match="args: the run used --apply-layernorm-1p, which a llama model does not have"):
        MegatronArch.from_args({**args, "apply_layernorm_1p": True}, "args")
    assert MegatronArch.from_args({**args, "qk_layernorm": True}, "args").model_type == "qwen3"


def test_sizes_come_from_the_arguments_even_where_they_equal_transformers_defaults():
    """The Hugging Face config of a Megatron checkpoint is the one its writer recorded with every size from the
    arguments, also a size that equals the config class's default (2048 positions for Llama)."""
    import dataclasses

    from converters.megatron import hf_config
    from converters.megatron_arch import MegatronArch

    config = build("llama").config.to_dict()
    arch = dataclasses.replace(MegatronArch.from_hf(config), max_positions=2048)
    assert hf_config(arch, {"hf_config": {**config, "max_position_embeddings": 128}})["max_position_embeddings"] == 2048
