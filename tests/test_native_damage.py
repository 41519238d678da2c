"""Engine-native checkpoints damaged where the files' own sizes could not tell (a helper's adversarial pass, engine
sources with their manifests removed, as the engine's own save leaves them): each converted with exit 0 into a
model whose tensors were shifted or mixed from two saves. Now one line naming the rank file.

DeepSpeed: a rank's ZeRO-3 sub-group or ZeRO-1/2 partition longer than its parameters need (only rank 0's was
checked: the rest shifted the next group's pieces), a rank of another step, a sub-group in two param groups, a rank
in another dtype. Megatron: a rank file of another iteration, one lacking a tensor (an unexpected KeyError), one whose
copy of a replicated parameter (a norm) is of another dtype; one whose copy holds other values is said in a note."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from converters import registry
from converters.cli import main

from .architectures import build
from .test_adversarial import assert_one_line_error, run_cli
from .test_against_model import _with_adam


@pytest.fixture(scope="module")
def natives(tmp_path_factory):
    """A llama with Adam state in DeepSpeed ZeRO-3 and ZeRO-1 (2 ranks) and Megatron legacy (TP 2), and its weights
    alone in Megatron legacy (TP 2), manifests removed."""
    root = tmp_path_factory.mktemp("natives")
    build("llama").save_pretrained(root / "hf")
    ckpt = _with_adam(registry.read(str(root / "hf"))[1])
    plain = registry.read(str(root / "hf"))[1]  # weights only, as a conversion script's output
    for name, target, extra, source in (("zero3", "deepspeed", {"world_size": 2, "zero_stage": 3}, ckpt),
                                        ("zero1", "deepspeed", {"world_size": 2, "zero_stage": 1}, ckpt), ("tp2", "megatron", {"tp": 2}, ckpt),
                                        ("tp2-weights", "megatron", {"tp": 2}, plain)):
        registry.writer(target).write(source, str(root / name), registry.Options(extra=extra))
        for manifest in (root / name).rglob("manifest.json"):
            manifest.unlink()
    return root


def _edited(natives, tmp_path, name: str, rel: str, edit):
    import shutil

    shutil.copytree(natives / name, tmp_path / name)
    path = tmp_path / name / rel
    state = torch.load(path, weights_only=False)  # our own file
    edit(state)
    torch.save(state, path)
    return tmp_path / name, path


ZERO3 = "global_step0/zero_pp_rank_1_mp_rank_00_%s_states.pt"


def _flat3(edit):
    return lambda s: s["optimizer_state_dict"]["fp32_flat_groups"].__setitem__(0, edit(s["optimizer_state_dict"]["fp32_flat_groups"][0]))


CASES = {  # (checkpoint, rank file, edit, words of the line)
    "zero3 rank longer": ("zero3", ZERO3 % "optim", _flat3(lambda t: torch.cat([t, torch.zeros(100)])), ("sub-group 0", "need")),
    "zero3 rank in bf16": ("zero3", ZERO3 % "optim", _flat3(lambda t: t.bfloat16()), ("bfloat16", "rank 0's")),
    "zero3 rank of another step": ("zero3", ZERO3 % "model", lambda s: s.update(global_steps=100, global_samples=800), ("different saves",)),
    "zero3 sub-group in two param groups": ("zero3", "global_step0/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                            lambda s: s["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"].append(
                                                dict(s["optimizer_state_dict"]["optimizer_state_dict"]["param_groups"][0])),
                                            ("both list sub-group 0",)),
    "zero1 rank longer": ("zero1", "global_step0/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                          lambda s: s["optimizer_state_dict"]["single_partition_of_fp32_groups"].__setitem__(
                              0, torch.cat([s["optimizer_state_dict"]["single_partition_of_fp32_groups"][0], torch.zeros(8)])),
                          ("partitions", "not equal")),
    "megatron rank of another iteration": ("tp2", "iter_0000000/mp_rank_01/model_optim_rng.pt", lambda s: s.update(iteration=500),
                                           ("different saves",)),
    "megatron rank lacking a tensor": ("tp2-weights", "iter_0000000/mp_rank_01/model_optim_rng.pt",  # was an unexpected KeyError
                                       lambda s: s["model"].pop("decoder.layers.1.mlp.linear_fc2.weight"), ("lacks", "TP rank 0")),
    "megatron replicated norm of another dtype on a TP rank": (
        "tp2", "iter_0000000/mp_rank_01/model_optim_rng.pt",
        lambda s: s["model"].__setitem__("decoder.layers.0.mlp.linear_fc1.layer_norm_weight",
                                         s["model"]["decoder.layers.0.mlp.linear_fc1.layer_norm_weight"].double()),
        ("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", "a rank file of another model")),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_damaged_rank_is_refused_naming_its_file(natives, tmp_path, capsys, case):
    name, rel, edit, words = CASES[case]
    src, path = _edited(natives, tmp_path, name, rel, edit)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal", "--config", natives / "hf")
    assert_one_line_error(code, err, str(path), words=words)
    assert not (tmp_path / "out").exists()


def test_the_untouched_natives_convert(natives, tmp_path):
    for name in ("zero3", "zero1", "tp2", "tp2-weights"):
        assert main(["convert", str(natives / name), str(tmp_path / name), "--to", "universal", "--config", str(natives / "hf")]) == 0


def test_a_replicated_norm_differing_between_tp_ranks_is_said_and_rank_0s_kept(natives, tmp_path, capsys):
    """TP rank 1's copy of the final norm holds other values: TP rank 0's was taken without a word. Real runs' copies
    drift apart slightly (Megatron-LM's issues: norms under sequence parallelism), so it converts, keeping rank 0's
    as Megatron's own tools do, and a note says which tensor of which rank file differs and by how many elements."""
    rel = "iter_0000000/mp_rank_01/model_optim_rng.pt"
    src, path = _edited(natives, tmp_path, "tp2-weights", rel, lambda s: s["model"]["decoder.final_layernorm.weight"][:5].add_(0.5))
    code, out, _ = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf", "--config", natives / "hf")
    assert code == 0
    assert (f"note: 1 replicated tensor(s) differ between tensor-parallel ranks, TP rank 0's copies kept (as Megatron's own tools keep "
            f"them); the most: 5 of 36 elements of decoder.final_layernorm.weight in {path}") in out, out
    rank0 = torch.load(natives / "tp2-weights" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt", weights_only=False)
    assert torch.equal(load_file(tmp_path / "out" / "model.safetensors")["model.norm.weight"], rank0["model"]["decoder.final_layernorm.weight"])
