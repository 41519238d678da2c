"""The adapter in one process: codec, safetensors I/O, RNG, replication messages, commit and retention."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch

from interop import CheckpointManager, RNGState, SharingPattern, StateComponent, WorldSizePolicy
from interop.codec import decode, encode
from interop.errors import (
    ComponentError,
    CorruptCheckpointError,
    MissingFileError,
    UncommittedCheckpointError,
    UnsupportedStateError,
)
from interop.manifest import read_manifest
from interop.pieces import state_fingerprint
from interop.replication import find_mismatches
from interop.safetensors_io import SafetensorsFile, save_tensors
from interop.verify import verify_checkpoint

from .conftest import listing


class Box:
    def __init__(self, value):
        self.value = torch.tensor(value, dtype=torch.float32)

    def state_dict(self):
        return {"value": self.value.clone()}

    def load_state_dict(self, state):
        self.value = state["value"].clone()


class Provider:
    def __init__(self, components):
        self.components = components

    def get_state_components(self):
        return self.components


# --- codec and files ---------------------------------------------------------------------------------


def test_codec_round_trip_keeps_types_and_ties():
    shared = torch.randn(4, 3)
    state = {
        "w": shared, "tied": shared,
        "bf16": torch.randn(5, dtype=torch.bfloat16), "half": torch.randn(2, 2, dtype=torch.float16),
        "state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3)}, 1: {}},
        "groups": [{"betas": (0.9, 0.95), "lr": 1e-3, "params": [0, 1], "name": None, "inf": float("inf")}],
        "np": np.arange(5, dtype=np.uint32), "flag": True, "blob": b"\x00\x01",
    }
    skeleton, tensors = encode(state)
    json.dumps(skeleton, allow_nan=False)  # strict JSON: no NaN/Infinity literals, no pickle
    out = decode(json.loads(json.dumps(skeleton)), tensors.__getitem__)
    assert out["w"] is out["tied"] and torch.equal(out["w"], shared)
    assert torch.equal(out["bf16"], state["bf16"]) and out["bf16"].dtype == torch.bfloat16
    assert set(out["state"]) == {0, 1} and torch.equal(out["state"][0]["exp_avg"], state["state"][0]["exp_avg"])
    assert out["groups"][0]["betas"] == (0.9, 0.95) and out["groups"][0]["inf"] == float("inf")
    assert out["np"].dtype == np.uint32 and list(out["np"]) == [0, 1, 2, 3, 4]
    assert out["blob"] == b"\x00\x01" and out["flag"] is True
    assert len(tensors) == 6  # the tied tensor is stored once


def test_codec_refuses_arbitrary_objects_naming_the_key():
    with pytest.raises(UnsupportedStateError, match=r"'opt.hook' is a .*object"):
        encode({"opt": {"hook": object()}})


def test_safetensors_files_are_readable_by_the_reference_library(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(3, 5), "b": torch.arange(7, dtype=torch.int64), "c": torch.randn(2, dtype=torch.bfloat16), "empty": torch.zeros(0, 3)}
    save_tensors(tmp_path / "x.safetensors", tensors, {"format": "pt"})
    ref = load_file(str(tmp_path / "x.safetensors"))
    ours = SafetensorsFile(tmp_path / "x.safetensors").read_all()
    for name, t in tensors.items():
        assert torch.equal(ref[name], t) and torch.equal(ours[name], t)


def test_truncated_safetensors_names_the_file(tmp_path):
    path = tmp_path / "x.safetensors"
    save_tensors(path, {"a": torch.randn(100)})
    data = path.read_bytes()
    path.write_bytes(data[:-10])
    with pytest.raises(CorruptCheckpointError, match=r"x\.safetensors: truncated: header describes 400 bytes"):
        SafetensorsFile(path)
    path.write_bytes(data[:6])
    with pytest.raises(CorruptCheckpointError, match="no header"):
        SafetensorsFile(path)


# --- RNG -----------------------------------------------------------------------------------------------


def test_rng_state_restores_every_generator():
    rng = RNGState()
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.rand(), torch.rand(1)
    skeleton, tensors = encode(rng.state_dict())
    expected = (random.random(), float(np.random.rand()), float(torch.rand(1)), np.random.randn())
    random.seed(9), np.random.seed(9), torch.manual_seed(9)
    rng.load_state_dict(decode(json.loads(json.dumps(skeleton)), tensors.__getitem__))
    assert (random.random(), float(np.random.rand()), float(torch.rand(1)), np.random.randn()) == expected


# --- replication -----------------------------------------------------------------------------------------


def test_fingerprint_sees_a_single_bf16_bit():
    a = {"w": torch.zeros(4, dtype=torch.bfloat16), "n": 3}
    b = {"w": torch.zeros(4, dtype=torch.bfloat16), "n": 3}
    b["w"].view(torch.int16)[2] = 1  # smallest subnormal: equal to zero in many comparisons, not in bytes
    assert state_fingerprint(a) != state_fingerprint(b)
    assert state_fingerprint(a) == state_fingerprint({"w": torch.zeros(4, dtype=torch.bfloat16), "n": 3})


def test_mismatch_message_names_component_key_and_ranks():
    good = {"w": "d1", "opt.0.lr": "0.1"}
    prints = {0: good, 1: good, 2: {**good, "w": "d2"}, 3: {**good, "opt.0.lr": "0.2"}}
    msg = find_mismatches("model", prints, [(0, 1, 2, 3)])
    assert msg == (
        "replicated component 'model' is not identical across ranks: "
        "key 'opt.0.lr' differs on rank 3 (ranks 0, 1, 2 agree); key 'w' differs on rank 2 (ranks 0, 1, 3 agree)"
    )
    assert find_mismatches("model", {0: good, 1: good}, [(0, 1)]) is None
    # within groups only: two groups may differ from each other
    assert find_mismatches("shard", {0: {"w": "a"}, 1: {"w": "b"}, 2: {"w": "a"}, 3: {"w": "b"}}, [(0, 2), (1, 3)]) is None


# --- components and the manager --------------------------------------------------------------------------


def test_save_load_round_trip_with_retention(tmp_path):
    box, mine = Box(1.0), Box(5.0)
    comps = [StateComponent("box", box, SharingPattern.GLOBAL), StateComponent("mine", mine, SharingPattern.PER_RANK)]
    manager = CheckpointManager(str(tmp_path), Provider(comps), keep_last=2)
    for step in (1, 2, 3):
        box.value.fill_(step)
        manager.save(step)
    assert listing(tmp_path) == ["checkpoint-2", "checkpoint-3", "latest"]
    box.value.zero_()
    result = manager.load()
    assert result.step == 3 and float(box.value) == 3.0
    manager.load(str(tmp_path / "checkpoint-2"))
    assert float(box.value) == 2.0


def test_retention_never_removes_the_checkpoint_latest_names(tmp_path):
    from interop.commit import prune, write_latest

    box = Box(0.0)
    manager = CheckpointManager(str(tmp_path), Provider([StateComponent("box", box, SharingPattern.GLOBAL)]))
    for step in (1, 2, 3):
        manager.save(step)
    write_latest(str(tmp_path), "checkpoint-1")  # e.g. an operator rolled back
    prune(str(tmp_path), keep_last=1)
    assert listing(tmp_path) == ["checkpoint-1", "checkpoint-3", "latest"]


def test_legacy_provider_still_saves_and_loads(tmp_path):
    class Legacy:
        def __init__(self):
            self.box = Box(4.0)

        def get_statefuls_for_save(self):
            return {"box": self.box, "rng": RNGState()}

        def get_statefuls_for_load(self):
            return {"box": self.box, "rng": RNGState()}

    legacy = Legacy()
    manager = CheckpointManager(str(tmp_path), legacy)
    manager.save(1)
    manifest = read_manifest(tmp_path / "checkpoint-1")
    assert {k: c.pattern for k, c in manifest.components.items()} == {"box": "GLOBAL", "rng": "PER_RANK"}
    legacy.box.value.zero_()
    manager.load()
    assert float(legacy.box.value) == 4.0


def test_dynamic_pattern_is_resolved_at_save_and_recorded(tmp_path):
    mode = {"pattern": SharingPattern.GLOBAL}
    box = Box(1.0)
    manager = CheckpointManager(str(tmp_path), Provider([StateComponent("data", box, lambda: mode["pattern"])]))
    manager.save(1)
    mode["pattern"] = SharingPattern.PER_RANK
    manager.save(2)
    assert read_manifest(tmp_path / "checkpoint-1").components["data"].pattern == "GLOBAL"
    assert read_manifest(tmp_path / "checkpoint-2").components["data"].pieces == {"rank/00000": "ranks/00000/data"}


def test_per_group_without_the_group_fails_naming_both(tmp_path):
    comp = StateComponent("shard", Box(1.0), SharingPattern.PER_GROUP, process_group_name="dp_group")
    from interop.errors import SaveFailedError

    with pytest.raises(SaveFailedError, match=r"component 'shard' is PER_GROUP over process group 'dp_group', which the trainer does not provide"):
        CheckpointManager(str(tmp_path), Provider([comp])).save(1)
    assert listing(tmp_path) == []


def test_keep_policy_is_refused_for_per_rank_state():
    with pytest.raises(ComponentError, match="policy 'keep' is for GLOBAL/REPLICATED"):
        StateComponent("r", Box(0), SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.KEEP).resolve()


def test_load_refuses_uncommitted_and_checks_sizes_and_digests(tmp_path):
    box = Box(1.0)
    manager = CheckpointManager(str(tmp_path), Provider([StateComponent("box", box, SharingPattern.GLOBAL)]))
    path = manager.save(1)
    manifest_path = os.path.join(path, "manifest.json")
    data = open(manifest_path).read()
    os.remove(manifest_path)
    with pytest.raises(UncommittedCheckpointError, match="no manifest.json: the save never committed"):
        manager.load(path)
    open(manifest_path, "w").write(data)
    tensor_file = os.path.join(path, "components", "box.safetensors")
    raw = bytearray(open(tensor_file, "rb").read())
    raw[-1] ^= 0xFF  # same size, different bytes
    open(tensor_file, "wb").write(bytes(raw))
    manager.load(path, verify=False)  # --no-verify: sizes match, the flipped byte goes through...
    assert any("--no-verify" in n for n in manager.resume_notes)  # ...and the run's next manifests say so
    with pytest.raises(CorruptCheckpointError, match=r"box\.safetensors: content digest differs"):
        manager.load(path)  # digests are checked by default
    assert any("box.safetensors" in p for p in verify_checkpoint(path)[1])
    open(tensor_file, "wb").write(bytes(raw[:-4]))
    with pytest.raises(CorruptCheckpointError, match=r"box\.safetensors: size \d+ bytes, manifest says \d+"):
        manager.load(path)
    os.remove(tensor_file)
    with pytest.raises(MissingFileError, match="listed in the manifest but missing"):
        manager.load(path)


def test_world_size_change_policies_in_one_process(tmp_path):
    """A checkpoint saved by 2 ranks (topology rewritten) loads in 1 process by each component's policy."""
    from interop.topology import Topology

    rng, data, sched = Box(1.0), Box(2.0), Box(3.0)

    class Reshardable(Box):
        def load_resharded(self, states, old, new):
            self.value = sum(s["value"] for s in states) + old * 100 + new

    shards = Reshardable(9.0)
    comps = [
        StateComponent("rng", rng, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.DROP),
        StateComponent("data", data, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.REMAP),
        StateComponent("sched", sched, SharingPattern.REPLICATED),
        StateComponent("shards", shards, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.RESHARD),
    ]
    manager = CheckpointManager(str(tmp_path), Provider(comps))
    path = manager.save(1)
    # pretend two ranks wrote it: duplicate rank 0's pieces as rank 1's and rewrite the manifest
    manifest = read_manifest(path)
    import shutil

    shutil.copytree(os.path.join(path, "ranks", "00000"), os.path.join(path, "ranks", "00001"))
    for key in ("rng", "data", "shards"):
        manifest.components[key].pieces["rank/00001"] = f"ranks/00001/{key}"
    for rel in list(manifest.files):
        if rel.startswith("ranks/00000/"):
            manifest.files[rel.replace("00000", "00001")] = manifest.files[rel]
    manifest.topology = Topology.uniform(2).to_json()
    from interop.commit import write_manifest

    write_manifest(path, manifest)
    for b in (rng, data, sched, shards):
        b.value.fill_(0)
    result = manager.load()
    assert float(rng.value) == 0.0  # dropped
    assert float(data.value) == 2.0  # remapped from saved rank 0
    assert float(sched.value) == 3.0  # replicated state is world-size independent
    assert float(shards.value) == 9.0 * 2 + 200 + 1  # both pieces, old and new sizes
    assert any("'rng' was saved with 2 ranks, now 1: dropped" in n for n in result.notes)
    comps[1].on_world_size_change = WorldSizePolicy.REFUSE  # the current declaration wins over the saved one
    from interop.errors import TopologyError

    with pytest.raises(TopologyError, match="'data' was saved with 2 ranks, now 1; its policy is 'refuse'"):
        manager.load()


