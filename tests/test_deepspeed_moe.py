"""DeepSpeed's own MoE (deepspeed.moe.layer.MoE, experts split over expert-parallel ranks) trained and saved by
real DeepSpeed on gloo: every expert of every layer is read with its fp32 weights and Adam moments exactly as the
engine held them, under its global number (DeepSpeed keeps each expert-parallel rank's experts in the optimizer
files under their local numbers, and names only rank 0's in param_shapes: read naively, experts 2 and 3 are
silently gone); and written for another world size and expert-parallel size, DeepSpeed's own load_checkpoint
restores every weight and moment exactly."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from converters import registry
from interop.errors import ConversionError, MissingFileError
from tests.conftest import ROOT, run_workers, worker_env

WORKER = str(ROOT / "tests" / "ds_moe_worker.py")
EXPERT = "moe.{layer}.deepspeed_moe.experts.deepspeed_experts.{expert}"


def torchrun(nproc: int, *args) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", WORKER, *map(str, args)]
    return run_workers(cmd, worker_env(), timeout=600).stdout


def truth(directory: Path, nproc: int) -> dict[str, dict[str, torch.Tensor]]:
    """What the engine held, merged over ranks (an expert held by several ranks must be the same on each)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for rank in range(nproc):
        for name, entry in torch.load(directory / f"truth.pt.rank{rank}").items():
            if name in out:
                assert all(torch.equal(out[name][k], entry[k]) for k in entry), name
            out[name] = entry
    return out


def assert_reads_as_held(ckpt_dir: Path, held: dict[str, dict[str, torch.Tensor]]) -> None:
    _, ckpt = registry.read(str(ckpt_dir))
    assert sorted(ckpt.model) == sorted(held)
    for layer in range(2):
        for expert in range(4):
            assert f"{EXPERT.format(layer=layer, expert=expert)}.0.weight" in ckpt.model
    for name, entry in held.items():
        assert torch.equal(ckpt.model[name].load(), entry["w"]), name
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(ckpt.optimizer.tensors[key][name].load(), entry[key]), (name, key)


@pytest.fixture(scope="module")
def ep2(tmp_path_factory) -> Path:
    """Two steps of EP 2 on 2 ranks, ZeRO-2: each rank the only holder of its experts."""
    out = tmp_path_factory.mktemp("ds-moe") / "ds"
    torchrun(2, "train", 2, 2, 2, out)
    return out


def test_deepspeed_moe_checkpoint_reads_every_expert_exactly(ep2):
    held = truth(ep2, 2)
    assert_reads_as_held(ep2, held)
    # two steps apart from the initial weights: a reader that took rank 0's experts for every rank would differ
    assert not torch.equal(held[f"{EXPERT.format(layer=0, expert=0)}.0.weight"]["w"], held[f"{EXPERT.format(layer=0, expert=2)}.0.weight"]["w"])
    assert registry.read(str(ep2))[1].source["ep_size"] == 2


def test_inspect_counts_the_experts_and_a_dropped_one_is_refused(ep2, tmp_path, capsys):
    from converters.cli import main

    assert main(["inspect", str(ep2), "--limit", "1"]) == 0
    assert "experts:   4 experts in each of 2 deepspeed.moe layers, saved over 2 expert-parallel ranks\n" in capsys.readouterr().out
    _, ckpt = registry.read(str(ep2))
    for expert in (1, 3):  # a gap, and the last one (only DeepSpeed's num_experts says there were 4)
        dropped = dataclasses.replace(ckpt, model={n: t for n, t in ckpt.model.items() if f"{EXPERT.format(layer=1, expert=expert)}." not in n})
        with pytest.raises(ConversionError, match=rf"out: not written: layer moe.1.deepspeed_moe.experts.deepspeed_experts, expert {expert}"):
            registry.writer("universal").write(dropped, str(tmp_path / "out"), registry.Options())


