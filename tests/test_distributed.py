"""Sharing patterns, replication checks and failure handling on real multi-process gloo groups (torchrun)."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from interop import CheckpointManager, SharingPattern, StateComponent, WorldSizePolicy
from interop.errors import UncommittedCheckpointError
from interop.manifest import read_manifest
from interop.pieces import read_piece
from interop.verify import verify_checkpoint

from .conftest import free_port, listing, torchrun, torchrun_cmd, worker_env
from .dist_worker import KILL_POINTS, Box, Provider

pytestmark = pytest.mark.dist


def _results(out, world):
    return [json.loads((out / f"result-{r}.json").read_text()) for r in range(world)]


@pytest.fixture(scope="module")
def core_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("core")
    proc = torchrun(4, "core", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return out, _results(out, 4)


def test_each_pattern_saved_by_the_right_ranks(core_run):
    out, _ = core_run
    manifest = read_manifest(out / "patterns" / "checkpoint-5")
    writers = {rel: rec.writer for rel, rec in manifest.files.items()}
    assert writers == {
        "components/g.json": 0, "components/g.safetensors": 0,
        "components/rep.json": 0, "components/rep.safetensors": 0,
        **{f"ranks/{r:05d}/{k}.{ext}": r for r in range(4) for k in ("pr", "dyn") for ext in ("json", "safetensors")},
        # dp groups {0,2},{1,3} and tp groups {0,1},{2,3}: the lowest rank of each writes
        **{f"groups/dp/{i:05d}/dp.{ext}": w for i, w in ((0, 0), (1, 1)) for ext in ("json", "safetensors")},
        **{f"groups/tp/{i:05d}/tp.{ext}": w for i, w in ((0, 0), (1, 2)) for ext in ("json", "safetensors")},
        "nodes/00000/node.json": 0, "nodes/00000/node.safetensors": 0,
    }
    assert {k: c.pattern for k, c in manifest.components.items()} == {
        "g": "GLOBAL", "rep": "REPLICATED", "pr": "PER_RANK", "dp": "PER_GROUP", "tp": "PER_GROUP",
        "node": "PER_NODE", "dyn": "PER_RANK",  # the dynamic pattern is recorded as resolved
    }
    assert manifest.topology["groups"] == {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}
    assert verify_checkpoint(str(out / "patterns" / "checkpoint-5"))[1] == []


def test_replica_differing_on_one_rank_is_named(core_run):
    _, results = core_run
    messages = {r["mismatch_error"] for r in results}
    assert len(messages) == 1, "every rank must raise the same error"
    (message,) = messages
    assert "'weights'" in message and "key 'value' differs on rank 2" in message and "ranks 0, 1, 3 agree" in message


def test_one_rank_failing_fails_the_save_everywhere(core_run):
    out, results = core_run
    messages = {r["fail_error"] for r in results}
    assert len(messages) == 1
    (message,) = messages
    assert message.startswith("save of checkpoint-2 failed on rank 3: UnsupportedStateError")
    root = out / "fail"
    assert listing(root) == ["checkpoint-1", "latest"]  # no staging left behind
    assert (root / "latest").read_text().strip() == "checkpoint-1"


def test_per_node_with_two_torchrun_nodes(tmp_path):
    port = free_port()
    procs = [
        subprocess.Popen(
            torchrun_cmd(2, "nodes", str(tmp_path), nnodes=2, node_rank=n, port=port),
            env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        for n in (0, 1)
    ]
    logs = [p.communicate(timeout=240)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], "\n".join(log[-4000:] for log in logs)
    results = _results(tmp_path, 4)
    assert [r["node"] for r in results] == [0, 0, 1, 1]
    manifest = read_manifest(tmp_path / "nodes" / "checkpoint-3")
    assert manifest.components["cache"].pieces == {"node/00000": "nodes/00000/cache", "node/00001": "nodes/00001/cache"}
    assert manifest.files["nodes/00000/cache.safetensors"].writer == 0
    assert manifest.files["nodes/00001/cache.safetensors"].writer == 2  # local rank 0 of node 1
    assert manifest.topology["ranks_per_node"] == 2


def _load_single(root):
    """Load the kill test's checkpoint in one process (the per-rank part remaps)."""
    a, r = Box(0), Box(0)
    comps = [
        StateComponent("a", a, SharingPattern.REPLICATED),
        StateComponent("r", r, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.REMAP),
    ]
    result = CheckpointManager(str(root), Provider(comps)).load()
    return result.step, float(a.value[0]), float(r.value[0])


