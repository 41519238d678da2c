"""The Megatron-style trainer on real torch process groups (gloo, CPU): DTensor tensor parallelism,
torch.distributed.pipelining, DP x TP x PP on a device mesh, each matching a single-process run; its DCP
checkpoint read, written, and resumed from on other layouts, directly and through a universal checkpoint."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest
import torch

from converters.registry import read
from interop.errors import CorruptCheckpointError
from trainers.base import BaseTrainer, TrainerConfig
from trainers.megatron import MegatronTrainer, MegatronTrainerConfig
from trainers.megatron_model import CausalLMStage, apply_tensor_parallel, stage_layouts

from .conftest import free_port, run_workers, worker_env

pytestmark = pytest.mark.dist
SIZES = {"steps": 4, "batch_size": 4, "seq_len": 16}
RUN = ["--steps", "4", "--save-every", "2", "--batch-size", "4", "--seq-len", "16"]
LAYOUTS = {
    "tp2": (2, ["--tp", "2"]),
    "pp2": (2, ["--pp", "2", "--microbatches", "2", "--pipeline-schedule", "1f1b",
                "--activation-checkpointing", "--recompute-granularity", "stage"]),
    "1x2x2": (4, ["--tp", "2", "--pp", "2", "--microbatches", "4", "--pipeline-schedule", "gpipe", "--activation-checkpointing"]),
}


def megatron_run(nproc: int, *args: str, timeout: int = 300) -> tuple[dict, str]:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", "-m", "trainers.megatron", *args]
    result = run_workers(cmd, worker_env(), timeout)
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1]), result.stderr


def cli(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "converters.cli", *args], env=worker_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return result


def logical(path) -> dict[str, torch.Tensor]:
    _, ckpt = read(str(path))
    return {k: t.load() for k, t in ckpt.tensors()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The base trainer in one process (the reference), and the same model, data and optimizer at TP2, PP2
    (1F1B, whole-stage recomputation) and DP x TP x PP = 1x2x2 (GPipe, per-layer recomputation)."""
    out = tmp_path_factory.mktemp("megatron")
    base = BaseTrainer(TrainerConfig(**SIZES, save_every=2, output_dir=str(out / "base")))
    found = {"base": (out / "base", base.train())}
    for name, (nproc, flags) in LAYOUTS.items():
        summary, _ = megatron_run(nproc, *RUN, *flags, "--output-dir", str(out / name))
        found[name] = (out / name, summary["losses"])
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_parallel_run_matches_single_process(runs, layout):
    """Same losses as the single-process base trainer to float rounding; the manifest records the mesh, the
    per-rank activation checkpoints and the memory of every rank."""
    directory, losses = runs[layout]
    assert losses == pytest.approx(runs["base"][1], rel=1e-5)
    nproc, _ = LAYOUTS[layout]
    manifest = json.loads((directory / "checkpoint-4" / "manifest.json").read_text())
    sharding = manifest["sharding"]
    expected = {"tp2": ("tensor_parallel", 2, 1), "pp2": ("pipeline_parallel", 1, 2), "1x2x2": ("hybrid", 2, 2)}[layout]
    assert (sharding["strategy"], sharding["tp"], sharding["pp"], sharding["dp"]) == (*expected, 1)
    assert manifest["components"]["dcp"] == {**manifest["components"]["dcp"], "pattern": "PER_GROUP", "group": "dp",
                                             "policy": "reshard", "native": True}
    groups = manifest["topology"]["groups"]
    assert sorted(map(tuple, groups["tp"])) == ([(0, 1)] if layout == "tp2" else [(0, 1), (2, 3)] if layout == "1x2x2" else [(0,), (1,)])
    mem = manifest["memory"]
    assert len(mem["ranks"]) == nproc and mem["host_peak"]["max"] > 0
    assert mem["activation_checkpoints_per_rank"] == {"tp2": [0, 0], "pp2": [1, 1], "1x2x2": [1, 1, 1, 1]}[layout]
    # DCP's own files beside our manifest: dcp.load(state, checkpoint_id="checkpoint-4") reads them as they are
    assert sorted(n for n in os.listdir(directory / "checkpoint-4") if n not in ("manifest.json", "components", "ranks")) == \
        [".metadata"] + [f"__{r}_0.distcp" for r in range(nproc)]


