"""A MoE checkpoint holds every expert of every layer exactly once, or nothing is written from it: the experts are
the model's as transformers declares them (its expert modules and expert-parallel plan), counted by `interop
inspect`, compared by `interop diff`, checked by `interop verify`, and every conversion refuses one that would
drop, duplicate or invent an expert, naming the layer and the expert."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from converters import registry
from converters.cli import main
from converters.models import experts
from converters.models.facts import in_module_names
from interop.errors import ConversionError
from interop.logical import OptimizerState
from interop.tensors import LazyTensor
from interop.universal import write_universal
from tests import architectures
from tests.conftest import ROOT, flip_byte, worker_env

LAYER = "model.layers.1.mlp.experts"


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def edited(tmp_path, name: str, edit) -> tuple:
    """``name`` saved by save_pretrained, and a copy whose safetensors file ``edit`` changed (a merger's bug)."""
    _, hf = architectures.saved(tmp_path, name)
    state = load_file(hf / "model.safetensors")
    edit(state)
    bad = tmp_path / name / "bad"
    bad.mkdir()
    (bad / "config.json").write_text((hf / "config.json").read_text())
    save_file(state, bad / "model.safetensors", metadata={"format": "pt"})
    return hf, bad


def drop(*keys):
    return lambda state: [state.pop(k) for k in keys]


def test_the_model_says_which_tensors_are_experts():
    """From transformers' expert modules: per-expert files (Qwen2-MoE), a dense first layer and a score bias that
    is not an expert tensor (DeepSeek-V3), experts stored fused with biases (GPT-OSS); none in a dense model."""
    def tensors(name):
        model_type, arch, overrides = architectures.ARCHITECTURES[name]
        import transformers

        return experts.expert_tensors(transformers.AutoConfig.for_model(model_type, architectures=[arch], **overrides).to_dict())

    assert sorted(tensors("qwen2_moe")) == [f"model.layers.{i}.mlp.experts.{t}" for i in (0, 1) for t in ("down_proj", "gate_up_proj")]
    deepseek = tensors("deepseek_v3")
    assert sorted(deepseek) == [f"{LAYER}.down_proj", f"{LAYER}.gate_up_proj"] and deepseek[f"{LAYER}.down_proj"].experts == 4
    assert sorted(tensors("gpt_oss"))[:4] == [f"model.layers.0.mlp.experts.{t}" for t in
                                               ("down_proj", "down_proj_bias", "gate_up_proj", "gate_up_proj_bias")]
    assert tensors("llama") == {}


def test_every_target_refuses_a_checkpoint_that_lacks_an_expert(tmp_path):
    """Expert 2 of layer 1 gone from the files: universal, hf and the engine targets all refuse before writing,
    naming the layer and the expert (universal used to write it, and from_pretrained then initialised it at random)."""
    hf, bad = edited(tmp_path, "qwen2_moe", drop(*(f"{LAYER}.2.{p}_proj.weight" for p in ("gate", "up", "down"))))
    _, ckpt = registry.read(str(bad))
    for target, extra in (("universal", {}), ("hf", {}), ("dcp", {}), ("deepspeed", {"world_size": 2}), ("accelerate", {"world_size": 1})):
        with pytest.raises(ConversionError, match=rf"{target}-out: not written: layer {LAYER}, expert 2 of 4: missing "
                                                  rf"\(no '{LAYER}.2.gate_proj.weight'\) \(and 2 more\)"):
            registry.writer(target).write(ckpt, str(tmp_path / f"{target}-out"), registry.Options(extra=extra))
        assert not (tmp_path / f"{target}-out").exists()
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(bad), str(tmp_path / "cli-out"), "--to", "universal"],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert f"layer {LAYER}, expert 2 of 4: missing" in done.stderr and not (tmp_path / "cli-out").exists()


@pytest.mark.parametrize(("edit", "message"), [
    (lambda s: s.__setitem__(f"{LAYER}.4.down_proj.weight", s[f"{LAYER}.3.down_proj.weight"].clone()),
     rf"layer {LAYER}, expert 4: beyond the model's 4 experts \({LAYER}.4.down_proj.weight\)"),
    (lambda s: s.__setitem__(f"{LAYER}.01.up_proj.weight", s[f"{LAYER}.1.up_proj.weight"].clone()),
     rf"layer {LAYER}, expert 1: stored 2 times \({LAYER}.01.up_proj.weight, {LAYER}.1.up_proj.weight\)"),
    (drop(f"{LAYER}.3.up_proj.weight"),  # the last expert, from one pattern: no other tensor says there were 4
     rf"layer {LAYER}, expert 3 of 4: missing \(no '{LAYER}.3.up_proj.weight'\)"),
], ids=["extra", "duplicate", "last-of-one-pattern"])
def test_an_extra_or_duplicated_expert_is_refused(tmp_path, edit, message):
    _, bad = edited(tmp_path, "qwen2_moe", edit)
    with pytest.raises(ConversionError, match=message):
        registry.writer("universal").write(registry.read(str(bad))[1], str(tmp_path / "out"), registry.Options())
    assert not (tmp_path / "out").exists()


