"""Expert parallelism in the Megatron-style trainer on real gloo process groups: a tiny Mixtral's experts split
over ``--ep`` ranks (transformers' own expert-parallel plan, tokens sent to their experts' ranks by all-to-all),
composed with data and tensor parallelism, matching a single-process run; its checkpoint says which ranks hold
which experts, reads as one tensor per expert, and resumes at another EP size and in another trainer."""

from __future__ import annotations

import json
import types

import pytest
import torch

from converters.models.facts import in_module_names
from converters.registry import read
from interop.errors import ConfigurationError
from trainers.base import BaseTrainer, TrainerConfig
from trainers.megatron import MegatronTrainer, MegatronTrainerConfig

from .test_megatron_trainer import RUN, SIZES, megatron_run

pytestmark = pytest.mark.dist
MOE = ["--model", "mixtral"]
LAYOUTS = {  # name: (processes, flags, (dp, tp, ep))
    "ep2": (2, ["--ep", "2"], (2, 1, 2)),
    "tp2xep2": (4, ["--tp", "2", "--ep", "2"], (2, 2, 2)),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process base trainer on the Mixtral (the reference), and the Megatron-style trainer with its
    experts over 2 ranks, alone (DP2 = EP2) and beside TP2 (4 processes)."""
    out = tmp_path_factory.mktemp("ep")
    base = BaseTrainer(TrainerConfig(**SIZES, model="mixtral", save_every=2, output_dir=str(out / "base")))
    found = {"base": (out / "base", base.train())}
    for name, (nproc, flags, _) in LAYOUTS.items():
        summary, _ = megatron_run(nproc, *RUN, *MOE, *flags, "--output-dir", str(out / name))
        found[name] = (out / name, summary["losses"])
    return found


def module_tensors(path) -> dict[str, torch.Tensor]:
    """Weights and optimizer state under the model's module names, whatever the checkpoint's format."""
    return {k: t.load() for k, t in in_module_names(read(str(path))[1]).tensors()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_run_matches_single_process(runs, layout):
    """Same losses as one process to float rounding; the manifest records the ep size, the expert tensors and
    the ep groups (which ranks hold which experts), and the DCP component is shared within an edp group."""
    directory, losses = runs[layout]
    assert losses == pytest.approx(runs["base"][1], rel=1e-5)
    nproc, _, (dp, tp, ep) = LAYOUTS[layout]
    manifest = json.loads((directory / "checkpoint-4" / "manifest.json").read_text())
    sharding = manifest["sharding"]
    assert (sharding["dp"], sharding["tp"], sharding["ep"]) == (dp, tp, ep)
    assert sorted(sharding["expert_tensors"]) == [f"model.layers.{i}.mlp.experts.{t}" for i in (0, 1) for t in ("down_proj", "gate_up_proj")]
    groups = {k: sorted(map(tuple, v)) for k, v in manifest["topology"]["groups"].items()}
    # the mesh is (pp, edp, ep, tp), tp fastest: ep groups join ranks of the same tp rank
    assert groups["ep"] == ([(0, 1)] if layout == "ep2" else [(0, 2), (1, 3)])
    assert groups["edp"] == [(r,) for r in range(nproc)]
    assert manifest["components"]["dcp"]["group"] == "edp"


def test_checkpoint_holds_every_expert_once(runs):
    """Read back, the EP2 checkpoint is the single-process state (weights and Adam moments of every expert, to
    float rounding), and its universal form has one tensor per expert."""
    expected = module_tensors(runs["base"][0] / "checkpoint-2")
    for layout in LAYOUTS:
        found = module_tensors(runs[layout][0] / "checkpoint-2")
        assert sorted(found) == sorted(expected)
        for name, t in expected.items():
            torch.testing.assert_close(found[name], t, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{layout} {n}: {m}")
    _, ckpt = read(str(runs["ep2"][0] / "checkpoint-2"))
    stored = set(ckpt.model)
    assert stored == set(read(str(runs["base"][0] / "checkpoint-2"))[1].model)  # both read under the files' names
    assert {f"model.layers.{i}.block_sparse_moe.experts.{e}.{w}.weight" for i in (0, 1) for e in range(4) for w in ("w1", "w2", "w3")} <= stored
    assert set(ckpt.optimizer.tensors["exp_avg"]) == stored


def test_resume_ep2_on_one_process(runs, tmp_path):
    """EP2 -> one process (no expert parallelism): the step-2 checkpoint loads with every tensor as saved and
    the next losses are the EP2 run's."""
    directory, losses = runs["ep2"]
    trainer = MegatronTrainer(MegatronTrainerConfig(**SIZES, model="mixtral", output_dir=str(tmp_path / "r")))
    assert trainer.resume(str(directory / "checkpoint-2")) == 2
    saved, expected = module_tensors(trainer.save()), module_tensors(directory / "checkpoint-2")
    assert all(torch.equal(saved[k], expected[k]) for k in expected), [k for k in expected if not torch.equal(saved[k], expected[k])]
    assert trainer.train() == pytest.approx(losses[2:], rel=1e-5)


def test_resume_ep2_in_the_transformers_trainer(runs, tmp_path):
    """EP2 -> transformers' Trainer on one process (converted in-process to its checkpoint layout, per-expert
    tensors placed by our load): the EP2 run's losses. The base trainer, which no converter writes, refuses
    in one line naming the format and the trainers that take it."""
    from trainers.hf_trainer import HFTrainer, HFTrainerConfig

    directory, losses = runs["ep2"]
    trainer = HFTrainer(HFTrainerConfig(**SIZES, model="mixtral", output_dir=str(tmp_path / "r")))
    assert trainer.resume(str(directory / "checkpoint-2")) == 2
    assert trainer.train() == pytest.approx(losses[2:], rel=1e-5)
    base = BaseTrainer(TrainerConfig(**SIZES, model="mixtral", output_dir=str(tmp_path / "b")))
    with pytest.raises(ConfigurationError, match=r"checkpoint-2 is a interop-dcp checkpoint, and no converter writes BaseTrainer's format"):
        base.resume(str(directory / "checkpoint-2"))


@pytest.mark.slow  # EP reshards: test_resume_ep2_on_one_process; TP merges: test_resume_tp2_on_one_process
def test_resume_tp2xep2_at_ep2(runs, tmp_path):
    """TP2 x EP2 on 4 ranks -> EP2 on 2: other ep groups, the tp shards merged, the same losses."""
    directory, losses = runs["tp2xep2"]
    summary, log = megatron_run(2, *RUN, *MOE, "--ep", "2", "--output-dir", str(tmp_path / "r"),
                                "--resume", str(directory / "checkpoint-2"))
    assert summary["losses"] == pytest.approx(losses[2:], rel=1e-5)
    assert "component 'dcp': saved by 4 ranks, loaded onto 2 (policy 'reshard')" in log


@pytest.mark.slow
def test_pipeline_and_expert_parallel(runs, tmp_path):
    """PP2 x EP2 on 4 processes (each stage's experts split over its own ep group, 1F1B): one process's losses."""
    summary, _ = megatron_run(4, *RUN, *MOE, "--pp", "2", "--ep", "2", "--microbatches", "2", "--output-dir", str(tmp_path / "r"))
    assert summary["losses"] == pytest.approx(runs["base"][1], rel=1e-5)
    sharding = json.loads((tmp_path / "r" / "checkpoint-4" / "manifest.json").read_text())["sharding"]
    assert (sharding["pp"], sharding["ep"], sharding["dp"]) == (2, 2, 2)


@pytest.mark.slow
def test_a_stage_without_moe_layers(tmp_path):
    """PP2 x EP2 on a Qwen2-MoE whose first two of four layers are dense (mlp_only_layers): the first stage has no
    experts to split and runs as it is; the losses are one process's."""
    import transformers

    from tests import architectures

    name, cls, kwargs = architectures.ARCHITECTURES["qwen2_moe"]
    config = transformers.AutoConfig.for_model(name, architectures=[cls], **{**kwargs, "num_hidden_layers": 4, "mlp_only_layers": [0, 1]})
    torch.manual_seed(0)
    getattr(transformers, cls)(config).save_pretrained(tmp_path / "hf")
    sizes = {"steps": 3, "batch_size": 4, "seq_len": 16}
    expected = BaseTrainer(TrainerConfig(**sizes, init_from=str(tmp_path / "hf"), output_dir=str(tmp_path / "base"))).train()
    summary, _ = megatron_run(4, "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--init-from", str(tmp_path / "hf"),
                              "--pp", "2", "--ep", "2", "--microbatches", "2", "--output-dir", str(tmp_path / "r"))
    assert summary["losses"] == pytest.approx(expected, rel=1e-5)


@pytest.mark.slow
def test_resume_ep2_at_ep4(runs, tmp_path):
    """EP2 -> EP4 (one expert per rank, 4 processes)."""
    directory, losses = runs["ep2"]
    summary, _ = megatron_run(4, *RUN, *MOE, "--ep", "4", "--output-dir", str(tmp_path / "r"), "--resume", str(directory / "checkpoint-2"))
    assert summary["losses"] == pytest.approx(losses[2:], rel=1e-5)


def test_expert_parallel_errors(tmp_path):
    with pytest.raises(ConfigurationError, match=r"--ep 2 does not divide the data-parallel size 1 \(world 1 over tp x pp = 1 x 1\)"):
        MegatronTrainer(MegatronTrainerConfig(**SIZES, model="mixtral", ep=2, output_dir=str(tmp_path)))
    from tests import architectures
    from trainers.base import build_model
    from trainers.megatron_model import CausalLMStage, apply_expert_parallel, stage_layouts

    def stage(model: str) -> CausalLMStage:
        return CausalLMStage(build_model(TrainerConfig(model=model)), stage_layouts(2, 1)[0])

    # a layer without a mask is causal only under sdpa: GPT-OSS's eager attention (and its sliding windows) refused
    with pytest.raises(ConfigurationError, match=r"'gpt_oss' has attention implementation 'eager' \(eager attention sees every token"):
        CausalLMStage(architectures.build("gpt_oss"), stage_layouts(2, 1)[0])
    three = types.SimpleNamespace(size=lambda: 3)
    with pytest.raises(ConfigurationError, match=r"--ep 3 does not divide the 4 experts of model.layers.0.mlp.experts.gate_up_proj"):
        apply_expert_parallel(stage("mixtral"), three, None)
    with pytest.raises(ConfigurationError, match=r"--ep 3: 'llama' has no experts to split"):
        apply_expert_parallel(stage("llama"), three, None)


@pytest.mark.parametrize("name", ["deepseek_v3", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_any_moe_architecture(tmp_path, name):
    """Expert parallelism comes from the model's own expert-parallel plan, not a list kept here: DeepSeek-V3
    (MLA attention, a dense first layer, shared experts, the routers' score-correction bias) and Qwen2-MoE
    (a gated shared expert) started from a saved model, EP2 matching one process."""
    from tests import architectures

    _, hf = architectures.saved(tmp_path, name)
    sizes = {"steps": 3, "batch_size": 4, "seq_len": 16}
    expected = BaseTrainer(TrainerConfig(**sizes, init_from=str(hf), output_dir=str(tmp_path / "base"))).train()
    summary, _ = megatron_run(2, "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--init-from", str(hf), "--ep", "2",
                              "--output-dir", str(tmp_path / "ep2"))
    assert summary["losses"] == pytest.approx(expected, rel=1e-5)
