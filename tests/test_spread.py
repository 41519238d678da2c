"""Conversion by several processes: the byte plan (down to a 1,000-rank plan of a 70B-shaped checkpoint, from
metadata only) and `interop convert --workers N` / torchrun writing exactly the single-process output."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from converters.cli import main
from interop.logical import LogicalCheckpoint, OptimizerState
from interop.safetensors_io import header_bytes
from interop.spread import FileLayout, plan_spans
from interop.tensors import LazyTensor, TensorSpec
from interop.universal import universal_plans
from trainers.base import BaseTrainer, TrainerConfig

from .conftest import ROOT, worker_env


def _metadata_only(shape, dtype=torch.float32) -> LazyTensor:
    def never():
        raise AssertionError("planning read a tensor's bytes")

    return LazyTensor(TensorSpec(tuple(shape), dtype), never, "metadata")


def llama_70b_shaped() -> LogicalCheckpoint:
    """Llama-3-70B's shapes (transformers' own model on the meta device): fp32 weights and two Adam moments."""
    import transformers

    config = transformers.LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                                      num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    moments = {k: {n: _metadata_only(s) for n, s in shapes.items()} for k in ("exp_avg", "exp_avg_sq")}
    return LogicalCheckpoint(model={n: _metadata_only(s) for n, s in shapes.items()},
                             optimizer=OptimizerState("AdamW", [], moments))


def test_a_1000_rank_plan_of_a_70b_checkpoint_writes_every_byte_once_and_balances_the_ranks():
    ckpt = llama_70b_shaped()
    files = [f for p in universal_plans(ckpt) for f in p.files]  # the single-process writer's files, 5 GiB shards
    layouts = [FileLayout(f.rel, len(header_bytes(f.entries, f.metadata)), tuple((e.name, e.spec.nbytes) for e in f.entries))
               for f in files]
    total = sum(f.size for f in layouts)
    assert 840e9 < total < 850e9 and len(layouts) > 150  # ~70.6B parameters x 12 bytes, 5 GiB files
    plan = plan_spans(layouts, 1000)

    by_file: dict[str, list] = {}
    for spans in plan:
        for s in spans:
            by_file.setdefault(s.rel, []).append(s)
    for f in layouts:  # each file's spans tile it exactly: no byte unwritten, none written twice
        spans = sorted(by_file[f.rel], key=lambda s: s.offset)
        assert spans[0].offset == 0 and sum(s.length for s in spans) == f.size
        assert all(a.offset + a.length == b.offset for a, b in zip(spans, spans[1:]))
        position, expected = 0, [(None, f.header)] + list(f.tensors)  # and each span is the tensor bytes at its offset
        ends = {}
        for name, nbytes in expected:
            ends[name] = (position, nbytes)
            position += nbytes
        covered: dict = {}
        for s in spans:
            begin, nbytes = ends[s.tensor]
            assert s.offset == begin + s.start and s.start + s.length <= nbytes
            covered[s.tensor] = covered.get(s.tensor, 0) + s.length
        assert covered == {name: nbytes for name, nbytes in expected}
    per_rank = [sum(s.length for s in spans) for spans in plan]
    mean = total / 1000
    assert max(per_rank) <= 1.1 * mean and min(per_rank) >= 0.9 * mean, (min(per_rank), max(per_rank), mean)
    largest = max(n for f in layouts for _, n in f.tensors)
    assert largest > 4 * mean  # the embedding alone: whole tensors could not have been balanced


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A trained checkpoint with optimizer state, and its single-process conversions (small shards, so tensors and
    files are cut between the processes)."""
    root = tmp_path_factory.mktemp("spread")
    trainer = BaseTrainer(TrainerConfig(steps=2, output_dir=str(root / "run"), tied=True))
    trainer.train()
    trainer.save()
    for fmt in ("universal", "hf"):
        assert main(["convert", str(root / "run"), str(root / f"one-{fmt}"), "--to", fmt, "--max-shard-size", "100KB"]) == 0
    return root


def cli(*argv: str) -> subprocess.CompletedProcess:
    env = worker_env()
    return subprocess.run([sys.executable, "-m", "converters.cli", *argv], env=env, capture_output=True, text=True, timeout=300)


def files_of(directory) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(d, n), directory): open(os.path.join(d, n), "rb").read()
            for d, _, names in os.walk(directory) for n in names}


