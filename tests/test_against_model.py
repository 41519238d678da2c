"""A source whose tensors are not the model its config describes (a wrong-sized tensor, a missing one, an
optimizer moment not its parameter's shape) is refused by every writer before it writes, naming the tensor and
the file it was read from; inspect and verify report it. Before this, every target wrote it and exited 0,
leaving a directory ``from_pretrained`` refuses (a wrong size) or loads with a weight at random (a missing one),
or DeepSpeed partitions whose moments were shifted by the extra element. transformers' own model of the config
is the judge, asked per architecture, nothing hand-listed: a plain decoder, GPT-2's Conv1D, a MoE whose experts
are stored one tensor each (Mixtral), and one whose experts are stored stacked (GPT-OSS)."""

from __future__ import annotations

import json
import re

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from converters import registry
from converters.cli import main
from interop.logical import OptimizerState
from interop.tensors import LazyTensor
from interop.universal import write_universal

from .architectures import ARCHITECTURES, build, spec
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


def _with_adam(ckpt, cls: str = "AdamW", **moments):
    names = list(ckpt.model)
    state = {k: {n: LazyTensor.of(torch.full(ckpt.model[n].spec.shape, v)) for n in names} for k, v in (("exp_avg", 0.0), ("exp_avg_sq", 1.0))}
    for key, edit in moments.items():
        edit(state[key])
    ckpt.optimizer = OptimizerState(cls, [{"params": names, "lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}],
                                    state, {"step": {n: {"value": 3.0, "dtype": "float32"} for n in names}})
    return ckpt


MOMENT_EDITS = {  # (edit of exp_avg or exp_avg_sq, what the line names)
    "an element more": (dict(exp_avg=lambda s: s.__setitem__("model.norm.weight", LazyTensor.of(torch.zeros(37)))), ("exp_avg", "[37]", "[36]")),
    "a scalar": (dict(exp_avg=lambda s: s.__setitem__("model.norm.weight", LazyTensor.of(torch.tensor(0.5)))), ("exp_avg", "[]", "[36]")),
    "integers": (dict(exp_avg_sq=lambda s: s.__setitem__("model.norm.weight", LazyTensor.of(torch.ones(36, dtype=torch.int64)))),
                 ("exp_avg_sq", "int64")),
    "one moment missing": (dict(exp_avg=lambda s: s.pop("model.norm.weight")), ("exp_avg_sq but no exp_avg",)),
}


@pytest.mark.parametrize("target", ["deepspeed", "megatron-dist", "accelerate"])
@pytest.mark.parametrize("edit", sorted(MOMENT_EDITS))
def test_an_optimizer_moment_that_is_not_its_parameters_is_refused(sources, tmp_path, capsys, target, edit):
    """A universal checkpoint whose Adam moments of one parameter are not the parameter's: DeepSpeed's writer laid an
    element more into its flat partition (shifting every later moment), a missing one as zeros, a scalar crashed it;
    accelerate wrote files its own reader refuses or without the moment. Which state keys are moments is torch's
    answer (AdamW's, asked by a step)."""
    moments, needles = MOMENT_EDITS[edit]
    write_universal(_with_adam(registry.read(str(sources["llama"]))[1], **moments), str(tmp_path / "uni"))  # below the registry's check
    code, _, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", target)
    assert_one_line_error(code, err, "model.norm.weight", *needles, words=("not written",))
    assert not (tmp_path / "out").exists()


def test_state_torch_keeps_in_other_shapes_is_not_judged(sources):
    """Adafactor's row and column variances are not its parameter's shape (torch's own step says so): not refused."""
    from converters.models.against_model import problems

    ckpt = registry.read(str(sources["llama"]))[1]
    names = [n for n, t in ckpt.model.items() if len(t.spec.shape) == 2]
    ckpt.optimizer = OptimizerState("Adafactor", [{"params": names, "lr": 1e-2}], {
        "row_var": {n: LazyTensor.of(torch.ones(ckpt.model[n].spec.shape[0], 1)) for n in names},
        "col_var": {n: LazyTensor.of(torch.ones(1, ckpt.model[n].spec.shape[1])) for n in names}}, {})
    assert problems(ckpt) == []
    assert problems(_with_adam(ckpt, exp_avg=lambda s: s.__setitem__(names[0], LazyTensor.of(torch.zeros(3))))) != []


# --- what transformers itself does without is not required; what a checkpoint claims does not vouch -------------
SEQ2SEQ = dict(d_model=24, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=32,
               decoder_ffn_dim=32, vocab_size=131, max_position_embeddings=64, pad_token_id=1, bos_token_id=0, eos_token_id=2,
               decoder_start_token_id=2)


@pytest.mark.parametrize(("model_type", "architecture", "dropped"), [
    ("marian", "MarianMTModel", None),  # save_pretrained leaves out its sinusoidal positions (_keys_to_ignore_on_save)
    ("bart", "BartForConditionalGeneration", "final_logits_bias"),  # _keys_to_ignore_on_load_missing: zeros when absent
])
def test_keys_transformers_does_without_are_not_required(tmp_path, capsys, model_type, architecture, dropped):
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **SEQ2SEQ)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config).eval()
    model.save_pretrained(tmp_path / "src")
    if dropped:
        _damaged(tmp_path / "src", tmp_path / "bad", lambda t: t.pop(dropped))
    src = tmp_path / ("bad" if dropped else "src")
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert code == 0, out + err
    back, info = getattr(transformers, architecture).from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(back.state_dict()[name], tensor), name


