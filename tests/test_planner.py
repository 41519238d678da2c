"""The planner at simulated scale, and load resolution across topologies (no processes)."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from interop.errors import ComponentError, TopologyError
from interop.planner import plan_save, resolve_load
from interop.state import ComponentSpec, SharingPattern as P, WorldSizePolicy as W
from interop.topology import Topology

SPECS = [
    ComponentSpec("model", P.PER_GROUP, group="dp", policy=W.RESHARD),  # identical within a DP group
    ComponentSpec("optimizer", P.PER_RANK, policy=W.REFUSE),
    ComponentSpec("scheduler", P.REPLICATED),
    ComponentSpec("data", P.PER_GROUP, group="tp", policy=W.REMAP),  # one batch per TP group
    ComponentSpec("rng", P.PER_RANK, policy=W.RESEED),
    ComponentSpec("cache", P.PER_NODE, policy=W.DROP),
    ComponentSpec("trainer", P.GLOBAL),
]


@pytest.fixture(scope="module")
def big():
    return Topology.mesh({"pp": 8, "dp": 64, "tp": 8}, ranks_per_node=8)


def test_4096_ranks_every_piece_written_once_and_every_rank_knows_its_reads(big):
    assert big.world_size == 4096 and big.num_nodes == 512
    started = time.perf_counter()
    plan = plan_save(SPECS, big)
    elapsed = time.perf_counter() - started
    bases = [p.base for p in plan.pieces]
    assert len(bases) == len(set(bases)), "a piece of state would be written twice"
    per_component = Counter(p.component for p in plan.pieces)
    assert per_component == {"model": 64, "optimizer": 4096, "scheduler": 1, "data": 512, "rng": 4096, "cache": 512, "trainer": 1}
    for piece in plan.pieces:
        assert piece.writer in piece.readers
    # every rank reads exactly one piece of every component, and the pieces it reads hold its own state
    for rank in range(big.world_size):
        reads = Counter(p.component for p in plan.reads_of(rank))
        assert reads == {s.key: 1 for s in SPECS}, rank
    # writers: lowest rank of the group, local rank 0 of the node, rank 0 for global state
    model_pieces = [p for p in plan.pieces if p.component == "model"]
    assert all(p.writer == min(p.readers) and len(p.readers) == 64 for p in model_pieces)
    assert all(p.writer % 8 == 0 for p in plan.pieces if p.component == "cache")
    assert {p.writer for p in plan.pieces if p.component in ("scheduler", "trainer")} == {0}
    # the DP family of a Megatron-order mesh (tp fastest): ranks that differ only in the dp coordinate
    dp0 = big.family("dp")[0]
    assert dp0[:3] == (0, 8, 16) and len(dp0) == 64
    assert big.family("tp")[0] == tuple(range(8))
    assert big.family("pp")[0] == tuple(range(0, 4096, 512))
    total_writes = sum(len(plan.writes_of(r)) for r in range(big.world_size))
    assert total_writes == len(plan.pieces)
    assert elapsed < 10, f"planning 4096 ranks took {elapsed:.1f}s"


def test_load_at_the_same_topology_reads_the_saved_piece(big):
    plan = plan_save(SPECS, big)
    for rank in (0, 1, 777, 4095):
        for spec in SPECS:
            action = resolve_load(spec, big, big, rank)
            (mine,) = [p.base for p in plan.reads_of(rank) if p.component == spec.key]
            assert action.kind == "load" and action.bases == (mine,)


def test_load_at_half_the_data_parallel_size_applies_each_policy(big):
    small = Topology.mesh({"pp": 8, "dp": 32, "tp": 8}, ranks_per_node=8)
    by_key = {s.key: s for s in SPECS}
    with pytest.raises(TopologyError, match=r"PER_RANK component 'optimizer' was saved with 4096 ranks, now 2048; its policy is 'refuse'"):
        resolve_load(by_key["optimizer"], big, small, 5)
    assert resolve_load(by_key["rng"], big, small, 5).kind == "reseed"
    assert resolve_load(by_key["cache"], big, small, 5).kind == "drop"
    reshard = resolve_load(by_key["model"], big, small, 5)
    assert reshard.kind == "reshard" and len(reshard.bases) == 64
    remap = resolve_load(by_key["data"], big, small, 2047)
    assert remap.kind == "load" and remap.bases == ("groups/tp/00255/data",)
    assert resolve_load(by_key["scheduler"], big, small, 5).bases == ("components/scheduler",)
    assert "remapped" in remap.note


def test_replicated_state_refusing_a_new_world_size():
    spec = ComponentSpec("s", P.REPLICATED, policy=W.REFUSE)
    with pytest.raises(TopologyError, match="saved with 4 ranks \\(world size\\), now 2"):
        resolve_load(spec, Topology.uniform(4), Topology.uniform(2), 0)


def test_missing_group_names_component_and_group():
    with pytest.raises(ComponentError, match=r"component 'data' is PER_GROUP over process group 'dp'"):
        plan_save([ComponentSpec("data", P.PER_GROUP, group="dp")], Topology.uniform(4))


def test_duplicate_keys_refused():
    with pytest.raises(ComponentError, match="declared twice"):
        plan_save([ComponentSpec("a", P.GLOBAL), ComponentSpec("a", P.PER_RANK)], Topology.uniform(2))


def test_topology_rejects_a_family_that_is_not_a_partition():
    with pytest.raises(TopologyError, match="exactly one group"):
        Topology.uniform(4, groups={"dp": ((0, 1), (1, 2, 3))})


def test_topology_json_round_trip(big):
    assert Topology.from_json(big.to_json()) == big
    odd = Topology(4, (0, 1, 0, 1), {"x": ((0, 1), (2, 3))})
    assert Topology.from_json(odd.to_json()) == odd
    assert odd.node_leader(1) == 1 and odd.node_ranks(0) == (0, 2)