def test_experts_whose_patterns_are_regular_expressions_are_counted_and_named_by_their_keys(tmp_path, capsys):
    """DeepSeek-V4's conversion patterns are written as regular expressions (``\\.experts.*.w1.weight``), as
    transformers compiles every pattern: its save_pretrained output was refused as lacking every expert, and a
    missing expert was named by the escaped pattern. Counted whole, and the missing one named by its key."""
    key = "model.layers.1.ffn.experts.2.w1.weight"
    hf, bad = edited(tmp_path, "deepseek_v4", drop(key))
    code, out, _ = run_cli(capsys, "inspect", hf, "--limit", "1")
    assert code == 0 and "experts:   4 experts in each of 2 MoE layers\n" in out and "  ! " not in out
    code, out, _ = run_cli(capsys, "inspect", bad, "--limit", "1")
    assert f"  ! layer model.layers.1.mlp.experts, expert 2 of 4: missing (no {key!r})" in out


def test_experts_stored_fused_are_counted_by_their_first_dimension(tmp_path):
    """GPT-OSS stores each layer's experts as one tensor: one that holds 3 of the model's 4 is refused."""
    _, bad = edited(tmp_path, "gpt_oss", lambda s: s.__setitem__(f"{LAYER}.down_proj", s[f"{LAYER}.down_proj"][:3].clone()))
    _, ckpt = registry.read(str(bad))
    assert experts.problems(ckpt) == [f"layer {LAYER}, expert 3 of 4: missing ({LAYER}.down_proj lacks it)"]
    with pytest.raises(ConversionError, match=rf"layer {LAYER}, expert 3 of 4: missing"):
        registry.writer("hf").write(ckpt, str(tmp_path / "out"), registry.Options())


def test_optimizer_state_of_an_expert_the_model_lacks_is_refused(tmp_path):
    """Moments are per expert too: state for expert 5 of a 4-expert layer (a merge that offset a rank's experts
    twice) is refused, naming the state; state missing for an expert is not (an engine keeping one parameter per
    expert has none for an expert that has had no tokens yet)."""
    _, hf = architectures.saved(tmp_path, "qwen2_moe")
    _, ckpt = registry.read(str(hf))
    moments = {n: LazyTensor.of(torch.zeros(t.spec.shape)) for n, t in ckpt.model.items() if ".experts.1." not in n}
    ckpt = dataclasses.replace(ckpt, optimizer=OptimizerState("AdamW", [{"params": list(ckpt.model), "lr": 0.1}], {"exp_avg": moments}, {}))
    assert experts.problems(ckpt) == []
    moments[f"{LAYER}.5.down_proj.weight"] = moments[f"{LAYER}.3.down_proj.weight"]
    assert experts.problems(ckpt) == [f"layer {LAYER}, expert 5: beyond the model's 4 experts (optimizer 'exp_avg') ({LAYER}.5.down_proj.weight)"]


def test_inspect_diff_and_verify_count_experts(tmp_path, capsys):
    hf, bad = edited(tmp_path, "mixtral", drop("model.layers.1.block_sparse_moe.experts.2.w1.weight"))
    code, out, _ = run_cli(capsys, "inspect", hf, "--limit", "1")
    assert code == 0 and "experts:   4 experts in each of 2 MoE layers\n" in out
    code, out, _ = run_cli(capsys, "inspect", bad, "--limit", "1")
    assert "experts:   model.layers.0.mlp.experts: 4 of 4; model.layers.1.mlp.experts: 3 of 4\n" in out
    assert f"  ! layer {LAYER}, expert 2 of 4: missing (no 'model.layers.1.block_sparse_moe.experts.2.w1.weight')" in out

    code, out, _ = run_cli(capsys, "diff", hf, bad)
    assert code == 1
    assert f"! experts: layer {LAYER}: 4 whole experts in A, 3 in B (expert 2 only in A)" in out
    assert f"! experts: B: layer {LAYER}, expert 2 of 4: missing" in out
    code, out, _ = run_cli(capsys, "diff", hf, hf)
    assert code == 0 and "experts" not in out

    # a universal checkpoint written without the check (by an older interop): its bytes match its manifest, but
    # verify counts the experts
    write_universal(registry.read(str(bad))[1], str(tmp_path / "uni"))
    code, out, _ = run_cli(capsys, "verify", tmp_path / "uni")
    assert code == 1 and f"layer {LAYER}, expert 2 of 4: missing" in out
    registry.writer("universal").write(registry.read(str(hf))[1], str(tmp_path / "good"), registry.Options())
    code, out, _ = run_cli(capsys, "verify", tmp_path / "good")
    assert code == 0, out