def test_failing_get_process_groups_is_reported_not_hung(tmp_path):
    class Broken(Provider):
        def get_process_groups(self):
            raise RuntimeError("no mesh yet")

    with pytest.raises(ComponentError, match=r"get_process_groups\(\) failed on rank 0: RuntimeError: no mesh yet"):
        CheckpointManager(str(tmp_path), Broken([StateComponent("a", Box(1.0), SharingPattern.GLOBAL)])).save(1)


def test_release_mapped_pages_keeps_data_and_never_touches_anonymous_memory(tmp_path):
    """Released pages of a mapped file read back the same; an in-memory tensor is left alone (MADV_DONTNEED
    on anonymous memory would zero it)."""
    from interop.tensors import release_mapped_pages

    data = torch.arange(1 << 20, dtype=torch.float32)
    torch.save({"t": data}, tmp_path / "t.pt")
    mapped = torch.load(tmp_path / "t.pt", mmap=True, weights_only=True)["t"]
    release_mapped_pages(mapped)
    assert torch.equal(mapped, data)  # faulted in again from the file
    anonymous = data.clone()
    release_mapped_pages(anonymous)
    assert torch.equal(anonymous, data)


def test_a_range_of_pieces_is_cut_across_their_boundaries():
    """sub_pieces: bytes lo:hi of what several pieces hold in order, cut across piece boundaries, with each
    part's file offset moved by as much (what a MoE expert inside an engine's flat buffer is copied from)."""
    from interop.tensors import Piece, sub_pieces

    parts = [bytes(range(i, i + n)) for i, n in ((0, 10), (10, 0), (10, 7), (17, 20))]
    pieces = [Piece(memoryview(b), ("f", 100 * k, 1)) for k, b in enumerate(parts)]
    whole = b"".join(parts)
    for lo, hi in ((0, 37), (3, 12), (10, 17), (9, 30), (12, 13), (5, 5)):
        cut = sub_pieces(pieces, lo, hi)
        assert b"".join(bytes(p.data) for p in cut) == whole[lo:hi], (lo, hi)
        assert all(len(p.data) for p in cut)
        starts = [max(lo, sum(map(len, parts[:k]))) - sum(map(len, parts[:k])) + 100 * k
                  for k in range(len(parts)) if max(lo, sum(map(len, parts[:k]))) < min(hi, sum(map(len, parts[:k + 1])))]
        assert [p.source[1] for p in cut] == starts, (lo, hi)


