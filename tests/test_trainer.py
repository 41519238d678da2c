"""The base trainer: exact resume, HF import, and its checkpoint through the converters."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from converters import registry
from converters.diff import diff_checkpoints
from trainers.base import BaseTrainer, TrainerConfig

from .conftest import ROOT, worker_env


@pytest.mark.parametrize("kind,tied", [("llama", False), ("gpt2", True)], ids=["llama", "gpt2-tied-dropout"])
def test_resume_is_bit_exact(tmp_path, kind, tied):
    cfg = dict(model=kind, tied=tied, steps=8, keep_last=2)
    uninterrupted = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "full"), **cfg))
    full = uninterrupted.train()

    first = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "split"), **cfg))
    head = first.train(until=4)
    first.save()
    torch.manual_seed(999)  # disturb every generator the resumed run might otherwise inherit
    second = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "split"), **cfg))
    assert second.resume() == 4
    tail = second.train()
    assert head + tail == full  # bit-identical floats
    assert second.state.losses == full
    final = dict(uninterrupted.model.named_parameters())
    for name, p in second.model.named_parameters():
        assert torch.equal(p, final[name]), name
    assert second.data.state_dict() == uninterrupted.data.state_dict()
    assert second.scheduler.state_dict()["last_epoch"] == 8


def test_gpt2_dropout_makes_rng_restore_matter(tmp_path):
    """Without the rng component the resumed losses differ: the exact-resume test above is not vacuous."""
    cfg = dict(model="gpt2", tied=True, steps=6)
    full = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "a"), **cfg)).train()
    first = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "b"), **cfg))
    first.train(until=3)
    first.save()
    second = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "b"), **cfg))
    second.get_state_components = lambda: [c for c in BaseTrainer.get_state_components(second) if c.key != "rng"]
    second.resume()
    torch.manual_seed(4321)
    assert second.train() != full[3:]


def test_init_from_hf_and_checkpoint_converts_losslessly(tmp_path, tiny_llama):
    model = tiny_llama(tied=True)
    model.save_pretrained(tmp_path / "hf")
    trainer = BaseTrainer(TrainerConfig(init_from=str(tmp_path / "hf"), steps=3, output_dir=str(tmp_path / "run")))
    for name, p in model.state_dict().items():
        assert torch.equal(trainer.model.state_dict()[name], p)
    trainer.train()
    path = trainer.save()
    _, native = registry.read(path)
    assert native.tied == [["lm_head.weight", "model.embed_tokens.weight"]]
    registry.writer("universal").write(native, str(tmp_path / "uni"), registry.Options())
    _, uni = registry.read(str(tmp_path / "uni"))
    report = diff_checkpoints(native, uni)
    assert report.problems == [] and report.count("exact") == len(report.entries) > 40
    assert uni.optimizer.cls == "AdamW" and [len(g["params"]) for g in uni.optimizer.param_groups] == [15, 5]
    assert uni.optimizer.scalars["step"]["model.norm.weight"] == {"value": 3.0, "dtype": "float32"}
    assert sorted(uni.components) == ["data", "rng", "scheduler", "trainer"]


def test_trainer_cli_resumes_exactly_as_a_launcher_would_start_it(tmp_path):
    """A run stopped and resumed from the command line continues exactly. A resume at the run's last step says so
    and leaves the finished run's checkpoint as it was (it would otherwise be saved again over itself); another
    format, which no converter writes for the base trainer, is refused in one line (a model: use --init-from)."""
    from converters import registry
    from interop.manifest import read_manifest

    def start(*args):
        return subprocess.run(
            [sys.executable, "-m", "trainers.base", "--steps", "6", "--output-dir", str(tmp_path / args[0]), *args[1:]],
            env=worker_env(), capture_output=True, text=True, timeout=300, cwd=ROOT,
        )

    def run(*args):
        proc = start(*args)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return json.loads(proc.stdout.strip().splitlines()[-1])["losses"]

    full = run("full")
    head = run("split", "--stop-at", "3")
    tail = run("split", "--resume")
    assert head + tail == full and len(full) == 6

    finished = read_manifest(str(tmp_path / "split" / "checkpoint-6")).committed_at
    again = start("split", "--resume")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "nothing to train: the checkpoint is at step 6 and the run ends at step 6" in again.stderr
    summary = json.loads(again.stdout.strip().splitlines()[-1])
    assert summary["losses"] == [] and summary["checkpoint"] is None
    assert read_manifest(str(tmp_path / "split" / "checkpoint-6")).committed_at == finished

    _, ckpt = registry.read(str(tmp_path / "split" / "checkpoint-6"))
    registry.writer("hf").write(ckpt, str(tmp_path / "hf"), registry.Options())
    refused = start("other", "--resume", str(tmp_path / "hf"))
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1, refused.stderr
    assert f"error: {tmp_path / 'hf'} is a Hugging Face model, not a checkpoint to resume: start from it with --init-from" in refused.stderr


def test_manifest_records_model_and_sharding_metadata(tmp_path):
    from interop.manifest import read_manifest
    from interop.sharding import DistributedModel, LocalModel, ShardingMetadata, Strategy

    trainer = BaseTrainer(TrainerConfig(steps=1, output_dir=str(tmp_path), tied=True))
    trainer.train()
    manifest = read_manifest(trainer.save())
    sharding = ShardingMetadata.from_json(manifest.sharding)
    assert sharding.strategy is Strategy.SINGLE and sharding.world_size == 1 and sharding.precision == "float32"
    assert ShardingMetadata.from_json(sharding.to_json()) == sharding
    assert manifest.model["config"]["architectures"] == ["LlamaForCausalLM"]
    assert manifest.model["tied"] == [["lm_head.weight", "model.embed_tokens.weight"]]
    assert manifest.optimizer == {"class": "AdamW"}
    assert isinstance(LocalModel(trainer.model), DistributedModel)


def test_every_trainer_flag_has_help():
    """`--help` explains each flag, for every trainer's own flags too (the parser the launchers' scripts use)."""
    import argparse

    from trainers.accelerate import AccelerateTrainerConfig
    from trainers.base import config_parser
    from trainers.deepspeed import DeepSpeedTrainerConfig
    from trainers.megatron import MegatronTrainerConfig

    for cls in (TrainerConfig, DeepSpeedTrainerConfig, AccelerateTrainerConfig, MegatronTrainerConfig):
        actions = [a for a in config_parser(cls)._actions if a.help != argparse.SUPPRESS and a.dest != "help"]
        bare = [a.option_strings[0] for a in actions if not a.help or a.help.startswith("default:")]
        assert not bare, (cls.__name__, bare)
    assert "save a checkpoint every N steps" in config_parser(TrainerConfig).format_help()


def test_trainer_usage_errors_are_one_line(capsys):
    """A flag mistake is one line naming the command and --help, as in the CLI; --verbose is read before the
    flags are parsed, so abbreviations of it (or any flag) are refused rather than half-applied."""
    from trainers.base import config_parser

    for argv, message in ((["--steps", "x"], "argument --steps: invalid int value: 'x'"),
                          (["--verb"], "unrecognized arguments: --verb")):
        with pytest.raises(SystemExit) as exit_:
            config_parser(TrainerConfig).parse_args(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and len(err.strip().splitlines()) == 1 and message in err, err
        assert err.strip().endswith("--help)"), err