def test_fusing_into_an_engine_layout_checks_the_experts_again(tmp_path):
    """Below the writers' check, the fusion into the module's tensors refuses what cannot make them: an expert
    missing from one pattern, and the last expert gone from every pattern, each named with the shape the model's experts make."""
    _, hf = architectures.saved(tmp_path, "qwen2_moe")
    _, ckpt = registry.read(str(hf))
    model = {n: t for n, t in ckpt.model.items() if n != f"{LAYER}.3.up_proj.weight"}
    with pytest.raises(ConversionError, match=rf"{LAYER}.gate_up_proj: expert 3 has no 'mlp.experts.3.up_proj.weight' tensor"):
        in_module_names(dataclasses.replace(ckpt, model=model))
    model = {n: t for n, t in ckpt.model.items() if f"{LAYER}.3." not in n}
    with pytest.raises(ConversionError, match=r"experts.gate_up_proj: expert 3 has no 'mlp.experts.3.gate_proj.weight' tensor "
                                              r"\(the model's 4 experts make \[4, 40, 36\]\); the checkpoint is incomplete"):
        in_module_names(dataclasses.replace(ckpt, model=model))


def test_transformers_trainer_resumes_our_hf_trainer_output_with_every_expert(tmp_path):
    """transformers' own Trainer._load_from_checkpoint loads model.safetensors with load_state_dict(strict=False):
    files in save_pretrained's per-expert naming leave a Mixtral's fused experts as initialised, silently.
    `--to hf-trainer` writes the module's names, so the Trainer's own load restores every weight of it."""
    import transformers

    model, hf = architectures.saved(tmp_path, "mixtral")
    registry.writer("hf-trainer").write(registry.read(str(hf))[1], str(tmp_path / "out"), registry.Options())
    torch.manual_seed(99)
    fresh = transformers.MixtralForCausalLM(model.config)
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "scratch"), use_cpu=True, report_to=[])
    transformers.Trainer(model=fresh, args=args)._load_from_checkpoint(str(tmp_path / "out"))
    theirs = model.state_dict()
    assert all(torch.equal(t, theirs[k]) for k, t in fresh.state_dict().items())
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "out")  # and from_pretrained reads it
    assert all(torch.equal(t, theirs[k]) for k, t in back.state_dict().items())


@pytest.mark.parametrize("name", architectures.MOE)
def test_split_plans_place_each_expert_where_transformers_own_operations_put_it(name):
    """The kept split plans (where each stored expert tensor lies in its module tensor, traced from transformers'
    reversed converters on the meta device) give exactly what running those converters on the values gives, in
    both directions: module -> stored (an engine read) and stored -> module (an engine write). GPT-OSS stores its
    experts fused, so it has no plan."""
    from converters.models import facts, fusion
    from interop.logical import LogicalCheckpoint

    model = architectures.build(name)
    config = model.config.to_dict()
    state = {n: t.detach().clone() for n, t in model.state_dict().items()}
    plans = facts.split_plans(config)
    if name == "gpt_oss":  # stored fused, as the module holds them
        assert plans == {}
        return
    assert all(p.views is not None and all(v.contiguous for v in p.views) for p in plans.values())  # each expert one run of bytes
    key = facts._key(config)
    to_stored = facts._renamers(key)[1]
    by_ops = fusion.split(LogicalCheckpoint(model={n: LazyTensor.of(t) for n, t in state.items()}),
                          [facts._split_by_values(key, n, LazyTensor.of(state[n]).spec) for n in plans], model)
    by_views = facts.in_stored_names(LogicalCheckpoint(model={n: LazyTensor.of(t) for n, t in state.items()}, config=config))
    pieces = {v.stored for p in plans.values() for v in p.views}
    assert pieces and pieces <= set(by_views.model)
    for stored in pieces:
        assert torch.equal(by_views.model[stored].load(), by_ops.model[stored].load()), stored
    assert {to_stored(n) for n in state if n not in plans} | pieces == set(by_views.model)
    back = in_module_names(by_views)  # fused again by the plans' views
    for n in plans:
        assert torch.equal(back.model[n].load(), state[n]), n