def test_mapped_pieces_are_copied_file_to_file_with_the_same_bytes(tmp_path):
    """A view of a torch.load(mmap=True) file is found in the file it maps (path and offset), and an export
    without digests copies those ranges in the kernel: the file equals the one written through memory, and
    an in-memory tensor mixed in is written the ordinary way."""
    from interop.safetensors_io import TensorEntry, write_safetensors
    from interop.tensors import Piece, TensorSpec, mapped_file_range

    data = torch.arange(3 << 18, dtype=torch.float32)
    torch.save({"t": data}, tmp_path / "t.pt")
    mapped = torch.load(tmp_path / "t.pt", mmap=True, weights_only=True)["t"]
    piece = mapped[1000:(1 << 18) + 1000]
    path, offset, inode = mapped_file_range(piece)
    assert inode == os.stat(path).st_ino
    assert path == str(tmp_path / "t.pt")
    with open(path, "rb") as f:
        f.seek(offset)
        assert f.read(16) == piece[:4].numpy().tobytes()
    assert mapped_file_range(data) is None and mapped_file_range(mapped[::2]) is None

    tail = torch.randn(5, 7)
    views = [piece, mapped[-100:]]
    pieces = lambda: [Piece.of_tensor(v, mapped=True) for v in views]  # noqa: E731
    assert [p.source for p in pieces()] == [(path, offset, inode), mapped_file_range(views[1])]
    entries = [
        TensorEntry("a", TensorSpec((piece.numel() + 100,), torch.float32), lambda: torch.cat(views), pieces),
        TensorEntry("b", TensorSpec((5, 7), torch.float32), lambda: tail),
    ]
    write_safetensors(tmp_path / "copied.safetensors", entries, hashed=False)
    write_safetensors(tmp_path / "through_memory.safetensors", entries, hashed=True)
    assert (tmp_path / "copied.safetensors").read_bytes() == (tmp_path / "through_memory.safetensors").read_bytes()
    from safetensors.torch import load_file

    loaded = load_file(tmp_path / "copied.safetensors")
    assert torch.equal(loaded["a"], torch.cat(views)) and torch.equal(loaded["b"], tail)


def test_an_optimizer_states_repr_reads_no_deferred_scalar():
    """A repr (a log line, a debugger) says what the state holds without reading its scalars: reading them checks
    nearly every block of a DCP file, and a damaged one would fail where nothing asked for them."""
    from interop.logical import DeferredScalars, OptimizerState
    from interop.tensors import LazyTensor

    def unread():
        raise AssertionError("a scalar was read")

    opt = OptimizerState("AdamW", [{"params": ["w"]}], {"exp_avg": {"w": LazyTensor.of(torch.zeros(2))}},
                         DeferredScalars({"step": {"w": unread}}))
    assert repr(opt) == "OptimizerState(AdamW, 1 param groups, parameters per state key: {'exp_avg': 1, 'step': 1})"
    with pytest.raises(AssertionError, match="a scalar was read"):
        opt.scalars