def test_a_config_naming_no_architecture_does_not_require_the_guessed_head(tmp_path, capsys):
    """A bare model's files whose config names no architecture: transformers' first guess (a causal LM) has a head
    the files never held; AutoModel.from_pretrained loads them whole, and so does the output."""
    model = transformers.LlamaModel(transformers.LlamaConfig(**{k: v for k, v in ARCHITECTURES["llama"][2].items()}))
    model.save_pretrained(tmp_path / "src")
    config = json.loads((tmp_path / "src" / "config.json").read_text())
    config.pop("architectures")
    (tmp_path / "src" / "config.json").write_text(json.dumps(config))
    code, out, err = run_cli(capsys, "convert", tmp_path / "src", tmp_path / "out", "--to", "hf")
    assert code == 0, out + err
    back, info = transformers.AutoModel.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and torch.equal(back.norm.weight, model.norm.weight)
    capsys.readouterr()  # (from_pretrained's progress)
    _damaged(tmp_path / "src", tmp_path / "bad", lambda t: t.pop("norm.weight"))  # the base model's own tensors still are
    code, _, err = run_cli(capsys, "convert", tmp_path / "bad", tmp_path / "out2", "--to", "hf")
    assert_one_line_error(code, err, "model.norm.weight", words=("missing", "transformers builds"))


def test_a_tie_the_config_does_not_make_holds_nothing(sources, tmp_path, capsys):
    """A universal checkpoint claiming its lm_head tied to the embeddings, of an untied model: the claim does not
    stand in for the missing head (from_pretrained would have initialised it at random)."""
    ckpt = registry.read(str(sources["llama"]))[1]
    del ckpt.model["lm_head.weight"]
    ckpt.tied = [["lm_head.weight", "model.embed_tokens.weight"]]
    write_universal(ckpt, str(tmp_path / "uni"))
    code, _, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", "hf")
    assert_one_line_error(code, err, "lm_head.weight", words=("missing",))


def test_an_integer_tensor_where_the_model_has_a_floating_one_is_refused(sources, tmp_path, capsys):
    src = tmp_path / "src"
    _damaged(sources["llama"], src, lambda t: t.__setitem__("model.norm.weight", torch.ones(36, dtype=torch.int64)))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert_one_line_error(code, err, "model.norm.weight", "int64", str(src / "model.safetensors"), words=("floating",))


def test_a_target_without_optimizer_state_takes_the_model_of_a_checkpoint_whose_moments_are_damaged(sources, tmp_path, capsys):
    """--to hf keeps no optimizer state: the weights are fine and are written (the left-out state said in a note);
    inspect names the damaged moment."""
    moments, _ = MOMENT_EDITS["an element more"]
    write_universal(_with_adam(registry.read(str(sources["llama"]))[1], **moments), str(tmp_path / "uni"))
    code, out, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", "hf")
    assert code == 0 and "note: hf has no place for: optimizer state" in out, out + err
    code, out, _ = run_cli(capsys, "inspect", tmp_path / "uni", "--limit", "1")
    assert code == 0 and "  ! optimizer state exp_avg of model.norm.weight is float32[37]" in out


@pytest.mark.parametrize("target", ["deepspeed", "megatron-dist", "megatron"])
def test_a_factored_optimizers_state_is_refused_by_targets_that_lay_state_out_as_the_parameter(sources, tmp_path, capsys, target):
    """Adafactor's row and column variances have no place in DeepSpeed's flat partitions or Megatron's per-parameter
    layout (each crashed with an unexpected ValueError): one line naming the state, and the targets that keep it."""
    ckpt = registry.read(str(sources["llama"]))[1]
    names = [n for n, t in ckpt.model.items() if len(t.spec.shape) == 2]
    ckpt.optimizer = OptimizerState("Adafactor", [{"params": list(ckpt.model), "lr": 1e-2}], {
        "row_var": {n: LazyTensor.of(torch.ones(ckpt.model[n].spec.shape[0], 1)) for n in names},
        "col_var": {n: LazyTensor.of(torch.ones(1, ckpt.model[n].spec.shape[1])) for n in names}}, {})
    write_universal(ckpt, str(tmp_path / "uni"))
    code, _, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", target)
    assert_one_line_error(code, err, "col_var", words=("factored", "not written"))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("step", [-5.0, 1e30, 2.5])
