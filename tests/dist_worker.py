"""Worker for the multi-process tests, started by torchrun on a real gloo group.

    torchrun --nproc_per_node 4 tests/dist_worker.py core OUT
    torchrun --nnodes 2 --node_rank N --nproc_per_node 2 ... tests/dist_worker.py nodes OUT
    torchrun --nproc_per_node 2 tests/dist_worker.py kill:<point> OUT
    torchrun --nproc_per_node 2 tests/dist_worker.py kill-async:<seed> OUT

Each rank asserts what it can see itself and writes OUT/result-<rank>.json for the test to check.
"""

from __future__ import annotations

import json
import os
import signal
import sys

import torch
import torch.distributed as dist

from interop import CheckpointManager, SharingPattern, StateComponent, WorldSizePolicy
from interop.errors import ReplicationError, SaveFailedError


class Box:
    """A stateful holding one tensor and a scalar."""

    def __init__(self, value: float):
        self.value = torch.full((3,), float(value))
        self.tag = "init"

    def state_dict(self):
        return {"value": self.value.clone(), "tag": self.tag}

    def load_state_dict(self, state):
        self.value = state["value"].clone()
        self.tag = state["tag"]


class LiveBox(Box):
    """A Box whose state_dict hands out its live tensor, as a module's or an optimizer's does."""

    def state_dict(self):
        return {"value": self.value, "tag": self.tag}


class Provider:
    def __init__(self, components, groups=None):
        self.components = components
        self.groups = groups or {}

    def get_state_components(self):
        return self.components

    def get_process_groups(self):
        return self.groups


def mesh_groups(rank: int, world: int) -> dict:
    """2 x 2 mesh: 'dp' groups {0,2},{1,3}; 'tp' groups {0,1},{2,3}. Every rank creates every group."""
    groups = {}
    for name, parts in {"dp": [[0, 2], [1, 3]], "tp": [[0, 1], [2, 3]]}.items():
        for ranks in parts:
            pg = dist.new_group(ranks)
            if rank in ranks:
                groups[name] = pg
    return groups


def core(out: str, rank: int, world: int) -> dict:
    result: dict = {}
    groups = mesh_groups(rank, world)
    boxes = {
        "g": Box(100 + rank),  # GLOBAL: only rank 0's copy is meaningful
        "rep": Box(7.0),  # REPLICATED: identical everywhere
        "pr": Box(rank),  # PER_RANK
        "dp": Box(1000 + min(dist.get_process_group_ranks(groups["dp"]))),  # PER_GROUP over dp
        "tp": Box(2000 + min(dist.get_process_group_ranks(groups["tp"]))),  # PER_GROUP over tp
        "node": Box(3000),  # PER_NODE (one node here)
        "dyn": Box(4000 + rank),  # dynamic pattern, resolves to PER_RANK
    }
    comps = [
        StateComponent("g", boxes["g"], SharingPattern.GLOBAL),
        StateComponent("rep", boxes["rep"], SharingPattern.REPLICATED, validate_replication=True),
        StateComponent("pr", boxes["pr"], SharingPattern.PER_RANK),
        StateComponent("dp", boxes["dp"], SharingPattern.PER_GROUP, process_group_name="dp", validate_replication=True),
        StateComponent("tp", boxes["tp"], SharingPattern.PER_GROUP, process_group_name="tp", validate_replication=True),
        StateComponent("node", boxes["node"], SharingPattern.PER_NODE),
        StateComponent("dyn", boxes["dyn"], lambda: SharingPattern.PER_RANK),
    ]
    saved = {k: b.value.clone() for k, b in boxes.items()}
    manager = CheckpointManager(os.path.join(out, "patterns"), Provider(comps, groups))
    path = manager.save(5)
    for b in boxes.values():
        b.value.zero_()
        b.tag = "clobbered"
    manager.load()
    expect = dict(saved)
    expect["g"] = torch.full((3,), 100.0)  # everyone loads rank 0's copy
    for key, box in boxes.items():
        assert torch.equal(box.value, expect[key]), (key, rank, box.value, expect[key])
        assert box.tag == "init"
    result["patterns_path"] = path

    # A replica made to differ on one rank is caught on every rank, naming that rank.
    rep = Box(7.0)
    if rank == 2:
        rep.value[1] = 7.5
    bad = CheckpointManager(os.path.join(out, "mismatch"), Provider([StateComponent("weights", rep, SharingPattern.REPLICATED, validate_replication=True)]))
    try:
        bad.save(1)
        raise AssertionError("replication mismatch not detected")
    except ReplicationError as exc:
        result["mismatch_error"] = str(exc)
    assert not os.path.exists(os.path.join(out, "mismatch", "checkpoint-1"))

    # One rank failing while writing fails the save on every rank; the previous checkpoint still loads.
    state = Box(11.0)
    per_rank = Box(rank)
    fail_comps = [StateComponent("state", state, SharingPattern.REPLICATED), StateComponent("mine", per_rank, SharingPattern.PER_RANK)]
    mgr = CheckpointManager(os.path.join(out, "fail"), Provider(fail_comps))
    mgr.save(1)
    state.value.fill_(22.0)
    if rank == 3:
        per_rank.state_dict = lambda: {"value": object()}  # not representable without pickle: fails in the write phase
    try:
        mgr.save(2)
        raise AssertionError("failure on rank 3 did not fail the save")
    except SaveFailedError as exc:
        result["fail_error"] = str(exc)
    dist.barrier()
    if rank == 3:
        del per_rank.state_dict
    state.value.zero_()
    loaded = mgr.load()
    assert loaded.step == 1 and torch.equal(state.value, torch.full((3,), 11.0)), state.value
    assert torch.equal(per_rank.value, torch.full((3,), float(rank)))
    return result