def same_manifest(a: bytes, b: bytes) -> bool:
    """Equal but for the moment of commit (and the self-digest over it)."""
    da, db = json.loads(a), json.loads(b)
    for m in (da, db):
        m.pop("committed_at"), m.pop("digest")
    return da == db


@pytest.mark.parametrize("fmt,launch", [("universal", "workers"), ("hf", "torchrun")])
def test_several_processes_write_exactly_the_single_process_output(source, fmt, launch):
    out = source / f"three-{fmt}"
    args = ["convert", str(source / "run"), str(out), "--to", fmt, "--max-shard-size", "100KB"]
    if launch == "workers":
        done = cli(*args, "--workers", "3")
    else:
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=3",
                               "-m", "converters.cli", *args], env=dict(worker_env(), OMP_NUM_THREADS="1"),
                              capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("converted ") == 1  # the lead's lines only
    one, three = files_of(source / f"one-{fmt}"), files_of(out)
    assert sorted(one) == sorted(three) and len([f for f in one if f.endswith(".safetensors")]) >= 3
    for rel in one:
        if rel == "manifest.json":
            assert same_manifest(one[rel], three[rel])
        else:
            assert one[rel] == three[rel], rel
    if fmt == "universal":
        assert main(["verify", str(out)]) == 0


def test_a_failure_on_one_rank_is_one_line_and_publishes_nothing(source, tmp_path):
    """A flipped byte in one source shard: whichever process reads it fails, every process stops, one line names the
    file, and neither the output nor a staging directory is left."""
    src = tmp_path / "src"
    import shutil

    shutil.copytree(source / "one-universal", src)
    shard = sorted((src / "optimizer").glob("exp_avg-*.safetensors"))[-1]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01
    shard.write_bytes(bytes(raw))
    done = cli("convert", str(src), str(tmp_path / "out"), "--to", "universal", "--workers", "2")
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and shard.name in lines[0] and "Traceback" not in done.stderr, done.stderr
    assert not (tmp_path / "out").exists() and not [p for p in os.listdir(tmp_path) if p.endswith(".staging")]


def test_a_target_one_process_writes_is_refused_with_workers(source, tmp_path):
    done = cli("convert", str(source / "run"), str(tmp_path / "out"), "--to", "deepspeed", "--workers", "2")
    assert done.returncode == 2 and "--to deepspeed is written by one process" in done.stderr
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("rank", ["0", "1"])
def test_a_group_left_half_set_up_in_the_shell_is_one_line(source, tmp_path, rank):
    """WORLD_SIZE and RANK left in a shell without a launcher's MASTER_ADDR: every rank (not only the lead, which
    speaks for a group that formed) says so in one line and writes nothing, instead of torch's rendezvous error
    passed off as a damaged input."""
    env = {k: v for k, v in worker_env().items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(source / "run"), str(tmp_path / "out"), "--to",
                           "universal"], env=dict(env, WORLD_SIZE="2", RANK=rank), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"interop convert: error: WORLD_SIZE=2 and RANK={rank} are set, so this process would be one of a group, but MASTER_ADDR "
        "and MASTER_PORT are not: start it with torchrun (or --workers N), or unset WORLD_SIZE and RANK to convert in one process"]
    assert not (tmp_path / "out").exists()


class ThreadCollective:
    """Ranks as threads of this process (the spread writer needs all_gather_object only): fast enough to try many
    layouts, while the tests above run real processes."""

    def __init__(self, rank: int, world: int, shared: dict):
        self.rank, self.world_size, self.shared = rank, world, shared

    def all_gather_object(self, obj):
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = obj
        barrier.wait()
        out = list(slots)
        barrier.wait()
        return out

    def barrier(self):
        self.shared["barrier"].wait()