def test_a_step_no_run_took_is_refused_before_anything_is_written(sources, tmp_path, capsys, step):
    """An optimizer step of -5 was written and then refused by its own manifest, leaving the output in place, and
    1e30 was recorded as a step: refused before writing."""
    ckpt = _with_adam(registry.read(str(sources["llama"]))[1])
    ckpt.optimizer.scalars["step"]["model.norm.weight"] = {"value": step, "dtype": "float32"}
    write_universal(ckpt, str(tmp_path / "uni"))
    code, _, err = run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", "deepspeed")
    assert_one_line_error(code, err, "model.norm.weight", words=("not a number of steps",))
    assert not (tmp_path / "out").exists()


def test_a_nan_step_in_an_engine_file_is_refused_before_anything_is_written(sources, tmp_path, capsys):
    """accelerate's optimizer.bin with a NaN step (as a damaged save leaves it): the universal writer crashed on it
    (an unexpected ValueError: JSON has no NaN)."""
    registry.writer("accelerate").write(_with_adam(registry.read(str(sources["llama"]))[1]), str(tmp_path / "acc"),
                                        registry.Options(extra={"world_size": 1}))
    for manifest in (tmp_path / "acc").rglob("manifest.json"):
        manifest.unlink()  # as accelerate's own save_state leaves it
    state = torch.load(tmp_path / "acc" / "optimizer.bin", weights_only=False)
    state["state"][3]["step"] = torch.tensor(float("nan"))
    torch.save(state, tmp_path / "acc" / "optimizer.bin")
    code, _, err = run_cli(capsys, "convert", tmp_path / "acc", tmp_path / "out", "--to", "universal", "--config", sources["llama"])
    assert_one_line_error(code, err, "nan", words=("not a number of steps",))
    assert not (tmp_path / "out").exists()


