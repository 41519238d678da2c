"""A source whose tensors are not the model its config describes (a wrong-sized tensor, a missing one, an
optimizer moment not its parameter's shape) is refused by every writer before it writes, naming the tensor and
the file it was read from; inspect and verify report it. Before this, every target wrote it and exited 0,
leaving a directory ``from_pretrained`` refuses (a wrong size) or loads with a weight at random (a missing one),
or DeepSpeed partitions whose moments were shifted by the extra element. transformers' own model of the config
is the judge, asked per architecture, nothing hand-listed: a plain decoder, GPT-2's Conv1D, a MoE whose experts
are stored one tensor each (Mixtral), and one whose experts are stored stacked (GPT-OSS)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import registry
from converters.cli import main
from interop.logical import OptimizerState
from interop.tensors import LazyTensor
from interop.universal import write_universal

from .architectures import build
from .test_adversarial import assert_one_line_error, run_cli

# per architecture: a tensor grown by one element along its last dimension, a parameter taken out
CASES = {
    "llama": ("model.layers.1.post_attention_layernorm.weight", "model.norm.weight"),
    "gpt2": ("transformer.h.1.attn.c_attn.weight", "transformer.h.0.mlp.c_proj.bias"),
    "mixtral": ("model.layers.1.block_sparse_moe.experts.2.w2.weight", "model.layers.0.block_sparse_moe.experts.3.w1.weight"),
    "gpt_oss": ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.self_attn.sinks"),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("against_model")
    out = {}
    for name in CASES:
        build(name).save_pretrained(root / name)
        out[name] = root / name
    return out


def _damaged(src, dst, edit) -> None:
    """A copy of HF directory ``src`` whose model.safetensors ``edit`` changed."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    tensors = load_file(src / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})


def _grown(tensors: dict, name: str) -> None:
    """One more element along the last dimension (a stack of experts keeps its count: an expert more or less is
    the experts' check's, tests/test_moe.py)."""
    t = tensors[name]
    tensors[name] = torch.cat([t, t[..., :1]], dim=-1)