def nodes(out: str, rank: int, world: int) -> dict:
    node = int(os.environ["GROUP_RANK"])
    cache, mine = Box(500 + node), Box(rank)
    comps = [
        StateComponent("cache", cache, SharingPattern.PER_NODE, validate_replication=True),
        StateComponent("mine", mine, SharingPattern.PER_RANK),
    ]
    manager = CheckpointManager(os.path.join(out, "nodes"), Provider(comps))
    manager.save(3)
    cache.value.zero_()
    mine.value.zero_()
    manager.load()
    assert torch.equal(cache.value, torch.full((3,), 500.0 + node)), (rank, cache.value)
    assert torch.equal(mine.value, torch.full((3,), float(rank)))
    return {"node": node, "local_rank": int(os.environ["LOCAL_RANK"])}


KILL_POINTS = ("during_write", "before_manifest", "after_manifest", "after_publish", "after_latest")


def kill(out: str, rank: int, world: int, point: str) -> dict:
    import interop.checkpoint as ckpt_mod

    a, r = Box(1.0), Box(10.0 + rank)
    comps = [
        StateComponent("a", a, SharingPattern.REPLICATED),
        StateComponent("r", r, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.REMAP),
    ]
    manager = CheckpointManager(os.path.join(out, "run"), Provider(comps), keep_last=1)
    manager.save(1)
    a.value.fill_(2.0)
    r.value.fill_(20.0 + rank)

    def die():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    def after(fn):
        def wrapped(*args, **kwargs):
            value = fn(*args, **kwargs)
            die()
            return value

        return wrapped

    if point == "during_write" and rank == 1:
        real = ckpt_mod.write_piece
        ckpt_mod.write_piece = lambda *args, **kw: (real(*args, **kw), die())
    elif point == "before_manifest" and rank == 0:
        ckpt_mod.write_manifest = lambda *args, **kw: die()
    elif point == "after_manifest" and rank == 0:
        ckpt_mod.write_manifest = after(ckpt_mod.write_manifest)
    elif point == "after_publish" and rank == 0:
        ckpt_mod.publish = after(ckpt_mod.publish)
    elif point == "after_latest" and rank == 0:
        ckpt_mod.write_latest = after(ckpt_mod.write_latest)
    manager.save(2)
    raise AssertionError(f"kill point {point} was never reached")


def kill_async(out: str, rank: int, world: int, seed: int) -> dict:
    """Staged background saves (``save(wait=False, stage=True)``) every step while the state keeps changing in
    place, until one rank is SIGKILLed at a random moment: at step s the replicated value is s everywhere and
    rank r's own value is 10 s + r; right after each save returns the live tensors are overwritten (-1, then the
    next step's values), as the next training step would."""
    import random
    import threading
    import time

    rng = random.Random(seed)
    victim, delay = rng.randrange(world), rng.uniform(0.05, 1.5)
    a, r = LiveBox(0.0), LiveBox(0.0)
    comps = [
        StateComponent("a", a, SharingPattern.REPLICATED),
        StateComponent("r", r, SharingPattern.PER_RANK, on_world_size_change=WorldSizePolicy.REMAP),
    ]
    manager = CheckpointManager(os.path.join(out, "run"), Provider(comps), keep_last=2)

    def die():
        sys.stdout.flush()
        os.kill(os.getpid(), signal.SIGKILL)

    dist.barrier()
    if rank == victim:
        threading.Timer(delay, die).start()
    for step in range(1, 100000):
        a.value.fill_(float(step))
        r.value.fill_(10.0 * step + rank)
        manager.save(step, wait=False, stage=True)
        a.value.fill_(-1.0)
        r.value.fill_(-1.0)
        time.sleep(0.001)
    raise AssertionError("never killed")


def main() -> None:
    scenario, out = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if scenario == "core":
        result = core(out, rank, world)
    elif scenario == "nodes":
        result = nodes(out, rank, world)
    elif scenario.startswith("kill:"):
        result = kill(out, rank, world, scenario.split(":", 1)[1])
    elif scenario.startswith("kill-async:"):
        result = kill_async(out, rank, world, int(scenario.split(":", 1)[1]))
    else:
        raise SystemExit(f"unknown scenario {scenario}")
    with open(os.path.join(out, f"result-{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
