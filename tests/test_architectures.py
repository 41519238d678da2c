"""Any Hugging Face architecture, with what the converters need to know about it asked of transformers (tests/
architectures.py builds the tiny models): Hugging Face -> universal -> Hugging Face keeps every weight and the
logits; DeepSpeed's own engine.load_checkpoint, pointed at `--to deepspeed` output on 2 processes, loads each
model (tied heads recorded as DeepSpeed records them, renamed keys in the module's names, MoE experts fused into the
module's tensors by transformers' own conversion operations) with every weight and the logits equal to
from_pretrained's; accelerate (DDP and FSDP2) and torch DCP likewise."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import transformers

from converters import registry
from interop.errors import ConversionError
from tests import architectures
from tests.architectures import ARCHITECTURES, FSDP2_CANNOT_RUN, dcp_load, engine_load, logits, problem
from tests.conftest import ROOT, worker_env

ENGINE = list(ARCHITECTURES)
# the default run: a tied head of another family (Gemma), an encoder-decoder with three ties (T5), a key
# transformers renames (GPT-NeoX's embed_out), per-expert files fused into one module tensor (DeepSeek-V3: MLA, a
# dense first layer, a shared expert, the router's score-correction bias buffer), a model whose conversion patterns
# are regular expressions and one of whose renamings from_pretrained does not apply (DeepSeek-V4); every model under -m slow
DEFAULT_ENGINE = ["gemma", "t5", "gpt_neox", "deepseek_v3", "deepseek_v4"]


def saved(tmp_path, name: str):
    return architectures.saved(tmp_path, name)


@pytest.mark.parametrize(("name", "via"), [(n, v) for v in ("universal", "hf-trainer") for n in ARCHITECTURES])
def test_hf_through_universal_and_back_is_exact(tmp_path, name, via):
    """Through universal, and through a Trainer checkpoint (its optimizer.pt numbers the module's parameters, so
    every architecture's module names are asked of transformers), back to a model from_pretrained loads."""
    model, hf = saved(tmp_path, name)
    options = registry.Options()
    _, ckpt = registry.read(str(hf), options)
    registry.writer(via).write(ckpt, str(tmp_path / "uni"), options)
    _, uni = registry.read(str(tmp_path / "uni"), options)
    registry.writer("hf").write(uni, str(tmp_path / "back"), options)
    back = getattr(transformers, ARCHITECTURES[name][1]).from_pretrained(tmp_path / "back").eval()
    theirs = model.state_dict()
    assert back.state_dict().keys() == theirs.keys()
    for key, t in back.state_dict().items():
        assert torch.equal(t, theirs[key]), key
    assert torch.equal(logits(back, back.config), logits(model, model.config))


def check_loaded(results: list[dict], names: list[str]) -> None:
    assert len(results) == len(names), results
    for name, r in zip(names, results):
        assert problem(r) is None, (name, r)  # (DeepSpeed returns None and trains on from random weights if it finds none)


def test_deepspeed_loads_each_architecture(tmp_path):
    """Real DeepSpeed (ZeRO-2, 2 processes) loads our output of each model exactly; a tied head is in `module` and
    in `shared_params`, as DeepSpeed's own save_checkpoint records it (without it: "Missing key(s): lm_head.weight")."""
    check_loaded(engine_load(tmp_path, DEFAULT_ENGINE, "deepspeed", 2), DEFAULT_ENGINE)
    states = torch.load(tmp_path / "gemma" / "deepspeed2" / "global_step0" / "mp_rank_00_model_states.pt", weights_only=False)
    assert states["shared_params"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert "lm_head.weight" in states["module"]
    t5 = torch.load(tmp_path / "t5" / "deepspeed2" / "global_step0" / "mp_rank_00_model_states.pt", weights_only=False)
    assert t5["shared_params"] == {k: "shared.weight" for k in ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight")}


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_loads_every_architecture(tmp_path, stage):
    check_loaded(engine_load(tmp_path, ENGINE, "deepspeed", stage), ENGINE)


@pytest.mark.slow  # the names and ties are DeepSpeed's above (one code path); accelerate's own loader of a Llama runs by default
def test_accelerate_load_state_loads_every_architecture(tmp_path):
    """A plain accelerate script (DDP, 2 processes) load_state()s our `--to accelerate` output of each model: every
    weight and the logits are from_pretrained's."""
    check_loaded(engine_load(tmp_path, ENGINE, "accelerate"), ENGINE)


def test_dcp_load_gives_each_architecture(tmp_path):
    """What a torch user does with `--to dcp`: dcp.load({"model": model.state_dict()}) into the model built from the
    config with other weights, then load_state_dict: every weight and the logits are from_pretrained's (module
    names, ties, the multimodal model's nested names)."""
    for name in ENGINE:
        assert problem(dcp_load(tmp_path, name)) is None, name


def test_accelerate_fsdp2_loads_each_architecture(tmp_path):
    """accelerate's FSDP2 plugin (SHARDED_STATE_DICT, 2 processes) load_state()s our `--to accelerate --fsdp` output:
    a tied head of another family (Gemma), a renamed key (GPT-NeoX), a multimodal model (LLaVA), fused experts (Mixtral)."""
    names = ["gemma", "gpt_neox", "llava", "mixtral"]
    check_loaded(engine_load(tmp_path, names, "fsdp2"), names)


@pytest.mark.slow
def test_accelerate_fsdp2_loads_every_architecture_it_can_run(tmp_path):
    """Every architecture; T5's and BERT's ties span modules accelerate's FSDP2 wraps apart, which FSDP2's first
    forward refuses with or without a checkpoint (the engine's limit, named in docs/architectures.md)."""
    results = engine_load(tmp_path, ENGINE, "fsdp2")
    check_loaded([r for n, r in zip(ENGINE, results) if n not in FSDP2_CANNOT_RUN], [n for n in ENGINE if n not in FSDP2_CANNOT_RUN])
    for name, r in zip(ENGINE, results):
        if name in FSDP2_CANNOT_RUN:
            assert "is shared with a parameter already managed by another FSDP group" in r["engine_error"], (name, r)


def test_moe_expert_optimizer_state_is_split_per_expert_and_fused_back_exactly(tmp_path):
    """A real accelerate save_state of Mixtral after one AdamW step holds the module's fused expert tensors
    (experts.gate_up_proj: every expert's w1 and w3 stacked) and their moments. Read, it is universal's per-expert
    tensors in the file naming, each with its own slice of the moments; written back, accelerate's own load_state
    restores the weights and the optimizer state exactly."""
    from accelerate import Accelerator

    from trainers.base import param_groups

    def prepared(seed: int):
        torch.manual_seed(seed)
        model = architectures.build("mixtral").train()
        acc = Accelerator(cpu=True)
        return acc, *acc.prepare(model, torch.optim.AdamW(param_groups(model, 0.01), lr=1e-2))

    acc, model, optimizer = prepared(0)
    ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    acc.save_state(str(tmp_path / "acc"))
    _, ckpt = registry.read(str(tmp_path / "acc"), registry.Options(config=model.config.to_dict()))
    name = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    fused = dict(model.named_parameters())["model.layers.1.mlp.experts.gate_up_proj"]
    ffn = model.config.intermediate_size
    assert torch.equal(ckpt.model[name].load(), fused.detach()[2, ffn:])
    assert torch.equal(ckpt.optimizer.tensors["exp_avg"][name].load(), optimizer.state[fused]["exp_avg"][2, ffn:])
    assert not any("gate_up_proj" in n for n in ckpt.names())
    registry.writer("accelerate").write(ckpt, str(tmp_path / "back"), registry.Options(extra={"world_size": 1}))
    acc2, model2, optimizer2 = prepared(1)
    acc2.load_state(str(tmp_path / "back"))
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values()))
    for p, p2 in zip(model.parameters(), model2.parameters()):
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(optimizer.state[p][key], optimizer2.state[p2][key]), key


def test_an_engine_checkpoint_with_another_number_of_experts_is_refused(tmp_path):
    """Reading an engine's fused expert tensor back into per-expert tensors: one whose shape is not the model's
    (3 experts where the config has 4) is refused, naming it, instead of splitting into 3 experts."""
    from converters.models.facts import in_stored_names
    from interop.logical import LogicalCheckpoint
    from interop.tensors import LazyTensor

    model = architectures.build("mixtral")
    state = {n: LazyTensor.of(t) for n, t in model.state_dict().items()}
    state["model.layers.0.mlp.experts.down_proj"] = LazyTensor.of(model.state_dict()["model.layers.0.mlp.experts.down_proj"][:3])
    with pytest.raises(ConversionError, match=r"model.layers.0.mlp.experts.down_proj: \[3, 36, 52\] in the checkpoint, but "
                                              r"the model's fused tensor is \[4, 36, 52\]: experts are missing or extra"):
        in_stored_names(LogicalCheckpoint(model=state, config=model.config.to_dict()))


def test_a_model_transformers_cannot_build_is_refused_by_engine_targets(tmp_path):
    """A config.json of a model type the installed transformers does not know: the engine targets, which need the
    model's parameters, refuse with one line naming it; universal keeps the tensors as stored, with a note."""
    _, hf = saved(tmp_path, "llama")
    config = json.loads((hf / "config.json").read_text())
    config.update(model_type="not-a-model", architectures=["NotAModelForCausalLM"])
    (hf / "config.json").write_text(json.dumps(config))
    cli = [sys.executable, "-m", "converters.cli", "convert", str(hf)]
    done = subprocess.run(cli + [str(tmp_path / "ds"), "--to", "deepspeed", "--world-size", "1"], capture_output=True, text=True,
                          env=worker_env(), cwd=ROOT)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "has no model type 'not-a-model'" in done.stderr and not (tmp_path / "ds").exists()
    done = subprocess.run(cli + [str(tmp_path / "uni"), "--to", "universal"], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert "note: transformers" in done.stdout and "no tied weights known" in done.stdout


@pytest.mark.parametrize("engine", ["deepspeed", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_a_parameter_built_frozen_is_trained_as_from_pretrained_leaves_it_with_a_note(tmp_path, engine):
    """Ernie 4.5 MoE's modules build e_score_correction_bias frozen and from_pretrained makes it trainable: the
    engine files (positional: ZeRO's flat groups, optimizer.bin) train it, as a model loaded by from_pretrained
    does, and a note says so and what a model built from its config needs (requires_grad_, which the engine's
    load here does first); DeepSpeed's and accelerate's own loads then give every weight and the logits."""
    from interop.manifest import read_manifest

    name = "ernie4_5_moe"
    frozen = "model.layers.1.mlp.gate.moe_statics.e_score_correction_bias"
    stage = 2 if engine == "deepspeed" else 0
    results = engine_load(tmp_path, [name], engine, stage)
    check_loaded(results, [name])
    out = tmp_path / name / f"{engine}{stage}"
    at = next(p.parent for p in out.rglob("manifest.json"))
    assert [n for n in read_manifest(str(at)).notes if n.startswith(f"optimizer: {frozen} trained, as after from_pretrained")] == [
        f"optimizer: {frozen} trained, as after from_pretrained (which makes every loaded weight trainable), though the model's "
        "modules build them frozen: a model built from its config needs requires_grad_(True) on them before loading these files"]


@pytest.mark.parametrize("engine", ["deepspeed", pytest.param("accelerate", marks=pytest.mark.slow)])
def test_a_hub_releases_mtp_layer_is_kept_and_engines_load_the_module_without_it(tmp_path, engine):
    """A hub DeepSeek-V3 keeps its multi-token-prediction layer as model.layers.61 (after its 61 decoder layers), a
    key from_pretrained ignores but transformers' MtpModel loads: universal keeps it (it was dropped as an old
    buffer would be), and a Megatron target writes it. An engine's files hold the module's state dict, which its
    own loader loads strictly: the layer is left out there, with a note naming it, and DeepSpeed's (or accelerate's)
    own load then gives every weight and the logits (with it written, the load failed: unexpected keys)."""
    from interop.manifest import read_manifest

    config = transformers.DeepseekV3Config(**{**ARCHITECTURES["deepseek_v3"][2], "num_hidden_layers": 61, "first_k_dense_replace": 60})
    hub = transformers.DeepseekV3ForCausalLM(config)
    hub.save_pretrained(tmp_path / "hub")
    added = architectures.with_mtp(hub, tmp_path / "hub")
    assert min(added) == "model.layers.61.eh_proj.weight"
    _, ckpt = registry.read(str(tmp_path / "hub"))
    assert set(added) <= set(ckpt.model)
    registry.writer("universal").write(ckpt, str(tmp_path / "u"), registry.Options())
    assert set(added) <= set(json.loads((tmp_path / "u" / "manifest.json").read_text())["tensors"])
    registry.writer("megatron-dist").write(registry.read(str(tmp_path / "u"))[1], str(tmp_path / "meg"), registry.Options())
    from converters.megatron import load_megatron_file

    assert vars(load_megatron_file(str(tmp_path / "meg" / "iter_0000000" / "common.pt"))["args"])["mtp_num_layers"] == 1
    model, hf = architectures.saved(tmp_path, "deepseek_v3")
    added = architectures.with_mtp(model, hf)
    stage = 2 if engine == "deepspeed" else 0
    check_loaded(engine_load(tmp_path, ["deepseek_v3"], engine, stage), ["deepseek_v3"])
    out = tmp_path / "deepseek_v3" / f"{engine}{stage}"
    notes = read_manifest(str(next(p.parent for p in out.rglob("manifest.json")))).notes
    # under the module's names: the layer's 12 expert tensors are its 2 fused ones there
    assert (f"the DeepseekV3ForCausalLM module has no place for {len(added) - 10} tensor(s) of the source in layers past its own (its "
            f"engine loads the module's state strictly), not written: {sorted(added)[:5]} ...") in notes, notes
