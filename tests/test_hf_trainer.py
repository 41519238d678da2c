"""transformers' own Trainer as the Hugging Face trainer: its losses are the base trainer's, its checkpoints are
Trainer's own files (resumed by Trainer itself, exactly), and they read as the base trainer's state."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from converters.registry import detect, read
from interop.errors import CorruptCheckpointError
from trainers.base import BaseTrainer, TrainerConfig

from .conftest import held_commit_cmd, native_files, worker_env

SIZES = ["--steps", "4", "--batch-size", "4", "--seq-len", "16"]


def hf_run(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "trainers.hf_trainer", *SIZES, *args], env=worker_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads([line for line in result.stdout.splitlines() if line.startswith('{"')][-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    base = BaseTrainer(TrainerConfig(steps=4, batch_size=4, seq_len=16, save_every=2, output_dir=str(out / "base")))
    return out, base.train(), hf_run("--save-every", "2", "--output-dir", str(out / "hf"))


def test_trainer_losses_are_the_base_trainers_and_resume_is_exact(runs):
    """Same AdamW groups, schedule, clipping and data order as every other trainer: bit-identical losses.
    Resumed from step 2, Trainer's own resume_from_checkpoint gives steps 3 and 4 exactly."""
    out, base, hf = runs
    assert hf["losses"] == base
    files = {p.name for p in (out / "hf" / "checkpoint-2").iterdir()}  # Trainer's files beside our manifest
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert detect(str(out / "hf" / "checkpoint-2")).name == "hf-trainer"
    resumed = hf_run("--resume", str(out / "hf" / "checkpoint-2"), "--output-dir", str(out / "resumed"))
    assert resumed["losses"] == base[2:]


def test_async_save_stages_what_trainer_writes(runs, tmp_path):
    """--async-save: the weights, optimizer, scheduler, RNG state and training arguments Trainer hands torch.save and
    safetensors are copied in memory (not on disk when the save returns) and written by those functions only when
    the commit is awaited, after later steps changed the tensors in place: byte for byte a blocking save's files."""
    out, base, _ = runs
    cmd = [sys.executable, *held_commit_cmd(tmp_path / "returned.json", "trainers.hf_trainer", *SIZES, "--save-every", "2",
                                            "--async-save", "--output-dir", str(tmp_path / "staged"))]
    result = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads([line for line in result.stdout.splitlines() if line.startswith('{"')][-1])["losses"] == base
    returned_with = json.loads((tmp_path / "returned.json").read_text())[0]  # the step-2 save's staging directory
    assert not {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(returned_with), returned_with
    a, b = native_files(out / "hf" / "checkpoint-2"), native_files(tmp_path / "staged" / "checkpoint-2")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"} <= set(a)
    assert sorted(a) == sorted(b) and [n for n in a if a[n] != b[n] and n != "training_args.bin"] == []


def test_checkpoint_reads_as_the_base_trainers_state(runs):
    """optimizer.pt keeps parameters by position; read by name they are the base trainer's AdamW state."""
    out, _, _ = runs
    _, ours = read(str(out / "hf" / "checkpoint-4"))
    _, base = read(str(out / "base" / "checkpoint-4"))
    assert ours.step == base.step == 4
    got, want = dict(ours.tensors()), dict(base.tensors())
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(got[key].load(), t.load()), key
    assert [g["params"] for g in ours.optimizer.param_groups] == [g["params"] for g in base.optimizer.param_groups]
    assert [g["weight_decay"] for g in ours.optimizer.param_groups] == [0.1, 0.0]


def test_truncated_optimizer_file_is_named(runs, tmp_path):
    import shutil

    out, _, _ = runs
    ckpt = shutil.copytree(out / "hf" / "checkpoint-2", tmp_path / "bare",  # a bare Trainer checkpoint
                           ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    optim = ckpt / "optimizer.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt"):
        read(str(ckpt))
