"""Accelerate DDP and FSDP2 with real accelerate and torch on CPU processes: our trainer, our converters against
accelerator.load_state and `accelerate merge-weights`, resume across process counts and layouts, torch DCP
read and written offline, and bad input."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

pytest.importorskip("accelerate", reason="Accelerate tests need accelerate (pip install 'interop[accelerate]')")

from converters.accelerate import read_accelerate  # noqa: E402
from converters.dcp import DCPReader, read_metadata, unflatten_lists, write_dcp  # noqa: E402
from converters.registry import detect, read  # noqa: E402
from interop.errors import ConversionError, CorruptCheckpointError, MissingFileError, UnsafePickleError  # noqa: E402
from interop.tensors import LazyTensor  # noqa: E402

from .conftest import ROOT, free_port, held_commit_cmd, native_files, reseal, run_workers, worker_env  # noqa: E402
from .odd_model import FROZEN  # noqa: E402

pytestmark = pytest.mark.dist
ACC_WORKER = str(ROOT / "tests" / "acc_worker.py")
TIED = ["lm_head.weight", "model.embed_tokens.weight"]
RUN = ["--steps", "4", "--save-every", "2", "--batch-size", "4", "--seq-len", "16"]


def acc_run(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", ACC_WORKER, *args]
    return run_workers(cmd, worker_env(), timeout)


def last_json(result: subprocess.CompletedProcess) -> dict:
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converters.cli", *args], env=worker_env(), capture_output=True, text=True)


def convert(src, dst, *args: str) -> None:
    result = cli("convert", str(src), str(dst), *args)
    assert result.returncode == 0, result.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """DDP and FSDP2 on 2 processes, 4 steps, checkpoints at 2 and 4: the uninterrupted runs."""
    out = tmp_path_factory.mktemp("acc")
    found = {}
    for layout, flags in (("ddp", []), ("fsdp", ["--fsdp"])):
        run = last_json(acc_run(2, "train", *RUN, *flags, "--output-dir", str(out / layout)))
        found[layout] = (out / layout, run["losses"])
    return found


def logical(path) -> dict[str, torch.Tensor]:
    _, ckpt = read(str(path))
    return {k: t.load() for k, t in ckpt.tensors()}


# --- the compatibility shim -------------------------------------------------------------------------------
def test_cpu_fsdp_shim_relies_on_what_accelerate_still_does():
    """The shim wraps AcceleratorState.__init__ and reads the plugin from its keyword arguments; if accelerate
    renames or moves any of this, the shim would silently stop applying: this fails first."""
    import inspect

    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    assert "fsdp_plugin" in inspect.signature(AcceleratorState.__init__).parameters
    assert "fsdp_plugin=fsdp_plugin" in inspect.getsource(Accelerator.__init__).replace(" ", "")
    assert hasattr(PartialState, "_shared_state") and {"MULTI_CPU", "FSDP"} <= set(DistributedType.__members__)
    state_src = inspect.getsource(AcceleratorState.__init__)
    assert "self.fsdp_plugin = fsdp_plugin" in state_src  # still only set on the GPU-like branch the shim extends
    assert "DistributedType.MULTI_GPU" in state_src


def test_fsdp2_runs_on_cpu_processes_and_matches_ddp(runs):
    ddp_dir, ddp_losses = runs["ddp"]
    fsdp_dir, fsdp_losses = runs["fsdp"]
    ours = ["components", "manifest.json", "ranks"]  # beside accelerate's files, which load_state(checkpoint) reads
    assert sorted(os.listdir(fsdp_dir / "checkpoint-4")) == sorted(ours + [
        "optimizer_0", "pytorch_model_fsdp_0", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"])
    assert sorted(os.listdir(ddp_dir / "checkpoint-4")) == sorted(ours + [
        "model.safetensors", "optimizer.bin", "random_states_0.pkl", "random_states_1.pkl", "scheduler.bin"])
    # The same model, data and optimizer sharded two ways: the same losses up to float rounding.
    assert fsdp_losses == pytest.approx(ddp_losses, rel=1e-5)
    manifest = json.loads((fsdp_dir / "checkpoint-4" / "manifest.json").read_text())
    assert manifest["sharding"]["strategy"] == "fsdp" and manifest["optimizer"]["scheduler_steps_per_step"] == 2


# --- reading our trainer's checkpoints --------------------------------------------------------------------
def test_fsdp2_is_read_without_torch_and_checked_only_where_it_is_read(runs, tmp_path):
    """An FSDP2 checkpoint is read with torch unimportable (DCP's metadata into stand-ins, each chunk's bytes
    where they lie in its file, the step and the scheduler from their bytes): the same tensors, scalars and
    scheduler as read with torch. With its data files recorded block by block, an HF export is byte for byte the
    ordinary one and checks only the blocks it reads: a flipped byte in an optimizer moment it never reads
    leaves it exact, while verify and a conversion that reads the moments refuse it, naming the file."""
    from converters.cli import main
    from interop import digests
    from interop.tensors import raw_bytes

    from .conftest import by_blocks

    src = tmp_path / "ckpt"
    shutil.copytree(runs["fsdp"][0] / "checkpoint-4", src)
    convert(src, tmp_path / "hf0", "--to", "hf")
    exported = {p.name: p.read_bytes() for p in (tmp_path / "hf0").iterdir()}
    for dcp_dir in ("pytorch_model_fsdp_0", "optimizer_0"):  # the stand-ins say what DCP's own types say
        real, stub = read_metadata(str(src / dcp_dir)), read_metadata(str(src / dcp_dir), stubs=True)
        assert sorted(real.state_dict_metadata) == sorted(stub.state_dict_metadata)
        for key, md in real.state_dict_metadata.items():
            other = stub.state_dict_metadata[key]
            if hasattr(md, "chunks"):
                assert (tuple(md.size), str(md.properties.dtype)) == (tuple(other.size), f"torch.{other.properties.dtype}")
                assert [(tuple(c.offsets), tuple(c.sizes)) for c in md.chunks] == [(tuple(c.offsets), tuple(c.sizes)) for c in other.chunks]
        assert sorted((i.fqn, tuple(i.offset or ()), v.relative_path, v.offset, v.length) for i, v in real.storage_data.items()) == \
               sorted((i.fqn, tuple(i.offset or ()), v.relative_path, v.offset, v.length) for i, v in stub.storage_data.items())
    blocked = by_blocks(src, 512)
    assert "optimizer_0/__0_0.distcp" in blocked and "pytorch_model_fsdp_0/__0_0.distcp" in blocked
    assert main(["convert", str(src), str(tmp_path / "hf1"), "--to", "hf"]) == 0  # checked block by block
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf1").iterdir()} == exported
    # read with torch unimportable (this model's own names would ask transformers, which needs torch, to rename),
    # and numpy (70 ms of import: the scheduler's pickle is allowed numpy's RNG types, but names none of them)
    probe = ("import sys, json; sys.modules['torch'] = sys.modules['numpy'] = None\n"
             "from converters.accelerate import read_accelerate\nfrom interop import digests\n"
             "c = read_accelerate(sys.argv[1])\n"
             "print(json.dumps([{n: digests.of_bytes(b''.join(bytes(p.data) for p in t.mapped_pieces())) for n, t in c.model.items()},"
             " c.optimizer.scalars, c.extra_state['scheduler']]))")
    done = subprocess.run([sys.executable, "-c", probe, str(src)], env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    ckpt = read_accelerate(str(src))
    expected = [{n: digests.of_bytes(raw_bytes(t.load())) for n, t in ckpt.model.items()}, ckpt.optimizer.scalars,
                ckpt.extra_state["scheduler"]]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == json.loads(json.dumps(expected))

    reader = DCPReader(str(src / "optimizer_0"))
    chunk = max((c for k, cs in reader._chunks.items() if k.endswith("exp_avg_sq") for c in cs), key=lambda c: c.length)
    rel = f"optimizer_0/{chunk.file}"
    lo = (chunk.offset // 512 + 3) * 512  # a block wholly inside the moment's chunk, two clear of its ends
    assert lo + 3 * 512 <= chunk.offset + chunk.length, "the chunk is too small to hold a block of its own"
    data = bytearray((src / rel).read_bytes())
    original = bytes(data)
    data[lo + 100] ^= 0x01
    (src / rel).write_bytes(bytes(data))
    assert main(["convert", str(src), str(tmp_path / "hf2"), "--to", "hf"]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf2").iterdir()} == exported
    assert main(["verify", str(src), "-q"]) == 1
    failed = cli("convert", str(src), str(tmp_path / "uni"), "--to", "universal")
    assert failed.returncode == 2 and rel.split("/")[-1] in failed.stderr and "differ from the manifest" in failed.stderr, failed.stderr
    assert not (tmp_path / "uni").exists()
    (src / rel).write_bytes(original)
    # a parameter's step lies between moments: an HF export reads no optimizer value, so not even its block
    step = next(c for k, cs in reader._chunks.items() if k.endswith(".step") for c in cs)
    rel = f"optimizer_0/{step.file}"
    data = bytearray(original if rel == f"optimizer_0/{chunk.file}" else (src / rel).read_bytes())
    data[step.offset] ^= 0x01
    (src / rel).write_bytes(bytes(data))
    assert main(["convert", str(src), str(tmp_path / "hf3"), "--to", "hf"]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf3").iterdir()} == exported
    failed = cli("convert", str(src), str(tmp_path / "uni"), "--to", "universal")
    assert failed.returncode == 2 and "differ from the manifest" in failed.stderr, failed.stderr



def test_ddp_and_fsdp2_checkpoints_read_the_same(runs):
    """After 4 steps the DDP and FSDP2 runs hold (to rounding) the same weights and optimizer state: both read
    into one logical layout, frozen parameters and the tied pair included, step and scheduler engine-neutral."""
    ddp = read_accelerate(str(runs["ddp"][0] / "checkpoint-4"))
    fsdp = read_accelerate(str(runs["fsdp"][0] / "checkpoint-4"))
    assert sorted(ddp.model) == sorted(fsdp.model) and "lm_head.weight" not in ddp.model
    assert ddp.tied == fsdp.tied == [TIED]
    assert ddp.frozen == fsdp.frozen and all(n.startswith(FROZEN) for n in ddp.frozen) and len(ddp.frozen) == 3
    for name in ddp.model:
        torch.testing.assert_close(ddp.model[name].load(), fsdp.model[name].load(), rtol=1e-4, atol=1e-6)
    assert [g["params"] for g in ddp.optimizer.param_groups] == [g["params"] for g in fsdp.optimizer.param_groups]
    assert [g["weight_decay"] for g in ddp.optimizer.param_groups] == [0.1, 0.0]
    for key in ("exp_avg", "exp_avg_sq"):
        assert sorted(ddp.optimizer.tensors[key]) == sorted(fsdp.optimizer.tensors[key])
    assert {e["value"] for e in ddp.optimizer.scalars["step"].values()} == {4.0}
    for ckpt in (ddp, fsdp):  # accelerate stepped the scheduler twice per step; the logical one counts steps
        assert ckpt.step == 4 and ckpt.extra_state["scheduler"]["last_epoch"] == 4


# --- accelerator.load_state on what we write ----------------------------------------------------------------
# by default FSDP2 on 2 processes; DDP's load_state of our output runs in test_resume_matches_uninterrupted_run's fsdp -> ddp row
@pytest.mark.parametrize("source,fsdp,world", [pytest.param("universal", False, 1, marks=pytest.mark.slow),
                                               pytest.param("fsdp", False, 2, marks=pytest.mark.slow),
                                               pytest.param("universal", True, 1, marks=pytest.mark.slow), ("ddp", True, 2)],
                         ids=["universal-ddp1", "fsdp2-ddp2", "universal-fsdp2_1", "ddp2-fsdp2_2"])
def test_accelerator_load_state_accepts_ours(runs, tmp_path, source, fsdp, world):
    """Step 2 of a 2-process run (DDP or FSDP2, directly or through universal) -> accelerate layout for `world`
    processes. A plain accelerate script (no interop code) load_state()s it into a freshly initialised model:
    every weight, optimizer tensor and step, and the scheduler are the checkpoint's, bit for bit. Our trainer
    resumed from it continues the uninterrupted run (exactly on 2 processes and the same layout, else to float
    rounding), and `accelerate merge-weights` takes the FSDP2 files we wrote."""
    run_dir, losses = runs["ddp" if source == "ddp" else "fsdp"]
    src = run_dir / "checkpoint-2"
    if source == "universal":
        convert(src, tmp_path / "universal", "--to", "universal")
        src = tmp_path / "universal"
    out = tmp_path / "acc"
    convert(src, out, "--to", "accelerate", "--world-size", str(world), *(["--fsdp"] if fsdp else []))
    gathered = tmp_path / "gathered.pt"
    acc_run(world, "load_state", str(out), str(gathered), *(["--fsdp"] if fsdp else []))
    state = torch.load(gathered, weights_only=False)
    assert state["distributed_type"] == ("FSDP" if fsdp else "MULTI_CPU")  # torchrun: a process group even of one
    expected = logical(src)
    for name, tensor in state["model"].items():
        source = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(tensor, expected[source]), name
    opt = state["optimizer"]
    for name, entries in opt["state"].items():
        assert torch.equal(entries["exp_avg"], expected[f"optimizer/exp_avg/{name}"]), name
        assert torch.equal(entries["exp_avg_sq"], expected[f"optimizer/exp_avg_sq/{name}"]), name
        assert float(entries["step"]) == 2.0
    assert len(opt["state"]) == sum(1 for k in expected if k.startswith("optimizer/exp_avg/"))
    assert [g["weight_decay"] for g in opt["param_groups"]] == [0.1, 0.0]
    assert state["scheduler"]["last_epoch"] == 2 * world  # two optimizer steps, stepped once per process

    flags = ["--fsdp"] if fsdp else []
    result = acc_run(world, "train", *RUN, *flags, "--output-dir", str(tmp_path / "r"), "--resume", str(out))
    assert "converting" not in result.stderr  # our files were for this layout: the trainer called load_state on them
    resumed = last_json(result)["losses"]
    if world == 2 and fsdp == (source != "ddp"):
        assert resumed == losses[2:]
    else:
        assert resumed == pytest.approx(losses[2:], rel=1e-5)
    if fsdp:
        merged = subprocess.run(["accelerate", "merge-weights", str(out / "pytorch_model_fsdp_0"),
                                 str(tmp_path / "merged")], env=worker_env(), capture_output=True, text=True)
        assert merged.returncode == 0, merged.stderr
        from safetensors.torch import load_file

        for name, tensor in load_file(str(tmp_path / "merged" / "model.safetensors")).items():
            assert torch.equal(tensor, expected["model.embed_tokens.weight" if name == "lm_head.weight" else name]), name


# --- resume across process counts and layouts ---------------------------------------------------------------
@pytest.mark.parametrize("source,target,world", [pytest.param("ddp", "ddp", 2, marks=pytest.mark.slow),  # exact DDP and
                                                  pytest.param("fsdp", "fsdp", 2, marks=pytest.mark.slow),  # FSDP2 resumes: local SGD, bf16 tests
                                                  pytest.param("ddp", "fsdp", 1, marks=pytest.mark.slow), ("fsdp", "ddp", 1)],
                         ids=["ddp2-ddp2", "fsdp2-fsdp2", "ddp2-fsdp1", "fsdp2-ddp1"])  # 2 -> 1 across strategies: one row in CI
def test_resume_matches_uninterrupted_run(runs, tmp_path, source, target, world):
    """Our trainer resumes from step 2 of a 2-process run: on the same layout the next losses are the
    uninterrupted run's exactly; on another process count or layout (converted in-process) to float rounding."""
    directory, losses = runs[source]
    flags = ["--fsdp"] if target == "fsdp" else []
    resumed = last_json(acc_run(world, "train", *RUN, *flags, "--output-dir", str(tmp_path / "r"),
                                "--resume", str(directory / "checkpoint-2")))["losses"]
    if (source, world) == (target, 2):
        assert resumed == losses[2:]
    else:
        assert resumed == pytest.approx(losses[2:], rel=1e-5)