@pytest.mark.parametrize("world", [2, 3, 7])
@pytest.mark.parametrize("source", ["memory", "mapped"])
def test_spread_writer_matches_one_process_with_split_and_empty_tensors(tmp_path, world, source, copied):
    """Tensors cut between ranks, a tensor of no bytes, a file of one small tensor, more ranks than some files have
    pages, from memory or as views of a mapped file (each rank's share of those copied file to file): the files
    and every digest are the single-process writer's."""
    import threading

    from interop.safetensors_io import SafetensorsFile, TensorEntry, write_safetensors
    from interop.spread import Spread, TensorFile, write_tensor_files

    g = torch.Generator().manual_seed(0)
    tensors = {"big": torch.randn(3000, 7, generator=g), "empty": torch.zeros(0, 4), "half": torch.randn(1500, generator=g).half(),
               "ints": torch.arange(2049, dtype=torch.int64), "tiny": torch.ones(1)}
    if source == "mapped":
        write_safetensors(tmp_path / "source.safetensors", [TensorEntry(n, LazyTensor.of(t).spec, lambda t=t: t) for n, t in tensors.items()])
        stored = SafetensorsFile(tmp_path / "source.safetensors")
        lazies = {n: stored.lazy(n) for n in tensors}
    else:
        lazies = {n: LazyTensor.of(t) for n, t in tensors.items()}

    def files():
        entry = lambda n: TensorEntry(n, lazies[n].spec, lazies[n].load, lazies[n].mapped_pieces)  # noqa: E731
        return [TensorFile("a/one.safetensors", [entry(n) for n in ("big", "empty", "half", "ints")], {"format": "pt"}),
                TensorFile("b/two.safetensors", [entry("tiny")], {"format": "pt"})]

    for d in ("one", "many"):
        for sub in ("a", "b"):
            (tmp_path / d / sub).mkdir(parents=True)
    alone = write_tensor_files(str(tmp_path / "one"), files())
    copied_alone = sum(copied)
    shared = {"slots": [None] * world, "barrier": threading.Barrier(world)}
    results, errors = [None] * world, []

    def rank(r):
        try:
            results[r] = write_tensor_files(str(tmp_path / "many"), files(), spread=Spread(ThreadCollective(r, world, shared)))
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
            shared["barrier"].abort()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for rel, written in alone.items():
        assert (tmp_path / "one" / rel).read_bytes() == (tmp_path / "many" / rel).read_bytes(), rel
        for r in range(world):
            assert (results[r][rel].digest, results[r][rel].tensor_digests) == (written.digest, written.tensor_digests)
    # from a mapped file every tensor byte went file to file, alone and spread over the ranks
    assert sum(copied) - copied_alone == copied_alone == (sum(t.nbytes for t in tensors.values()) if source == "mapped" else 0)


def test_a_rank_fetches_the_tensors_after_the_one_it_writes_up_to_the_limit(tmp_path, monkeypatch):
    """A rank's spans are written as one process writes a file: the tensors after the one being written are fetched
    (their source bytes checked) meanwhile while those under way hold less than FETCH_AHEAD_BYTES, never more; the
    file is the single-process writer's."""
    import time

    from interop import spread
    from interop.safetensors_io import TensorEntry, write_safetensors

    tensors = {f"t{i}": torch.full((256, 1024), float(i)) for i in range(8)}  # 1 MiB each
    tensors["big"] = torch.ones(1024, 1024 * 4)  # 16 MiB, then two more small ones
    tensors.update({f"u{i}": torch.full((256, 1024), -float(i)) for i in range(2)})
    names = list(tensors)
    entries = [TensorEntry(n, LazyTensor.of(t).spec, lambda t=t: t) for n, t in tensors.items()]
    reference = write_safetensors(tmp_path / "one.safetensors", entries, {"format": "pt"})
    head = header_bytes(entries, {"format": "pt"})
    layout = FileLayout("spans.safetensors", len(head), tuple((e.name, e.spec.nbytes) for e in entries))
    (tmp_path / "spans.safetensors").write_bytes(b"\0" * layout.size)
    spans = plan_spans([layout], 1)[0]  # one rank: every span of the file, header first
    monkeypatch.setattr(spread, "FETCH_AHEAD_BYTES", 4 << 20)
    written, ahead = [], {}
    real = spread.fetch_pieces
    monkeypatch.setattr(spread, "fetch_pieces", lambda e: (ahead.__setitem__(e.name, names.index(e.name) - len(written)), real(e))[1])
    done = spread._write_spans(str(tmp_path), spans, {layout.rel: head}, {(layout.rel, e.name): e for e in entries},
                               {(layout.rel, e.name): 1 for e in entries}, True,
                               lambda e: (time.sleep(0.05), written.append(e.name)))  # a slow writer: the fetches get ahead
    assert max(ahead.values()) == 4  # 1 MiB each, under way while less than 4 MiB is: four after the one being written
    assert ahead["u0"] == 1 and ahead["u1"] <= 2  # behind the 16 MiB tensor, nothing else was fetched
    assert written == names
    assert (tmp_path / "spans.safetensors").read_bytes() == (tmp_path / "one.safetensors").read_bytes()
    assert [done[(layout.rel, n)] for n in names] == [reference.tensor_digests[n] for n in names]