def test_an_expert_in_an_engine_file_is_offered_as_its_byte_range(tmp_path):
    """An expert that is one run of its module tensor's bytes is offered as that range of the engine file
    (mapped pieces: the writer copies it file to file), and those bytes are the expert's."""
    from converters.models import facts
    from interop.logical import LogicalCheckpoint
    from interop.safetensors_io import SafetensorsFile

    model = architectures.build("mixtral")
    save_file({n: t.contiguous() for n, t in model.state_dict().items()}, tmp_path / "module.safetensors")
    f = SafetensorsFile(tmp_path / "module.safetensors")
    ckpt = facts.in_stored_names(LogicalCheckpoint(model={n: f.lazy(n) for n in model.state_dict()}, config=model.config.to_dict()))
    experts = [n for n in ckpt.model if ".experts." in n and n.endswith(".weight")]
    assert experts
    raw = (tmp_path / "module.safetensors").read_bytes()
    for name in experts:
        pieces = ckpt.model[name].mapped_pieces()
        assert pieces and all(p.source[0] == str(tmp_path / "module.safetensors") for p in pieces), name
        held = b"".join(raw[p.source[1]:p.source[1] + len(p.data)] for p in pieces)
        assert held == b"".join(bytes(p.data) for p in pieces) == ckpt.model[name].load().numpy().tobytes(), name


def test_experts_stored_as_one_renamed_tensor_are_counted(tmp_path, capsys):
    """Qwen3-VL-MoE stores each layer's experts as one tensor, renamed by a converter of its own (no ``*``: not
    one tensor per expert). They are counted along the dimension that is the module tensor's experts (found from
    the split plan), as fused tensors are, so a conversion writes the checkpoint; every expert used to be called
    missing and every target refused it."""
    import transformers

    if "qwen3_vl_moe" not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no qwen3_vl_moe")
    config = transformers.Qwen3VLMoeConfig(
        text_config=dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_attention_heads=4,
                         num_key_value_heads=2, num_hidden_layers=2, num_local_experts=4, num_experts_per_tok=2,
                         vocab_size=64, head_dim=8),
        vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=4, out_hidden_size=32,
                           deepstack_visual_indexes=[0]))
    torch.manual_seed(0)
    transformers.Qwen3VLMoeForConditionalGeneration(config).save_pretrained(tmp_path / "hf")
    _, ckpt = registry.read(str(tmp_path / "hf"))
    assert experts.problems(ckpt) == []
    assert experts.summary(ckpt) == "4 experts in each of 2 MoE layers"
    code, out, err = run_cli(capsys, "convert", tmp_path / "hf", tmp_path / "uni", "--to", "universal")
    assert code == 0, err
    code, out, err = run_cli(capsys, "diff", tmp_path / "hf", tmp_path / "uni")
    assert code == 0 and " 0 different" in out, out + err


def test_an_experts_stack_fused_for_an_engine_streams_from_each_stored_expert(tmp_path):
    """The other way: a module tensor that is its stored experts one after another (Mixtral's gate_up_proj, each
    expert's gate then up) is offered as those tensors in turn (``parts``), so a writer streams each expert's mapped
    bytes into an engine's file and a ZeRO partition slices through them: the bytes of the fused tensor, every one
    copied file to file, and each stored expert's digest checked."""
    from concurrent.futures import ThreadPoolExecutor

    from interop.errors import CorruptCheckpointError
    from interop.hashed_writes import Beside, tensor_bytes
    from interop.tensors import raw_bytes
    from tests.conftest import as_written

    _, hf = architectures.saved(tmp_path, "mixtral")
    uni = tmp_path / "universal"
    main(["convert", str(hf), str(uni), "--to", "universal"])  # a universal checkpoint: each stored expert's digest recorded
    module = in_module_names(registry.read(str(uni))[1])
    fused = {n: t for n, t in module.model.items() if n.startswith(LAYER.replace("experts", "")) and t.parts is not None}
    assert f"{LAYER}.gate_up_proj" in fused and f"{LAYER}.down_proj" in fused
    with Beside() as beside, ThreadPoolExecutor(1) as ahead:
        for name, t in fused.items():
            whole = t.load()
            chunks = as_written(tensor_bytes(t, beside, ahead))
            assert all(from_source for _, from_source in chunks), name
            assert b"".join(data for data, _ in chunks) == bytes(raw_bytes(whole)), name
            n = t.spec.numel
            cut = t.flat_slice(n // 3, n - 5)  # across experts, as a ZeRO rank's partition cuts it
            assert torch.equal(cut.load(), whole.reshape(-1)[n // 3 : n - 5]), name
            assert all(from_source for _, from_source in as_written(tensor_bytes(cut, beside, ahead))), name
    stored = next(iter(fused.values())).parts()[0]
    path, offset, _ = stored.mapped_pieces()[0].source
    flip_byte(path, offset + 3)  # one expert's byte changed: its digest, not the fused tensor's, refuses it
    again = in_module_names(registry.read(str(uni))[1]).model[next(iter(fused))]
    with pytest.raises(CorruptCheckpointError, match="differ from the digest"), Beside() as beside, ThreadPoolExecutor(1) as ahead:
        as_written(tensor_bytes(again, beside, ahead))
