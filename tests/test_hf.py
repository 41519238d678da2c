"""Hugging Face import/export: real save_pretrained in, real from_pretrained out, exact weights and logits."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from converters.models.facts import model_facts, tied_groups
from converters.hf import read_hf, write_hf
from interop.universal import read_universal, write_universal
from trainers.base import tiny_config

CASES = [("llama", False), ("llama", True), ("gpt2", True), ("gpt2", False)]


def make(kind, tied):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(tiny_config(kind, tied)).eval()


def logits(model):
    ids = torch.arange(40).reshape(2, 20) % 256
    with torch.no_grad():
        return model(input_ids=ids).logits


def load(path):
    model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert info["missing_keys"] == set() or not info["missing_keys"], info
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


@pytest.mark.parametrize("kind,tied", CASES, ids=[f"{k}-{'tied' if t else 'untied'}" for k, t in CASES])
def test_round_trip_through_universal_is_exact(tmp_path, kind, tied):
    model = make(kind, tied)
    model.save_pretrained(tmp_path / "src", max_shard_size="40KB")  # sharded, with an index
    assert (tmp_path / "src" / "model.safetensors.index.json").exists()
    ckpt = read_hf(str(tmp_path / "src"))
    assert ckpt.tied == ([["lm_head.weight", "model.embed_tokens.weight" if kind == "llama" else "transformer.wte.weight"]] if tied else [])
    write_universal(ckpt, str(tmp_path / "uni"))
    write_hf(read_universal(str(tmp_path / "uni")), str(tmp_path / "out"))
    out = load(tmp_path / "out")
    assert torch.equal(logits(out), logits(model))
    ref = model.state_dict()
    got = out.state_dict()
    assert set(got) == set(ref)
    for name in ref:
        assert torch.equal(got[name], ref[name]), name
    if tied:
        assert out.lm_head.weight.data_ptr() == out.get_input_embeddings().weight.data_ptr()
        names = set(json.load(open(tmp_path / "uni" / "manifest.json"))["tensors"])
        assert "lm_head.weight" not in names  # stored once, as save_pretrained does
    else:
        assert not torch.equal(out.lm_head.weight, out.get_input_embeddings().weight)


def test_llama_grouped_query_attention_shapes_survive(tmp_path):
    model = make("llama", False)
    model.save_pretrained(tmp_path / "src")
    ckpt = read_hf(str(tmp_path / "src"))
    assert ckpt.model["model.layers.0.self_attn.k_proj.weight"].spec.shape == (24, 48)  # 2 KV heads x 12
    assert ckpt.model["model.layers.0.self_attn.q_proj.weight"].spec.shape == (48, 48)


def test_pytorch_model_bin_and_pre_prefix_gpt2_names_are_read(tmp_path):
    model = make("gpt2", True)
    src = tmp_path / "legacy"
    src.mkdir()
    model.config.to_json_file(src / "config.json")
    state = {}
    for name, t in model.state_dict().items():
        if name == "lm_head.weight":
            continue
        state[name.removeprefix("transformer.")] = t.clone()
    state["h.0.attn.bias"] = torch.tril(torch.ones(1, 1, 8, 8))  # the causal-mask buffer old files carry
    torch.save(state, src / "pytorch_model.bin")
    ckpt = read_hf(str(src))
    assert "transformer.h.0.attn.c_attn.weight" in ckpt.model
    assert not any(k.endswith(".attn.bias") for k in ckpt.model)  # the mask buffer is dropped
    write_hf(ckpt, str(tmp_path / "out"))
    assert torch.equal(logits(load(tmp_path / "out")), logits(model))


def test_model_facts_come_from_transformers():
    """Ties and the base-model prefix as the model transformers builds for the config declares
    them: GPT-2's head is tied to wte unless the config says otherwise."""
    config = make("gpt2", True).config.to_dict()
    assert tied_groups(config) == [["lm_head.weight", "transformer.wte.weight"]]
    assert tied_groups(make("gpt2", False).config.to_dict()) == []
    facts = model_facts(config)
    assert facts.prefix == "transformer" and facts.cls == "GPT2LMHeadModel" and "attn.bias" in facts.ignore_unexpected


def test_bf16_model_keeps_its_dtype(tmp_path):
    model = make("llama", True).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "src")
    write_universal(read_hf(str(tmp_path / "src")), str(tmp_path / "uni"))
    write_hf(read_universal(str(tmp_path / "uni")), str(tmp_path / "out"))
    out = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert out.dtype == torch.bfloat16
    for name, t in model.state_dict().items():
        assert torch.equal(out.state_dict()[name], t), name


def test_tied_weights_are_compared_by_their_recorded_digests_else_by_their_bytes_and_refused_when_they_differ():
    """A tied target is left out once shown equal to its source. Where the manifest records both digests (a universal
    checkpoint) they are compared as recorded and neither tensor is read (the one written is checked as it is
    written); without them (an HF source) their bytes are hashed. Different values are refused either way."""
    import dataclasses

    from interop import digests
    from interop.errors import ConversionError
    from interop.logical import LogicalCheckpoint
    from interop.tensors import LazyTensor, raw_bytes
    from interop.universal import model_entries

    def unread():
        raise AssertionError("a tied pair with recorded digests was read")

    def recorded(t):
        return dataclasses.replace(LazyTensor.of(t), loader=unread, mapped_pieces=None, digest=digests.of_bytes(raw_bytes(t)))

    a, b, tied = torch.randn(8, 4), torch.randn(8, 4), [["lm_head.weight", "model.embed_tokens.weight"]]
    for kind in (recorded, LazyTensor.of):
        same = LogicalCheckpoint(model={"model.embed_tokens.weight": kind(a), "lm_head.weight": kind(a.clone())}, tied=tied)
        assert list(model_entries(same)) == ["model.embed_tokens.weight"], kind
        differ = LogicalCheckpoint(model={"model.embed_tokens.weight": kind(a), "lm_head.weight": kind(b)}, tied=tied)
        with pytest.raises(ConversionError, match="lm_head.weight and model.embed_tokens.weight are declared tied but hold different values"):
            model_entries(differ)