@pytest.mark.slow  # the partitioned expert groups are also written and loaded by DeepSpeed below (world 4, EP 2) by default
def test_experts_partitioned_over_their_data_parallel_ranks_read_exactly(tmp_path):
    """EP 2 on 4 ranks, ZeRO-1: each expert group's partitions split over the 2 ranks of its expert-data-parallel group."""
    torchrun(4, "train", 1, 2, 2, tmp_path / "ds")
    assert_reads_as_held(tmp_path / "ds", truth(tmp_path / "ds", 4))


@pytest.mark.parametrize(("world", "ep", "stage"), [(4, 2, 1), pytest.param(2, 1, 2, marks=pytest.mark.slow)],
                         ids=["world4-ep2-zero1", "world2-ep1-zero2"])  # EP2 -> EP1 under -m slow (the suite's time)
def test_written_for_another_expert_parallel_size_deepspeed_loads_it_exactly(ep2, tmp_path, world, ep, stage):
    """The EP 2 checkpoint through universal, then `--to deepspeed --world-size W --ep-size EP`: DeepSpeed's own
    load_checkpoint into the model built for that layout restores every weight and Adam moment exactly, and the next
    step's loss on rank 0 is the one the same weights give at the source's layout."""
    options = registry.Options(extra={"world_size": world, "ep_size": ep, "zero_stage": stage})
    registry.writer("universal").write(registry.read(str(ep2))[1], str(tmp_path / "uni"), registry.Options())
    registry.writer("deepspeed").write(registry.read(str(tmp_path / "uni"))[1], str(tmp_path / "out"), options)
    files = sorted(p.name for p in (tmp_path / "out" / "global_step2").iterdir())
    assert [f for f in files if f.startswith("layer_")] == sorted(f"layer_{layer}_expert_{e}_mp_rank_00_model_states.pt"
                                                                   for layer in range(2) for e in range(4))
    done = json.loads(torchrun(world, "load", stage, ep, tmp_path / "out", tmp_path / "loaded").splitlines()[-1])
    assert done["loaded"].endswith("mp_rank_00_model_states.pt")
    loaded, held = truth(tmp_path / "loaded", world), truth(ep2, 2)
    assert loaded.keys() == held.keys()
    for name, entry in held.items():
        for key, t in entry.items():
            assert torch.equal(loaded[name][key], t), (name, key)
    assert registry.read(str(tmp_path / "out"))[1].source.get("ep_size", 1) == ep


def test_deepspeed_moe_refuses_zero3_and_an_ep_size_that_does_not_fit(ep2, tmp_path):
    _, ckpt = registry.read(str(ep2))
    cases = [({"world_size": 2, "zero_stage": 3}, "DeepSpeed does not run with ZeRO-3"),
             ({"world_size": 3, "zero_stage": 2, "ep_size": 2}, "--ep-size 2 does not divide the world size 3"),
             ({"world_size": 8, "zero_stage": 2, "ep_size": 8}, "layer moe.0.deepspeed_moe.experts.deepspeed_experts: 4 experts "
                                                                 "cannot be split over 8 expert-parallel ranks")]
    for extra, message in cases:
        with pytest.raises(ConversionError, match=message):
            registry.writer("deepspeed").write(ckpt, str(tmp_path / "out"), registry.Options(extra=extra))
        assert not (tmp_path / "out").exists()


def test_a_missing_expert_file_is_named(ep2, tmp_path):
    shutil.copytree(ep2, tmp_path / "ds")
    gone = tmp_path / "ds" / "ckpt" / "layer_1_expert_3_mp_rank_00_model_states.pt"
    gone.unlink()
    with pytest.raises(MissingFileError, match=r"layer_1_expert_3_mp_rank_00_model_states.pt: missing: DeepSpeed's loader reads "
                                               r"each of MoE layer 1's 4 experts from its own file"):
        registry.read(str(tmp_path / "ds"))