def test_checkpoint_reads_as_the_single_process_state(runs):
    """The TP2 and 1x2x2 checkpoints read into logical tensors under canonical names: weights and Adam moments
    equal the base trainer's at the same step to float rounding, groups and steps exactly."""
    base = read(str(runs["base"][0] / "checkpoint-2"))[1]
    for layout in ("tp2", "1x2x2"):
        fmt, ckpt = read(str(runs[layout][0] / "checkpoint-2"))
        assert fmt.name == "interop-dcp" and ckpt.step == 2
        assert sorted(ckpt.model) == sorted(base.model)
        for name, t in ckpt.model.items():
            torch.testing.assert_close(t.load(), base.model[name].load(), rtol=1e-4, atol=1e-6)
        assert [g["params"] for g in ckpt.optimizer.param_groups] == [g["params"] for g in base.optimizer.param_groups]
        assert [g["weight_decay"] for g in ckpt.optimizer.param_groups] == [0.1, 0.0]
        assert ckpt.optimizer.param_groups[0]["betas"] == (0.9, 0.95)
        for key in ("exp_avg", "exp_avg_sq"):
            for name, t in ckpt.optimizer.tensors[key].items():
                torch.testing.assert_close(t.load(), base.optimizer.tensors[key][name].load(), rtol=1e-3, atol=1e-7)
        assert {e["value"] for e in ckpt.optimizer.scalars["step"].values()} == {2.0}


@pytest.mark.parametrize("through_universal", [False, True], ids=["direct", "universal"])
def test_resume_tp2_on_one_process(runs, tmp_path, through_universal):
    """TP2 -> TP1: the step-2 checkpoint (directly, or converted to universal) loads into a single process
    with every weight and optimizer tensor bit-identical, and the next losses are the TP2 run's to rounding."""
    directory, losses = runs["tp2"]
    src = directory / "checkpoint-2"
    if through_universal:
        cli("convert", str(src), str(tmp_path / "u"), "--to", "universal")
        src = tmp_path / "u"
    trainer = MegatronTrainer(MegatronTrainerConfig(**SIZES, output_dir=str(tmp_path / "r")))
    assert trainer.resume(str(src)) == 2
    assert not list(tmp_path.glob("r/.import*"))  # the scratch conversion is gone
    expected, saved = logical(src), logical(trainer.save())
    assert sorted(saved) == sorted(expected)
    assert all(torch.equal(saved[k], expected[k]) for k in expected), [k for k in expected if not torch.equal(saved[k], expected[k])]
    assert trainer.train() == pytest.approx(losses[2:], rel=1e-5)


@pytest.mark.slow  # a 4-rank resume through universal: the resume matrix's fsdp2 -> tp2pp2 pair
def test_resume_pp2_through_universal_on_dp2_tp2(runs, tmp_path):
    """PP2 -> universal -> TP2 with two data-parallel replicas (4 processes; converted in-process by the
    trainer): the PP2 run's losses, the global batch split over the replicas."""
    directory, losses = runs["pp2"]
    cli("convert", str(directory / "checkpoint-2"), str(tmp_path / "u"), "--to", "universal")
    summary, log = megatron_run(4, *RUN, "--tp", "2", "--output-dir", str(tmp_path / "r"), "--resume", str(tmp_path / "u"))
    assert "(universal) for this run" in log
    assert summary["losses"] == pytest.approx(losses[2:], rel=1e-5)
    manifest = json.loads((tmp_path / "r" / "checkpoint-4" / "manifest.json").read_text())
    assert (manifest["sharding"]["strategy"], manifest["sharding"]["dp"], manifest["sharding"]["tp"]) == ("hybrid", 2, 2)
    assert "PER_RANK component 'rng' was saved with 2 ranks, now 4: not restored, reseeded per rank" in log