@pytest.mark.parametrize("target", ["hf", "universal", "megatron-dist"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_tensor_of_another_size_is_refused_naming_its_file(sources, tmp_path, capsys, arch, target):
    name = CASES[arch][0]
    src = tmp_path / "src"
    _damaged(sources[arch], src, lambda t: _grown(t, name))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", target)
    assert_one_line_error(code, err, str(src / "model.safetensors"), name, words=("not written", "describes"))
    assert not (tmp_path / "out").exists()
    code, out, _ = run_cli(capsys, "inspect", src, "--limit", "1")  # read, not refused: inspect says what is wrong
    assert code == 0 and f"  ! {name} is " in out


@pytest.mark.parametrize("target", ["hf", "universal"])
@pytest.mark.parametrize("arch", sorted(CASES))
def test_a_missing_parameter_is_refused(sources, tmp_path, capsys, arch, target):
    """hf and universal wrote it without a word (the engine targets refused, each in its own words):
    from_pretrained would have initialised it at random."""
    name = CASES[arch][1]
    src = tmp_path / "src"
    _damaged(sources[arch], src, lambda t: t.pop(name))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", target)
    words = ("missing",) if arch in ("mixtral",) else ("missing", "random")  # an expert's in the experts' own words
    assert_one_line_error(code, err, name, words=words)
    assert not (tmp_path / "out").exists()


def test_tied_weights_are_not_missing(tmp_path, capsys):
    """A tied model's output embedding is its input embedding: stored once, as save_pretrained stores it."""
    model = build("llama-tied")
    model.save_pretrained(tmp_path / "src")
    assert "lm_head.weight" not in load_file(tmp_path / "src" / "model.safetensors")
    code, _, err = run_cli(capsys, "convert", tmp_path / "src", tmp_path / "out", "--to", "hf")
    assert code == 0, err


def test_a_well_formed_universal_checkpoint_of_another_size_is_refused(sources, tmp_path, capsys):
    """A universal checkpoint whose manifest, digests and safetensors header all agree on a wrong size (written
    by a tool that does not check, or on purpose): the size is still the model's to judge."""
    ckpt = registry.read(str(sources["llama"]))[1]
    name = CASES["llama"][0]
    ckpt.model[name] = LazyTensor.of(torch.ones(37))
    write_universal(ckpt, str(tmp_path / "uni"))  # the format's own writer, below the registry's check
    code, out, err = run_cli(capsys, "verify", tmp_path / "uni")  # every byte is what its manifest says; the sizes are not the model's
    assert code == 1 and f"  - {name} is [37]" in out, out + err
    code, _, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", "hf")
    assert_one_line_error(code, err, name, "[37]", "[36]")
    assert not (tmp_path / "out").exists()


def test_a_config_of_another_model_is_refused(sources, tmp_path, capsys):
    """--config naming a model of another width: every tensor disagrees; the first is named, the count said."""
    config = json.loads((sources["llama"] / "config.json").read_text())
    config["hidden_size"] = 48
    (tmp_path / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "convert", sources["llama"], tmp_path / "out", "--to", "hf", "--config", tmp_path / "config.json")
    assert_one_line_error(code, err, "lm_head.weight", "[131, 36]", "[131, 48]", "more tensor(s)", words=("another model",))
    assert not (tmp_path / "out").exists()


def test_an_untouched_source_converts(sources, tmp_path):
    for arch, src in sources.items():
        assert main(["convert", str(src), str(tmp_path / arch), "--to", "universal"]) == 0


def test_a_megatron_checkpoint_with_a_norm_of_another_size_is_refused(sources, tmp_path, capsys):
    """The Megatron readers check each linear against the run's arguments; a norm or an embedding is held against
    transformers' model like every source's tensors, named by Megatron's key in its rank file."""
    assert main(["convert", str(sources["llama"]), str(tmp_path / "meg"), "--to", "megatron"]) == 0
    (tmp_path / "meg" / "iter_0000000" / "manifest.json").unlink()  # a Megatron-LM run's own save has none
    rank_file = tmp_path / "meg" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"
    saved = torch.load(rank_file, weights_only=False)  # our own file: Megatron's argparse.Namespace inside
    norm = saved["model"]["decoder.final_layernorm.weight"]
    saved["model"]["decoder.final_layernorm.weight"] = torch.cat([norm, norm[:1]])
    torch.save(saved, rank_file)
    capsys.readouterr()
    code, _, err = run_cli(capsys, "convert", tmp_path / "meg", tmp_path / "out", "--to", "hf")
    assert_one_line_error(code, err, str(rank_file), "decoder.final_layernorm.weight", "model.norm.weight", "[37]", "[36]")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target", ["deepspeed", "megatron-dist", "accelerate"])
def test_an_optimizer_moment_of_another_shape_is_refused(sources, tmp_path, capsys, target):
    """A universal checkpoint whose exp_avg of one parameter has an element more: DeepSpeed's writer laid it into
    its flat partition (shifting every later moment), accelerate wrote a file its own reader refuses."""
    ckpt = registry.read(str(sources["llama"]))[1]
    names = list(ckpt.model)
    moments = {n: LazyTensor.of(torch.zeros(ckpt.model[n].spec.shape)) for n in names}
    moments["model.norm.weight"] = LazyTensor.of(torch.zeros(37))
    ckpt.optimizer = OptimizerState("AdamW", [{"params": names, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}],
                                    {"exp_avg": moments, "exp_avg_sq": {n: LazyTensor.of(torch.ones(ckpt.model[n].spec.shape)) for n in names}},
                                    {"step": {n: {"value": 3.0, "dtype": "float32"} for n in names}})
    write_universal(ckpt, str(tmp_path / "uni"))  # the format's own writer, below the registry's check
    code, _, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", target)
    assert_one_line_error(code, err, "model.norm.weight", "[37]", "[36]", words=("not written", "exp_avg"))
    assert not (tmp_path / "out").exists()