def test_each_parameters_state_is_judged_by_its_own_groups_hyperparameters(sources):
    """RMSprop with momentum in one group only (a review's case, refused before: the last group's momentum was
    asked of every parameter): the other group's parameters keep no momentum_buffer, and are not refused for it;
    a parameter of the momentum group without one is."""
    from converters.models.against_model import problems

    ckpt = registry.read(str(sources["llama"]))[1]
    names = list(ckpt.model)
    plain, moving = names[: len(names) // 2], names[len(names) // 2:]
    shaped = lambda v, ns: {n: LazyTensor.of(torch.full(ckpt.model[n].spec.shape, v)) for n in ns}  # noqa: E731
    groups = [{"params": plain, "lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.0, "centered": False},
              {"params": moving, "lr": 1e-2, "alpha": 0.99, "eps": 1e-8, "weight_decay": 0.0, "momentum": 0.9, "centered": False}]
    ckpt.optimizer = OptimizerState("RMSprop", groups, {"square_avg": shaped(1.0, names), "momentum_buffer": shaped(0.1, moving)}, {})
    assert problems(ckpt) == []
    ckpt.optimizer.tensors["momentum_buffer"].pop(moving[0])
    assert problems(ckpt) == [f"optimizer state of {moving[0]}: square_avg but no momentum_buffer"]


# --- a hub release's multi-token-prediction layers: transformers' MtpModel is the judge -----------------------
@pytest.fixture(scope="module")
def mtp_sources(tmp_path_factory):
    """DeepSeek-V3 and GLM-4.5, each config counting one MTP layer, stored as the hub releases store it
    (``model.layers.<num_hidden_layers>``; save_pretrained writes none)."""
    from .architectures import with_mtp

    root = tmp_path_factory.mktemp("mtp")
    out = {}
    for name in ("deepseek_v3", "glm4_moe"):
        model_type, cls, kwargs = spec(name)
        model = getattr(transformers, cls)(transformers.AutoConfig.for_model(model_type, **{**kwargs, "num_nextn_predict_layers": 1}))
        model.save_pretrained(root / name)
        with_mtp(model, root / name)
        out[name] = (root / name, model.config.num_hidden_layers)
    return out


MTP_EDITS = {  # (edit of the stored tensors given the MTP layer's number, what the line says)
    "its projection grown": (lambda t, n: _grown(t, f"model.layers.{n}.eh_proj.weight"),
                             ("model.layers.{n}.eh_proj.weight is [36, 73]", "transformers' MtpModel of the", "[36, 72]")),
    "a norm missing": (lambda t, n: t.pop(f"model.layers.{n}.enorm.weight"),
                       ("model.layers.{n} (transformers' MtpModel's layers.0.enorm.weight): missing", "MtpModel")),
    "an expert of another size": (lambda t, n: _grown(t, f"model.layers.{n}.mlp.experts.1.down_proj.weight"),
                                  ("model.layers.{n}.mlp.experts.1.down_proj.weight is [36, 21]", "has [36, 20]")),
    "an integer norm": (lambda t, n: t.__setitem__(f"model.layers.{n}.hnorm.weight", t[f"model.layers.{n}.hnorm.weight"].long()),
                        ("model.layers.{n}.hnorm.weight is int64", "floating-point")),
    # a review's cases: a copy of the embedding (MtpModel uses the model's own, so its loading ignored the copy),
    # a norm transformers renames (named as stored), most experts wrong (the odd ones are those not the module's)
    "its embedding copy grown": (lambda t, n: _grown(t, f"model.layers.{n}.embed_tokens.weight"),
                                 ("model.layers.{n}.embed_tokens.weight is [131, 37]", "has [131, 36]")),
    "its head's norm missing": (lambda t, n: t.pop(f"model.layers.{n}.shared_head.norm.weight"),
                                ("model.layers.{n} (transformers' MtpModel's layers.0.post_norm.weight): missing",)),
    "its head's norm grown": (lambda t, n: _grown(t, f"model.layers.{n}.shared_head.norm.weight"), ("model.layers.{n}.shared_head.norm.weight is [37]",)),
    "three experts of four grown": (lambda t, n: [_grown(t, f"model.layers.{n}.mlp.experts.{e}.down_proj.weight") for e in range(3)],
                                    ("model.layers.{n}.mlp.experts.0.down_proj.weight is [36, 21]", "has [36, 20]", "(and 2 more)")),
    "an expert's gate grown": (lambda t, n: _grown(t, f"model.layers.{n}.mlp.experts.1.gate_proj.weight"),
                               ("model.layers.{n}.mlp.experts.1.gate_proj.weight is [20, 37]", "has [20, 36]")),
}


@pytest.mark.parametrize(("arch", "target"), [("deepseek_v3", "hf"), ("deepseek_v3", "universal"), ("glm4_moe", "universal")])
@pytest.mark.parametrize("edit", sorted(MTP_EDITS))
def test_a_multi_token_prediction_layer_transformers_would_not_load_is_refused(mtp_sources, tmp_path, capsys, edit, arch, target):
    """The MTP layer is no part of the model's own module, so the check against it passed every tensor there: a
    grown projection, a missing norm, an expert of another size or an integer norm went to every target with exit 0,
    and MtpModel.from_pretrained then refused it, initialised the norm at random or cast it. Now transformers' own
    MTP loading, run on meta tensors of the stored shapes, is the judge (the expert named as its fellows' odd one)."""
    src, n = mtp_sources[arch]
    change, needles = MTP_EDITS[edit]
    _damaged(src, tmp_path / "src", lambda t: change(t, n))
    code, _, err = run_cli(capsys, "convert", tmp_path / "src", tmp_path / "out", "--to", target)
    assert_one_line_error(code, err, *(s.format(n=n) for s in needles), words=("not written",))
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe"])
def test_an_mtp_layer_transformers_loads_converts_exactly(mtp_sources, tmp_path, arch):
    from .architectures import mtp_logits, mtp_model

    src, _ = mtp_sources[arch]
    assert main(["convert", str(src), str(tmp_path / "out"), "--to", "hf"]) == 0
    assert torch.equal(mtp_logits(*mtp_model(tmp_path / "out")), mtp_logits(*mtp_model(src)))


def test_a_manifest_its_reader_would_refuse_is_never_published(sources, tmp_path):
    """Below every writer's own checks (write_universal called directly, a checkpoint step of -1): the manifest is
    validated as its reader validates it before it is written, so the save stops before it commits and nothing is
    published (before, the output was published, then refused by every reader of it)."""
    from interop.errors import OutputWriteError

    ckpt = registry.read(str(sources["llama"]))[1]
    ckpt.step = -1
    with pytest.raises(OutputWriteError, match=re.escape(f"{tmp_path / 'out' / 'uni'}: not written: its manifest would be refused by its "
                                                          "own reader: step is -1, not a non-negative integer")):
        write_universal(ckpt, str(tmp_path / "out" / "uni"))
    assert not (tmp_path / "out").exists() or list((tmp_path / "out").iterdir()) == []
