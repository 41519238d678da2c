"""What transformers says about a model, kept on disk per transformers version and config: every answer a
conversion takes from the kept file is the one transformers gives, a damaged file is asked again, and a
conversion that finds its answers kept never imports transformers (seconds of every conversion's start-up)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from converters.models import facts
from converters.models.kept import kept_path
from tests.architectures import ROOT, build, saved


def config_of(name: str) -> dict:
    return build(name).config.to_dict()


def forget() -> None:
    """This process's memory of every answer (the disk's stays)."""
    for cached in (facts._answers, facts._built, facts._renamers, facts._live_renamers, facts._live_converters):
        cached.cache_clear()


def questions(config: dict, own_only: bool = False) -> dict:
    """Every question conversions ask, answered by whichever source is in use. ``own_only``: about the model's own
    keys only (a bare model's keys and keys the model lacks are not kept: those are always asked of transformers)."""
    f = facts.model_facts(config)
    key = facts._key(config)
    renamed = {n: facts._renamers(key)[1](n) for n in f.names}  # save_pretrained's names (an engine reader's question)
    files = list(dict.fromkeys(renamed.values()))  # a Hugging Face file's keys
    out = {"facts": f, "tied": facts.tied_groups(config), "renamed": renamed, "stored": facts.stored_names(config, files),
           "module": facts.module_names(config, files), "experts": facts.expert_parameters(config),
           "layout": facts.parameter_layout(config),
           "fuses": bool(facts._converters(key))}
    if not own_only:
        bare = [n.removeprefix(f"{f.prefix}.") for n in f.names]  # an old file's keys, and keys no model has
        out["others"] = facts.stored_names(config, [*bare, *f.names, "not.a.key"])
    return out


def no_transformers(*_, **__):
    raise AssertionError("transformers was asked")


@pytest.mark.parametrize("name", ["llama-tied", "gpt2", "t5", "llava", "mixtral", "gpt_oss"])
def test_kept_answers_are_transformers_answers(tmp_path, monkeypatch, name):
    config = config_of(name)
    monkeypatch.setenv(facts.CACHE_ENV, "off")
    forget()
    asked = questions(config)
    monkeypatch.setenv(facts.CACHE_ENV, str(tmp_path))
    forget()
    assert questions(config) == asked  # asked again, and kept
    assert len(list((tmp_path / "model-facts").iterdir())) == 1
    forget()
    assert questions(config) == asked  # from the kept file, falling back to transformers for the rest
    forget()
    if not asked["fuses"]:  # a dense model's own keys: never asked of transformers
        monkeypatch.setattr(facts, "_build", no_transformers)
        own = {k: v for k, v in asked.items() if k != "others"}
        assert questions(config, own_only=True) == own


@pytest.mark.parametrize("damage", ["not json", '{"schema": 1}', "tied", "names", "another model's"])
def test_a_damaged_kept_file_is_asked_again(tmp_path, monkeypatch, damage):
    config = config_of("gpt2")
    monkeypatch.setenv(facts.CACHE_ENV, str(tmp_path))
    forget()
    asked = questions(config)
    (path,) = (tmp_path / "model-facts").iterdir()
    raw = json.loads(path.read_text())
    other = kept_path("model", facts._SCHEMA, facts._key(config_of("llama-tied")))[1]  # a file copied from another model's
    text = {"tied": json.dumps(dict(raw, tied=[["lm_head.weight"]])), "names": json.dumps(dict(raw, names=[1, 2])),
            "another model's": json.dumps(dict(raw, identity=other))}.get(damage, damage)
    path.write_text(text)
    forget()
    assert questions(config) == asked
    assert json.loads(path.read_text()) == raw  # rewritten


def test_a_kept_split_plan_that_does_not_tile_its_tensor_is_asked_again(tmp_path, monkeypatch):
    """A kept split plan is checked before it is used: two experts placed at one offset (one left out) would
    fuse a tensor with a hole and split one expert twice, so the file is asked again and rewritten."""
    config = config_of("mixtral")
    monkeypatch.setenv(facts.CACHE_ENV, str(tmp_path))
    forget()
    plans = facts.split_plans(config)
    assert plans and all(p.views for p in plans.values())
    (path,) = (tmp_path / "model-facts").iterdir()
    raw = json.loads(path.read_text())
    damaged = json.loads(path.read_text())
    views = next(iter(damaged["splits"].values()))["views"]
    views[1][3] = views[0][3]
    path.write_text(json.dumps(damaged))
    forget()
    assert facts.split_plans(config) == plans
    assert json.loads(path.read_text()) == raw


def test_a_stored_tensor_of_several_module_tensors_leaves_the_model_known():
    """hrm_text stores q, k, v and a gate as one tensor (transformers chunks it into four module tensors): its
    reversed converter joins four module tensors, which is no split into views. The model is still known (its
    renaming and tied weights), and its plan says transformers' operations must run (views None)."""
    import transformers

    if "hrm_text" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no hrm_text")
    config = transformers.AutoConfig.for_model("hrm_text", hidden_size=32, intermediate_size=64, num_attention_heads=4,
                                               num_key_value_heads=4, vocab_size=64).to_dict()
    forget()
    assert facts.model_facts(config).cls == "HrmTextForCausalLM"
    plans = facts.split_plans(config)
    joined = [n for n, p in plans.items() if p.patterns == ("attn.gqkv_proj.weight",)]
    assert joined and all(plans[n].views is None for n in joined)


def imports_transformers(tmp_path, conversions: list) -> list[str]:
    """Each conversion (source, output under ``tmp_path``, target, its flags...) in a process of its own, answers
    kept under ``tmp_path``: whether it imported transformers, as the line it printed last."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), **{facts.CACHE_ENV: str(tmp_path / "kept")})
    probe = ("import sys; from converters import cli; rc = cli.main(sys.argv[1:]); "
             "print('transformers imported' if 'transformers' in sys.modules else 'transformers not imported'); sys.exit(rc)")
    seen = []
    for source, out, target, *flags in conversions:
        done = subprocess.run([sys.executable, "-c", probe, "convert", str(source), str(tmp_path / out), "--to", target, *flags],
                              env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip().splitlines()[-1])
    return seen


@pytest.mark.slow  # the same probe on a MoE model, engine files included: the test below
def test_a_conversion_with_its_answers_kept_does_not_import_transformers(tmp_path):
    """A Hugging Face directory to universal, twice, and back: only the first conversion of the model asks
    transformers; the others find its answers kept."""
    _, src = saved(tmp_path, "llama-tied")
    seen = imports_transformers(tmp_path, [(src, "uni", "universal"), (src, "uni-again", "universal"), (tmp_path / "uni", "hf", "hf")])
    assert seen == ["transformers imported", "transformers not imported", "transformers not imported"]


def test_a_moe_conversion_with_its_answers_kept_does_not_import_transformers(tmp_path):
    """A Mixtral's experts fused into the module's tensors for an engine and split back into per-expert tensors
    for Hugging Face by the split plans kept with the answers: after the model's first conversion neither
    direction imports transformers (its conversion code and the model's module cost seconds), and the round trip
    gives the source's tensors exactly."""
    from safetensors.torch import load_file

    _, src = saved(tmp_path, "mixtral")
    seen = imports_transformers(tmp_path, [(src, "uni", "universal"), (src, "acc", "accelerate", "--world-size", "1"),
                                           (tmp_path / "acc", "hf", "hf")])
    assert seen == ["transformers imported", "transformers not imported", "transformers not imported"]
    (engine,) = (tmp_path / "acc").glob("**/model.safetensors")
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in load_file(engine))  # fused for the engine
    theirs, ours = load_file(src / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_a_megatron_checkpoints_config_is_asked_once(tmp_path, monkeypatch, name):
    """The config.json transformers builds from a Megatron checkpoint's sizes is kept too (every Megatron conversion
    needs it, and importing transformers for it cost seconds): asked once, then read, the same; a damaged kept
    file is asked again."""
    from converters.megatron_arch import MegatronArch

    arch = MegatronArch.from_hf(config_of(name))
    monkeypatch.setenv(facts.CACHE_ENV, "off")
    asked = arch.to_hf()
    monkeypatch.setenv(facts.CACHE_ENV, str(tmp_path))
    calls = []
    real = MegatronArch._asked_hf
    monkeypatch.setattr(MegatronArch, "_asked_hf", lambda self: calls.append(1) or real(self))
    answers = [arch.to_hf(), arch.to_hf()]
    (path,) = (tmp_path / "model-facts").iterdir()
    path.write_text('{"config": 3}')
    answers.append(arch.to_hf())
    assert answers == [asked] * 3 and len(calls) == 2  # asked, read, asked again


@pytest.mark.parametrize("name", ["llama", "mixtral"])
def test_a_megatron_targets_shape_is_asked_once(tmp_path, monkeypatch, name):
    """The other way: the Megatron shape of a Hugging Face config (every --to megatron needs it; transformers'
    config class reads the sizes) is kept: asked once, then read, the same; a damaged kept file is asked again."""
    from converters.megatron_arch import MegatronArch

    config = config_of(name)
    monkeypatch.setenv(facts.CACHE_ENV, "off")
    asked = MegatronArch.from_hf(config)
    monkeypatch.setenv(facts.CACHE_ENV, str(tmp_path))
    calls = []
    real = MegatronArch._asked_from_hf
    monkeypatch.setattr(MegatronArch, "_asked_from_hf", classmethod(lambda cls, c: calls.append(1) or real(c)))
    answers = [MegatronArch.from_hf(config), MegatronArch.from_hf(config)]
    (path,) = [p for p in (tmp_path / "model-facts").iterdir() if '"arch"' in p.read_text()]
    path.write_text('{"arch": {"family": "llama"}}')
    answers.append(MegatronArch.from_hf(config))
    assert answers == [asked] * 3 and len(calls) == 2  # asked, read, asked again