@pytest.mark.slow  # the suite's time: growing the world through a conversion is the resume matrix's FSDP2 -> TP2xPP2
def test_resume_one_process_to_two_through_universal(runs, tmp_path):
    """1 -> 2 processes: a 1-process DDP run's checkpoint, through universal and `--to accelerate --world-size 2
    --fsdp`, resumes on 2 FSDP2 processes with the 1-process run's losses (to rounding)."""
    one = last_json(acc_run(1, "train", *RUN, "--output-dir", str(tmp_path / "one")))
    convert(tmp_path / "one" / "checkpoint-2", tmp_path / "u", "--to", "universal")
    convert(tmp_path / "u", tmp_path / "two", "--to", "accelerate", "--world-size", "2", "--fsdp")
    resumed = last_json(acc_run(2, "train", *RUN, "--fsdp", "--output-dir", str(tmp_path / "r"),
                                "--resume", str(tmp_path / "two")))["losses"]
    assert resumed == pytest.approx(one["losses"][2:], rel=1e-5)


# --- accelerate's own tools ---------------------------------------------------------------------------------
@pytest.mark.slow  # merge-weights on our FSDP2 files: test_accelerator_load_state_accepts_ours
def test_accelerate_merge_weights_equals_our_hf_export(runs, tmp_path):
    ckpt = runs["fsdp"][0] / "checkpoint-4"
    merged = tmp_path / "merged"
    result = subprocess.run(["accelerate", "merge-weights", str(ckpt / "pytorch_model_fsdp_0"), str(merged)],
                            env=worker_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    convert(ckpt, tmp_path / "hf", "--to", "hf")
    from safetensors.torch import load_file

    theirs = load_file(str(merged / "model.safetensors"))
    ours = load_file(str(tmp_path / "hf" / "model.safetensors"))
    assert set(theirs) - set(ours) == {"lm_head.weight"}  # merge-weights keeps the tied copy; save_pretrained does not
    for name, tensor in ours.items():
        assert torch.equal(tensor, theirs[name]), name
    assert torch.equal(theirs["lm_head.weight"], ours["model.embed_tokens.weight"])


# --- torch DCP ----------------------------------------------------------------------------------------------
def test_dcp_reader_equals_torch_dcp_to_torch_save(runs, tmp_path):
    """Our process-group-free reader against torch's own offline converter, every entry; and a region read
    touches only the chunks it overlaps."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = runs["fsdp"][0] / "checkpoint-4" / "optimizer_0"
    dcp_to_torch_save(str(directory), str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    reader = DCPReader(str(directory))
    for key, path in reader.paths.items():
        node = ref
        for part in path:
            node = node[part]
        value = reader.read(key) if key in reader.tensor_keys() else reader.read_object(key)
        if isinstance(value, torch.Tensor):
            assert torch.equal(value, node), key
        else:
            assert value == node, key
    key = "optimizer.state.model.embed_tokens.weight.exp_avg"
    full = reader.read(key)
    assert torch.equal(reader.read(key, (100, 3), (60, 20)), full[100:160, 3:23])  # spans both ranks' chunks


def test_dcp_written_offline_loads_with_torch_dcp_and_converts_with_cli(runs, tmp_path):
    src = runs["ddp"][0] / "checkpoint-4"
    convert(src, tmp_path / "dcp", "--to", "dcp")
    assert detect(str(tmp_path / "dcp")).name == "dcp"
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(str(tmp_path / "dcp"), str(tmp_path / "ref.pt"))
    ref = torch.load(tmp_path / "ref.pt", weights_only=False)
    source = logical(src)
    for name, tensor in ref["model"].items():
        assert torch.equal(tensor, source["model.embed_tokens.weight" if name == "lm_head.weight" else name]), name
    for name, entries in ref["optimizer"]["state"].items():
        assert torch.equal(entries["exp_avg"], source[f"optimizer/exp_avg/{name}"]), name
    back = logical(tmp_path / "dcp")
    assert back.keys() == source.keys() and all(torch.equal(back[k], source[k]) for k in source)


def test_write_dcp_streams_one_tensor_at_a_time(tmp_path):
    loaded = []

    def lazy(name, value):
        return LazyTensor(LazyTensor.of(value).spec, lambda: loaded.append(name) or value)

    tensors = {f"w{i}": torch.full((3, 5), float(i)) for i in range(4)}
    write_dcp({"model": {n: lazy(n, t) for n, t in tensors.items()}}, str(tmp_path / "d"))
    assert sorted(loaded) == sorted(tensors)
    reader = DCPReader(str(tmp_path / "d"))
    assert all(torch.equal(reader.read(f"model.{n}"), t) for n, t in tensors.items())


# --- ZeRO -> universal -> FSDP2 ----------------------------------------------------------------------------
@pytest.mark.slow  # the default run has ZeRO-2 -> FSDP2 in examples/zero2_to_fsdp2.sh (test_examples)
def test_zero_checkpoint_resumes_in_accelerate_fsdp2(runs, tmp_path):
    """A DeepSpeed ZeRO-3 checkpoint (2 ranks) -> universal -> Accelerate FSDP2 on 2 processes: accelerate's
    load_state holds exactly the ZeRO checkpoint's weights and optimizer state, and our trainer continues
    DeepSpeed's uninterrupted run: the same next loss, then the same to another engine's rounding."""
    pytest.importorskip("deepspeed")
    from .test_deepspeed import ds_run, last_json as ds_json

    ds = ds_json(ds_run(2, "train", "--zero-stage", "3", *RUN, "--output-dir", str(tmp_path / "ds")))
    convert(tmp_path / "ds" / "checkpoint-2", tmp_path / "u", "--to", "universal")
    convert(tmp_path / "u", tmp_path / "fsdp", "--to", "accelerate", "--world-size", "2", "--fsdp")
    acc_run(2, "load_state", str(tmp_path / "fsdp"), str(tmp_path / "g.pt"), "--fsdp")
    state = torch.load(tmp_path / "g.pt", weights_only=False)
    zero = logical(tmp_path / "ds" / "checkpoint-2")
    for name, tensor in state["model"].items():
        assert torch.equal(tensor, zero["model.embed_tokens.weight" if name == "lm_head.weight" else name]), name
    for name, entries in state["optimizer"]["state"].items():
        assert torch.equal(entries["exp_avg_sq"], zero[f"optimizer/exp_avg_sq/{name}"]), name
    resumed = last_json(acc_run(2, "train", *RUN, "--fsdp", "--output-dir", str(tmp_path / "r"),
                                "--resume", str(tmp_path / "fsdp")))
    # Step 3's loss is a forward pass of identical weights on identical data: equal. Step 4 follows one update
    # by another engine, with its own reduction order, and the same clipping as DeepSpeed's default (norm 1.0):
    # float rounding.
    assert resumed["losses"][0] == ds["losses"][2]
    assert resumed["losses"][1] == pytest.approx(ds["losses"][3], rel=1e-5)


# --- bad input ----------------------------------------------------------------------------------------------
def test_dcp_directory_without_metadata(runs, tmp_path):
    broken = tmp_path / "model"
    shutil.copytree(runs["fsdp"][0] / "checkpoint-4" / "pytorch_model_fsdp_0", broken)
    os.remove(broken / ".metadata")
    with pytest.raises(MissingFileError, match=r"\.metadata: missing: not a torch.distributed.checkpoint directory"):
        DCPReader(str(broken))
    result = cli("convert", str(broken), str(tmp_path / "out"), "--to", "universal")
    assert result.returncode != 0 and not (tmp_path / "out").exists()


def test_missing_random_states(runs, tmp_path):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(runs["ddp"][0] / "checkpoint-4", ckpt)
    os.remove(ckpt / "random_states_0.pkl")
    with pytest.raises(MissingFileError, match=r"random_states_0\.pkl: missing: accelerate saved 2 processes' RNG states"):
        read_accelerate(str(ckpt))
    result = cli("convert", str(ckpt), str(tmp_path / "out"), "--to", "universal")
    assert result.returncode != 0 and "random_states_0.pkl" in result.stderr and not (tmp_path / "out").exists()


def test_optimizer_state_for_unknown_parameters(runs, tmp_path):
    ddp = tmp_path / "ddp"
    shutil.copytree(runs["ddp"][0] / "checkpoint-4", ddp)
    path = ddp / "optimizer.bin"
    state = torch.load(path, weights_only=True)
    state["state"][999] = dict(state["state"][0])
    torch.save(state, path)
    reseal(ddp, "optimizer.bin")  # the manifest agrees: the reader's own check must catch it
    with pytest.raises(CorruptCheckpointError, match=r"optimizer\.bin: optimizer state for parameter ids no param group holds: \[999\]"):
        read_accelerate(str(ddp))

    opt = tmp_path / "optimizer_0"
    reader = DCPReader(str(runs["fsdp"][0] / "checkpoint-4" / "optimizer_0"))
    tree = unflatten_lists(reader.nested(("optimizer",)))
    tree["state"]["model.not_a_parameter.weight"] = tree["state"]["model.norm.weight"]
    write_dcp({"optimizer": tree}, str(opt))
    from converters.dcp import read_dcp_checkpoint

    with pytest.raises(CorruptCheckpointError, match=r"optimizer state for 'model\.not_a_parameter\.weight', which no param group holds"):
        read_dcp_checkpoint(str(opt))


def test_dcp_metadata_that_would_run_code_is_refused(tmp_path):
    import pickle

    class Exploit:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "pwned"),))

    (tmp_path / "d").mkdir()
    (tmp_path / "d" / ".metadata").write_bytes(pickle.dumps(Exploit()))
    with pytest.raises(UnsafePickleError, match=r"\.metadata: DCP metadata references posix\.system"):
        read_metadata(str(tmp_path / "d"))
    assert not (tmp_path / "pwned").exists()


# --- gradient compression, local SGD, activation checkpointing, memory statistics ---------------------------
LONG = ["--steps", "6", "--save-every", "3", "--batch-size", "4", "--seq-len", "16"]


@pytest.mark.slow  # suite time; local SGD's resume below keeps a comm-hook run's resume in the default run
def test_powersgd_resume_continues_the_uninterrupted_run(tmp_path):
    """PowerSGD compresses from iteration 2, so checkpoint 3 holds error feedback and warm-start matrices, saved
    by parameter name. The resumed run's losses are the uninterrupted run's exactly (the trainer keeps DDP from
    re-bucketing after a restart's first iteration, which would change the rounding of PowerSGD's factors)."""
    flags = ["--comm-hook", "powersgd"]
    full = last_json(acc_run(2, "train", *LONG, *flags, "--output-dir", str(tmp_path / "full")))
    plain = last_json(acc_run(2, "train", *LONG, "--output-dir", str(tmp_path / "plain")))
    assert full["losses"][:3] == plain["losses"][:3] and full["losses"][3:] != plain["losses"][3:]  # compression is on
    resumed = last_json(acc_run(2, "train", *LONG, *flags, "--output-dir", str(tmp_path / "r"),
                                "--resume", str(tmp_path / "full" / "checkpoint-3")))
    assert resumed["losses"] == full["losses"][3:]
    from interop.pieces import read_piece

    for rank in (0, 1):
        state = read_piece(str(tmp_path / "full" / "checkpoint-3"), f"ranks/{rank:05d}/powersgd")
        assert state["iter"] == 3 and "model.layers.1.mlp.up_proj.weight" in state["q"]
        assert sorted(state["error"]) == sorted(n for n, _ in odd_trainable())


def odd_trainable():
    from .odd_model import odd_model

    return [(n, p) for n, p in odd_model().named_parameters() if p.requires_grad]


def test_local_sgd_resume_continues_the_uninterrupted_run(tmp_path):
    """Local SGD every 2 steps: the step counter is a registered accelerate object (custom_checkpoint_0.pkl),
    each rank's own Adam moments a PER_RANK component; the resumed run's losses are the uninterrupted run's."""
    flags = ["--local-sgd-steps", "2"]
    full = last_json(acc_run(2, "train", *LONG, *flags, "--output-dir", str(tmp_path / "full")))
    ckpt = tmp_path / "full" / "checkpoint-3"
    counter = torch.load(ckpt / "custom_checkpoint_0.pkl", weights_only=True)
    assert counter == {"num_steps": 3, "local_sgd_steps": 2}
    resumed = last_json(acc_run(2, "train", *LONG, *flags, "--output-dir", str(tmp_path / "r"), "--resume", str(ckpt)))
    assert resumed["losses"] == full["losses"][3:]
    assert read_accelerate(str(ckpt)).extra_state["custom_checkpoint_0"] == counter  # carried through conversions


@pytest.mark.parametrize("hook", [pytest.param("fp16", marks=pytest.mark.slow), "bf16"])  # one row in CI
def test_fp16_and_bf16_gradient_compression(tmp_path, runs, hook):
    if hook == "bf16" and not torch.cuda.is_available():
        pytest.skip("torch's bf16 DDP hook needs CUDA and NCCL; this machine has no GPU")
    losses = last_json(acc_run(2, "train", "--steps", "3", "--batch-size", "4", "--seq-len", "16", "--comm-hook", hook,
                               "--output-dir", str(tmp_path / hook)))["losses"]
    uncompressed = runs["ddp"][1][:3]
    assert losses[:2] == uncompressed[:2]  # the first update has learning rate 0
    assert losses[2] != uncompressed[2] and losses[2] == pytest.approx(uncompressed[2], rel=1e-3)


def test_powersgd_state_is_laid_out_again_for_a_new_bucket_order():
    """The by-name cut and re-join behind PowerSGD checkpoints: state written for one bucket order, read for
    another (DDP's rebuild), puts every parameter's residual and P/Q rows back under that parameter."""
    from trainers.comm_hooks import _join, _pieces, _split

    shapes = {"a": (6, 4), "b": (4,), "c": (6, 4), "d": (5, 7), "e": (6, 4)}
    params = {n: torch.empty(s) for n, s in shapes.items()}
    first, second = ["a", "b", "c", "d", "e"], ["e", "d", "c", "b", "a"]
    cut_first, cut_second = _pieces(first, [params[n] for n in first], 1, 1.0), _pieces(second, [params[n] for n in second], 1, 1.0)
    for kind in range(3):  # error (every parameter), P rows, Q rows (compressed matrices, grouped by shape)
        flat = torch.arange(sum(k for _, k in cut_first[kind]), dtype=torch.float32)
        by_name = _split(flat, cut_first[kind])
        again = _join(by_name, cut_second[kind])
        offsets = {}
        for pieces, key in ((cut_first[kind], "first"), (cut_second[kind], "second")):
            o = 0
            for name, k in pieces:
                offsets[(key, name)] = (o, k)
                o += k
        for name, k in cut_first[kind]:
            (o1, _), (o2, _) = offsets[("first", name)], offsets[("second", name)]
            assert torch.equal(again[o2:o2 + k], flat[o1:o1 + k]), (kind, name)
    assert [n for n, _ in cut_second[1]] == ["e", "c", "a", "d"]  # the hook's P order: shape groups, first seen first


@pytest.mark.parametrize("layout", [pytest.param("ddp", marks=pytest.mark.slow), "fsdp2"])
def test_accelerate_launch_examples_with_activation_checkpointing(tmp_path, layout):
    """`accelerate launch --config_file examples/<layout>.yaml` with activation checkpointing: two
    processes whose losses are a torchrun run's without it, exactly (recomputing activations changes nothing);
    each save logs and records the cross-rank memory statistics."""
    env = worker_env()
    env.pop("OMP_NUM_THREADS")
    cfg = ROOT / "examples" / f"{layout}.yaml"
    result = run_workers(
        ["accelerate", "launch", "--config_file", str(cfg), "--main_process_port", str(free_port()),
         str(ROOT / "examples" / "train_accelerate.py"), *RUN, "--activation-checkpointing", "--output-dir", str(tmp_path)],
        env, 300,
    )
    plain = run_workers(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}", "-m",
         "trainers.accelerate", *RUN, *(["--fsdp"] if layout == "fsdp2" else []), "--output-dir", str(tmp_path / "plain")],
        worker_env(), 300,
    )
    assert last_json(result)["losses"] == last_json(plain)["losses"]
    memory = json.loads((tmp_path / "checkpoint-4" / "manifest.json").read_text())["memory"]
    assert memory["activation_checkpoints"] == 2 and len(memory["ranks"]) == 2
    assert memory["host_peak"]["max"] >= memory["host_peak"]["min"] > 0
    assert memory["host_peak"]["total"] == sum(r["host_peak"] for r in memory["ranks"])
    assert "memory over 2 rank(s): host now" in result.stderr and "2 activation checkpoints" in result.stderr
    # the run's own lines only: accelerate's line per saved file and DeepSpeed's accelerator detection (accelerate
    # imports it) are for --verbose
    assert not re.search(r"INFO accelerate|Setting accelerator|\[WARNING\]", result.stdout + result.stderr), result.stderr[-3000:]