# before and after the manifest end as during the write does (the last checkpoint, nothing new): slow
@pytest.mark.parametrize("point", [pytest.param(p, marks=pytest.mark.slow) if p in ("before_manifest", "after_manifest") else p
                                   for p in KILL_POINTS])
def test_sigkill_during_save_leaves_a_loadable_checkpoint(tmp_path, point):
    proc = torchrun(2, f"kill:{point}", str(tmp_path))
    assert proc.returncode != 0, "the save was supposed to be killed"
    root = tmp_path / "run"
    assert verify_checkpoint(str(root / "checkpoint-1"))[1] == [], "the previous checkpoint must stay intact"
    new = root / "checkpoint-2"
    if new.exists():
        assert verify_checkpoint(str(new))[1] == [], "a published checkpoint must verify"
    staging = root / "checkpoint-2.staging"
    if staging.exists():
        with pytest.raises(UncommittedCheckpointError):
            CheckpointManager(str(staging), Provider([])).load(str(staging))
    step, a, r = _load_single(root)  # whatever 'latest' names loads, consistently
    assert (step, a, r) in ((1, 1.0, 10.0), (2, 2.0, 20.0))
    expected_step = {"during_write": 1, "before_manifest": 1, "after_manifest": 1, "after_publish": 1, "after_latest": 2}
    assert step == expected_step[point]
    if point in ("during_write", "before_manifest", "after_manifest"):
        assert not new.exists()
    if point == "after_publish":
        assert new.exists() and (root / "latest").read_text().strip() == "checkpoint-1"
    assert torch.equal(torch.tensor([a]), torch.tensor([1.0 if step == 1 else 2.0]))


@pytest.mark.parametrize("seed", [1, pytest.param(2, marks=pytest.mark.slow), pytest.param(3, marks=pytest.mark.slow)])
def test_sigkill_at_a_random_moment_of_staged_background_saves(tmp_path, seed):
    """Staged saves commit on a background thread while the state changes in place; whatever moment a rank dies
    at, every committed checkpoint verifies and the one 'latest' names holds the state of its own step."""
    proc = torchrun(2, f"kill-async:{seed}", str(tmp_path))
    assert proc.returncode != 0, "a rank was supposed to be killed"
    root = tmp_path / "run"
    committed = [p for p in root.iterdir() if p.name.startswith("checkpoint-") and not p.name.endswith(".staging")]
    assert committed, proc.stderr[-2000:]
    for ckpt in committed:
        assert verify_checkpoint(str(ckpt))[1] == [], ckpt
    step, a, r = _load_single(root)
    assert (root / "latest").read_text().strip() == f"checkpoint-{step}"
    assert (a, r) == (float(step), 10.0 * step), "a staged save wrote state changed after it returned"
    for ckpt in committed:  # every one holds its own step's values, each rank's part
        s = int(ckpt.name.split("-")[1])
        manifest = read_manifest(ckpt)
        a_values = [read_piece(str(ckpt), b)["value"] for b in manifest.components["a"].pieces.values()]
        r_values = sorted(float(read_piece(str(ckpt), b)["value"][0]) for b in manifest.components["r"].pieces.values())
        assert all(torch.equal(v, torch.full((3,), float(s))) for v in a_values), ckpt
        assert r_values == [10.0 * s, 10.0 * s + 1], ckpt