@pytest.mark.slow  # --to interop-dcp, verify and a diff of every tensor: the resume matrix's slice
def test_convert_to_interop_dcp_is_lossless(runs, tmp_path):
    """universal -> `--to interop-dcp` -> universal keeps every tensor exactly; verify passes on both."""
    cli("convert", str(runs["1x2x2"][0] / "checkpoint-4"), str(tmp_path / "u"), "--to", "universal")
    cli("convert", str(tmp_path / "u"), str(tmp_path / "d"), "--to", "interop-dcp")
    cli("verify", str(tmp_path / "d"))
    report = cli("diff", str(tmp_path / "u"), str(tmp_path / "d")).stdout
    import re

    assert re.search(r"(\d+) compared, \1 exact, 0 within atol, 0 different", report), report
    manifest = json.loads((tmp_path / "d" / "manifest.json").read_text())
    assert {"scheduler", "data", "trainer", "rng"} <= set(manifest["components"])  # carried beside dcp/
    # DCP loads on any layout: no note may claim the 4 ranks' RNG "cannot follow onto 1" (a Megatron-style run on 4
    # ranks restores it exactly; the run that loads it says what it does)
    assert not any("cannot follow" in n for n in manifest["notes"]), manifest["notes"]


# --- bad input ----------------------------------------------------------------------------------------------
def test_layout_errors(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match=r"world size 1 is not a multiple of tp x pp = 2 x 1"):
        MegatronTrainer(MegatronTrainerConfig(**SIZES, tp=2, output_dir=str(tmp_path)))
    with pytest.raises(ValueError, match="2 decoder layers do not split evenly over 3 pipeline stages"):
        stage_layouts(2, 3)
    with pytest.raises(ValueError, match="untie them to run pipeline parallel"):
        CausalLMStage(tiny_llama(tied=True), stage_layouts(2, 2)[0])
    stage = CausalLMStage(tiny_llama(), stage_layouts(2, 1)[0])
    with pytest.raises(ValueError, match=r"tensor parallel size 3 does not divide the attention heads \(4\)"):
        apply_tensor_parallel(stage, types.SimpleNamespace(size=lambda: 3))
    with pytest.raises(ValueError, match="--pipeline-schedule 'zb'"):
        MegatronTrainer(MegatronTrainerConfig(**SIZES, pipeline_schedule="zb", output_dir=str(tmp_path)))


def test_truncated_shard_is_refused_before_loading(runs, tmp_path):
    import shutil

    src = tmp_path / "ckpt"
    shutil.copytree(runs["tp2"][0] / "checkpoint-2", src)
    shard = src / "__1_0.distcp"
    shard.write_bytes(shard.read_bytes()[:100])
    trainer = MegatronTrainer(MegatronTrainerConfig(**SIZES, output_dir=str(tmp_path / "r")))
    with pytest.raises(CorruptCheckpointError, match=r"__1_0.distcp"):
        trainer.resume(str(src))


@pytest.mark.slow
def test_async_save_writes_what_a_blocking_save_writes(runs, tmp_path):
    """--async-save at TP2: DCP's async_save stages the state and writes it on its own thread while training goes
    on; checkpoint-2 holds exactly the tensors of the run that committed before stepping on."""
    summary, _ = megatron_run(2, *RUN, *LAYOUTS["tp2"][1], "--async-save", "--output-dir", str(tmp_path / "async"))
    assert summary["losses"] == runs["tp2"][1]
    for step in (2, 4):
        a, b = logical(runs["tp2"][0] / f"checkpoint-{step}"), logical(tmp_path / "async" / f"checkpoint-{step}")
        assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a), step