def test_fsdp2_bf16_mixed_precision_keeps_fp32_masters_and_resumes_exactly(tmp_path, runs):
    flags = ["--fsdp", "--mixed-precision", "bf16"]
    full = last_json(acc_run(2, "train", *RUN, *flags, "--output-dir", str(tmp_path / "full")))
    fp32 = runs["fsdp"][1]
    assert full["losses"] != fp32 and full["losses"] == pytest.approx(fp32, rel=2e-2)  # bf16 compute, same run
    ckpt = read_accelerate(str(tmp_path / "full" / "checkpoint-2"))
    assert {t.spec.dtype for t in ckpt.model.values()} == {torch.float32}  # FSDP2 keeps fp32 parameters
    assert json.loads((tmp_path / "full" / "checkpoint-2" / "manifest.json").read_text())["sharding"]["precision"] == "bfloat16"
    resumed = last_json(acc_run(2, "train", *RUN, *flags, "--output-dir", str(tmp_path / "r"),
                                "--resume", str(tmp_path / "full" / "checkpoint-2")))
    assert resumed["losses"] == full["losses"][2:]


def test_bare_save_state_directories(runs, tmp_path):
    """accelerate's own save_state output, without our manifest, beside the model's config.json: FSDP2's DCP
    files name everything, so it reads exactly as our checkpoint does (frozen parameters found from the config);
    DDP's optimizer.bin names nothing, and with frozen parameters its ids cannot be placed: a clear error."""
    for layout in ("fsdp", "ddp"):
        ckpt = runs[layout][0] / "checkpoint-4"
        bare = tmp_path / layout
        shutil.copytree(ckpt, bare, ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
        config = json.loads((ckpt / "manifest.json").read_text())["model"]["config"]
        (bare / "config.json").write_text(json.dumps(config))
        ours = read_accelerate(str(ckpt))
        if layout == "ddp":
            with pytest.raises(ConversionError, match=r"cannot tell which parameter each of optimizer\.bin's 17 entries is \(groups of \[12, 5\]; the model has 20 parameters, and no known way"):
                read_accelerate(str(bare))
            continue
        theirs = read_accelerate(str(bare))
        assert theirs.frozen == ours.frozen and theirs.step == 4 and theirs.tied == [TIED]
        a, b = dict(theirs.tensors()), dict(ours.tensors())
        assert a.keys() == b.keys() and all(torch.equal(a[k].load(), b[k].load()) for k in a)
        assert theirs.extra_state["scheduler"] == ours.extra_state["scheduler"]
        assert len(theirs.rank_state["rng"]) == 2  # accelerate's RNG files become the per-rank rng component


def test_bare_ddp_save_state_converts_with_config(tmp_path):
    """accelerate's save_state directory as accelerate leaves it (no config.json beside it): optimizer.bin names
    its parameters by position only, so the model's config comes with --config; it is checked against the
    tensors first, and a config of another model is refused naming the tensor and both shapes."""
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "trainers.accelerate", *RUN, "--output-dir", str(run)],
                          env=worker_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    ckpt = run / "checkpoint-4"
    bare = shutil.copytree(ckpt, tmp_path / "bare", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    config = json.loads((ckpt / "manifest.json").read_text())["model"]["config"]
    (tmp_path / "config.json").write_text(json.dumps(config))

    refused = cli("convert", str(bare), str(tmp_path / "u0"), "--to", "universal")
    assert refused.returncode == 2 and "--config" in refused.stderr and not (tmp_path / "u0").exists()
    convert(bare, tmp_path / "u", "--to", "universal", "--config", str(tmp_path / "config.json"))
    theirs, ours = logical(tmp_path / "u"), logical(ckpt)
    assert theirs.keys() == ours.keys() and all(torch.equal(theirs[k], ours[k]) for k in ours)
    assert json.loads((tmp_path / "u" / "model" / "config.json").read_text()) == config

    other = {**config, "hidden_size": config["hidden_size"] * 2}
    (tmp_path / "other.json").write_text(json.dumps(other))
    wrong = cli("convert", str(bare), str(tmp_path / "u2"), "--to", "universal", "--config", str(tmp_path / "other.json"))
    assert wrong.returncode == 2 and len(wrong.stderr.strip().splitlines()) == 1, wrong.stderr
    h = config["hidden_size"]
    assert re.search(rf"tensor '[\w.]+' is \[\d+, {h}\] in the checkpoint but \[\d+, {2 * h}\] in the --config model", wrong.stderr), wrong.stderr
    assert not (tmp_path / "u2").exists()


def test_ddp_async_save_stages_what_accelerate_writes(tmp_path):
    """--async-save on DDP, 2 ranks: the weights, optimizer, scheduler and sampler state that save_state hands
    accelerate's save() are copied in memory (not on disk when save() returns) and written by that same function
    only when the commit is awaited, after later steps changed every tensor in place: byte for byte the files
    of a blocking save at that step."""
    short = ["--steps", "4", "--save-every", "2", "--batch-size", "4", "--seq-len", "16"]
    blocking = last_json(acc_run(2, "train", *short, "--output-dir", str(tmp_path / "blocking")))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *held_commit_cmd(tmp_path / "returned.json", "tests.acc_worker", "train", *short,
                                                             "--async-save", "--output-dir", str(tmp_path / "staged"))]
    staged = last_json(run_workers(cmd, worker_env(), 300))
    assert staged["losses"] == blocking["losses"]
    returned_with = json.loads((tmp_path / "returned.json").read_text())[0]  # the step-2 save's staging directory
    assert not {"model.safetensors", "optimizer.bin", "scheduler.bin"} & set(returned_with), returned_with
    a, b = native_files(tmp_path / "blocking" / "checkpoint-2"), native_files(tmp_path / "staged" / "checkpoint-2")
    assert {"model.safetensors", "optimizer.bin", "scheduler.bin"} <= set(a) and sorted(a) == sorted(b)
    # random_states_<rank>.pkl also hold Python's and numpy's generators, which no trainer seeds: each process's own
    rng = [n for n in a if n.startswith("random_states_")]
    assert len(rng) == 2 and [n for n in a if a[n] != b[n] and n not in rng] == []
    for name in rng:
        ra, rb = (torch.load(d / "checkpoint-2" / name, weights_only=False) for d in (tmp_path / "blocking", tmp_path / "staged"))
        assert ra["step"] == rb["step"] and torch.equal(ra["torch_manual_seed"], rb["torch_manual_seed"])


@pytest.mark.slow
def test_fsdp2_async_save_writes_what_a_blocking_save_writes_and_resumes(tmp_path):
    """--async-save on FSDP2: accelerate's DCP saves staged in memory and written on the commit's thread while training
    goes on hold exactly the state of their step, and accelerate's own load_state resumes them."""
    blocking = last_json(acc_run(2, "train", *LONG, "--fsdp", "--output-dir", str(tmp_path / "blocking")))
    staged = last_json(acc_run(2, "train", *LONG, "--fsdp", "--async-save", "--output-dir", str(tmp_path / "staged")))
    assert staged["losses"] == blocking["losses"]
    a, b = read(str(tmp_path / "blocking" / "checkpoint-3"))[1], read(str(tmp_path / "staged" / "checkpoint-3"))[1]
    ta, tb = {k: t.load() for k, t in a.tensors()}, {k: t.load() for k, t in b.tensors()}
    assert sorted(ta) == sorted(tb) and all(torch.equal(ta[k], tb[k]) for k in ta)
    resumed = last_json(acc_run(2, "train", *LONG, "--fsdp", "--output-dir", str(tmp_path / "resumed"),
                                "--resume", str(tmp_path / "staged" / "checkpoint-3")))
    assert resumed["losses"] == blocking["losses"][3:]


def test_a_bare_save_state_grouped_as_transformers_examples_reads_by_name(tmp_path, tiny_llama):
    """accelerate's own save_state of a script that groups as transformers' *_no_trainer.py examples do (no decay
    for names holding "bias" or "layer_norm.weight": every Llama weight decays, its norms too, and the no-decay group
    is empty), with the model's config.json beside it: optimizer.bin's ids are named by that rule, each
    parameter's state exactly the optimizer's."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState

    model = tiny_llama()
    no_decay = ["bias", "layer_norm.weight"]
    optimizer = torch.optim.AdamW([
        {"params": [p for n, p in model.named_parameters() if not any(nd in n for nd in no_decay)], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if any(nd in n for nd in no_decay)], "weight_decay": 0.0},
    ], lr=1e-2)
    try:
        accelerator = Accelerator(cpu=True)
        model, optimizer = accelerator.prepare(model, optimizer)
        ids = torch.arange(16).reshape(2, 8) % model.config.vocab_size
        accelerator.backward(model(input_ids=ids, labels=ids).loss)
        optimizer.step()
        accelerator.save_state(str(tmp_path / "state"))
    finally:
        AcceleratorState._reset_state(True)
    (tmp_path / "state" / "config.json").write_text(model.config.to_json_string())
    ckpt = read_accelerate(str(tmp_path / "state"))
    names = {id(p): n for n, p in model.named_parameters()}
    assert [g["params"] for g in ckpt.optimizer.param_groups] == [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    assert [len(g["params"]) for g in ckpt.optimizer.param_groups] == [len(names), 0]
    held = ckpt.optimizer.tensors["exp_avg"]
    assert len(held) == len(names) and all(torch.equal(held[names[id(p)]].load(), s["exp_avg"]) for p, s in optimizer.state.items())


def test_positional_groups_two_rules_fit_differently_is_told_by_the_state_or_not_at_all():
    """A model where decaying matrices and Trainer's rule give groups of the same sizes holding different
    parameters (a 2-D bias, a 1-D weight that is no norm): with optimizer state, its shapes tell which placement is
    the file's; before the first step nothing does, and both placements come back, for the reader to refuse."""
    from converters.param_order import positional_fits

    model = torch.nn.Module()
    model.proj = torch.nn.Linear(3, 3, bias=False)
    model.gate = torch.nn.Module()
    model.gate.bias = torch.nn.Parameter(torch.zeros(2, 3))
    model.scale = torch.nn.Parameter(torch.ones(3))
    shapes = {n: tuple(p.shape) for n, p in model.named_parameters()}
    rules = ("matrices", "trainer")
    unknown = positional_fits(model, shapes, [[[], []], [[]]], rules)
    # module order: the root's own parameter first
    assert unknown == [("matrices", [["proj.weight", "gate.bias"], ["scale"]]), ("trainer", [["scale", "proj.weight"], ["gate.bias"]])]
    trainers = positional_fits(model, shapes, [[[(3,)], [(3, 3)]], [[(2, 3)]]], rules)
    assert trainers == [("trainer", [["scale", "proj.weight"], ["gate.bias"]])]
