"""DeepSpeed ZeRO-1/2/3 with real DeepSpeed on 2 CPU ranks: our reader against zero_to_fp32, our writer
against engine.load_checkpoint, resume across stages and world sizes, and bad input."""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

pytest.importorskip("deepspeed", reason="DeepSpeed tests need deepspeed (pip install 'interop[deepspeed]')")

from converters.deepspeed import NativeLayout, read_deepspeed  # noqa: E402
from converters.deepspeed_writer import write_native  # noqa: E402
from converters.ds_universal import read_ds_universal, write_ds_universal  # noqa: E402
from converters.registry import detect  # noqa: E402
from interop.errors import CorruptCheckpointError, MissingFileError, TopologyError, UnsupportedStateError  # noqa: E402
from interop.verify import verify_checkpoint  # noqa: E402

from .conftest import ROOT, free_port, run_workers, worker_env  # noqa: E402
from .ds_worker import LAYOUTS  # noqa: E402
from .odd_model import FROZEN, odd_model  # noqa: E402

pytestmark = pytest.mark.dist
DS_WORKER = str(ROOT / "tests" / "ds_worker.py")
TIED = ["lm_head.weight", "model.embed_tokens.weight"]
SEED = 1234  # the trainers' default seed: odd_model() after manual_seed(SEED) is the initial model


def ds_run(nproc: int, *args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", DS_WORKER, *args]
    env = worker_env()
    env["DS_ACCELERATOR"] = "cpu"
    return run_workers(cmd, env, timeout)


def last_json(result: subprocess.CompletedProcess) -> dict:
    return json.loads([line for line in result.stdout.splitlines() if line.startswith("{")][-1])


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    out = tmp_path_factory.mktemp("layouts")
    ds_run(2, "layouts", str(out))
    return {(stage, dtype): out / f"z{stage}-{dtype}" / "checkpoint-2" for stage, dtype in LAYOUTS}


def initial_model() -> dict[str, torch.Tensor]:
    torch.manual_seed(SEED)
    return odd_model().state_dict()


def zero_to_fp32(path) -> dict[str, torch.Tensor]:
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    # the run's root, as a DeepSpeed user points the script at it: its 'latest' names the checkpoint
    return {k: v.contiguous() for k, v in get_fp32_state_dict_from_zero_checkpoint(str(path.parent)).items()}


def logical_tensors(ckpt) -> dict[str, torch.Tensor]:
    return {k: t.load() for k, t in ckpt.tensors()}


@pytest.mark.parametrize("stage,dtype", LAYOUTS, ids=[f"zero{s}-{d}" for s, d in LAYOUTS])
def test_weights_equal_zero_to_fp32(layouts, stage, dtype):
    path = layouts[(stage, dtype)]
    ckpt = read_deepspeed(str(path))
    ours = {k: t.load() for k, t in ckpt.model.items()}
    ref = zero_to_fp32(path)
    init = initial_model()
    frozen = sorted(n for n in init if n.startswith(FROZEN))
    trainable = [n for n in ref if n not in frozen and n not in ("model.calibration", TIED[0])]

    for name in trainable:  # fp32 master weights, bit for bit
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], ref[name]), name
    assert ckpt.tied == [TIED] and torch.equal(ours[TIED[0]], ours[TIED[1]])
    assert not torch.equal(ours["model.norm.weight"], init["model.norm.weight"])  # it trained

    # DeepSpeed casts parameters, not buffers, to bf16: the buffer is saved (and read) as it was
    buf = ours["model.calibration"]
    assert torch.equal(buf, init["model.calibration"]) and torch.equal(ref["model.calibration"], buf)

    # frozen parameters are exactly their initial values, in the training dtype
    assert sorted(ckpt.frozen) == frozen
    for name in frozen:
        assert torch.equal(ours[name], init[name].to(getattr(torch, dtype))), name
    if stage == 1:  # DeepSpeed's tool is wrong here: ZeRO-1 saves no frozen fragments, so it drops them
        assert not set(frozen) & set(ref)
    else:
        for name in frozen:
            assert torch.equal(ours[name], ref[name]), name

    opt = ckpt.optimizer
    names = [n for g in opt.param_groups for n in g["params"]]
    assert sorted(names) == sorted(n for n in trainable)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert set(opt.tensors) == {"exp_avg", "exp_avg_sq"}
    for key in opt.tensors:
        assert sorted(opt.tensors[key]) == sorted(names)
        for n in names:
            assert opt.tensors[key][n].load().shape == ours[n].shape
    assert {v["value"] for v in opt.scalars["step"].values()} == {2.0}
    assert ckpt.step == 2 and ckpt.source["zero_stage"] == stage and ckpt.source["world_size"] == 2


@pytest.mark.parametrize("stage,world,dtype", [(1, 1, "float32"), (2, 3, "bfloat16"), (3, 3, "float32"), (3, 1, "bfloat16")])
def test_written_checkpoint_reads_back_exactly(layouts, tmp_path, stage, world, dtype):
    source = read_deepspeed(str(layouts[(3, "float32")]))
    write_native(source, str(tmp_path), NativeLayout(world, stage, dtype), {"train_batch_size": 4})
    back = read_deepspeed(str(tmp_path))
    assert back.source["world_size"] == world and back.source["zero_stage"] == stage
    a, b = logical_tensors(source), logical_tensors(back)
    assert sorted(a) == sorted(b)
    for k in a:
        expect = a[k].to(b[k].dtype) if k in source.frozen else a[k]  # frozen: stored in the training dtype
        assert torch.equal(expect, b[k]), k
    assert back.optimizer.scalars == source.optimizer.scalars
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    for k, v in get_fp32_state_dict_from_zero_checkpoint(str(tmp_path)).items():  # DeepSpeed's tool reads ours
        assert torch.equal(v.contiguous().float(), b[k].float()), k


# --- resume ----------------------------------------------------------------------------------------------
ARGS = ["--steps", "6", "--batch-size", "4", "--seq-len", "16", "--keep-last", "0"]


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """ZeRO-2 on 2 ranks: 6 steps uninterrupted, and the same run stopped at step 3."""
    out = tmp_path_factory.mktemp("resume")
    full = last_json(ds_run(2, "train", *ARGS, "--zero-stage", "2", "--output-dir", str(out / "full")))
    ds_run(2, "train", *ARGS, "--zero-stage", "2", "--stop-at", "3", "--output-dir", str(out / "split"))
    return full["losses"], out / "split" / "checkpoint-3", out


def resume(saved_run, stage: int, world: int, name: str):
    full, checkpoint, out = saved_run
    run = last_json(ds_run(world, "reload", *ARGS, "--zero-stage", str(stage), "--resume", str(checkpoint),
                           "--output-dir", str(out / name)))
    return full, checkpoint, out / name / "loaded-3", run


def assert_loaded_exactly(saved, loaded):
    """Weights and every optimizer state tensor as the engine holds them after load, bit for bit."""
    a, b = read_deepspeed(str(saved)), read_deepspeed(str(loaded))
    ta, tb = logical_tensors(a), logical_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k
    assert a.optimizer.scalars == b.optimizer.scalars


def test_resume_same_layout_is_exact(saved_run):
    full, saved, loaded, run = resume(saved_run, 2, 2, "same")
    assert run["resumed_at"] == 3
    assert_loaded_exactly(saved, loaded)
    assert run["losses"] == full[3:]  # same stage and world size: bit-identical


@pytest.mark.slow  # DeepSpeed loading our output at another stage and world size: test_engine_load_checkpoint_on_convert_output_and_run_root
def test_resume_on_one_rank_at_zero3(saved_run):
    full, saved, loaded, run = resume(saved_run, 3, 1, "z3w1")
    assert_loaded_exactly(saved, loaded)
    # another world size sums the gradients in another order: equal to float rounding only
    assert run["losses"] == pytest.approx(full[3:], rel=1e-5)


@pytest.fixture(scope="module")
def saved_runs(tmp_path_factory):
    """Per ZeRO stage, on 2 ranks: the uninterrupted losses and the checkpoint of the run stopped at step 3."""
    runs = {}

    def get(stage: int):
        if stage not in runs:
            out = tmp_path_factory.mktemp(f"saved-zero{stage}")
            full = last_json(ds_run(2, "train", *ARGS, "--zero-stage", str(stage), "--output-dir", str(out / "full")))
            ds_run(2, "train", *ARGS, "--zero-stage", str(stage), "--stop-at", "3", "--output-dir", str(out / "split"))
            runs[stage] = (full["losses"], out / "split" / "checkpoint-3")
        return runs[stage]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("saved_stage", [1, 2, 3])
@pytest.mark.parametrize("stage,world", [(s, w) for s in (1, 2, 3) for w in (1, 2)])
def test_resume_matrix(saved_runs, tmp_path, saved_stage, stage, world):
    full, saved = saved_runs(saved_stage)
    run = last_json(ds_run(world, "reload", *ARGS, "--zero-stage", str(stage), "--resume", str(saved),
                           "--output-dir", str(tmp_path / "resumed")))
    assert_loaded_exactly(saved, tmp_path / "resumed" / "loaded-3")
    if world == 2 and (stage == 3) == (saved_stage == 3):
        assert run["losses"] == full[3:]  # the same partitioning of the same sums: bit-identical
    else:
        assert run["losses"] == pytest.approx(full[3:], rel=1e-5)  # another reduction order: float rounding


# --- DeepSpeed's own loader pointed at our directories ------------------------------------------------------
def engine_load(tmp_path, src, stage: int, world: int) -> tuple[dict, object]:
    """A user's script: `engine.load_checkpoint(src)` with nothing of ours in between, then the engine's own save."""
    out = tmp_path / f"engine-saved-z{stage}-w{world}"
    config = tmp_path / f"ds_zero{stage}.json"
    config.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_batch_size": 4}))
    run = last_json(ds_run(world, "load", str(src), str(out), "--deepspeed_config", str(config), "--seq-len", "16",
                           "--output-dir", str(tmp_path / "unused")))
    return run, read_deepspeed(str(out))


def test_engine_load_checkpoint_on_convert_output_and_run_root(layouts, tmp_path):
    """`interop convert ... --to deepspeed DST` leaves DST as `engine.save_checkpoint(DST)` would (`latest`,
    `global_step<N>/`): DeepSpeed's own load_checkpoint(DST) loads every weight and optimizer tensor exactly.
    (It used to find no `latest` at DST, warn, return None and let training go on from random weights.) A
    training run's root loads the same way: its `latest` names the checkpoint holding DeepSpeed's files."""
    saved = layouts[(3, "float32")]
    dst = tmp_path / "dst"
    result = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(saved), str(dst), "--to", "deepspeed",
                             "--world-size", "1", "--zero-stage", "2"], capture_output=True, text=True, env=worker_env())
    assert result.returncode == 0, result.stderr
    assert "engine.load_checkpoint" in result.stdout  # the output line says how to load it
    assert (dst / "latest").read_text().strip() == "global_step2" and (dst / "global_step2" / "manifest.json").is_file()
    source = read_deepspeed(str(saved))
    run, loaded = engine_load(tmp_path, dst, 2, 1)
    assert run["loaded"] is not None and run["global_steps"] == 2
    assert_same_logical(source, loaded)

    run, loaded = engine_load(tmp_path, layouts[(2, "float32")].parent, 2, 2)  # a run root, as DeepSpeed users point at it
    assert run["loaded"] is not None and run["global_steps"] == 2
    assert_same_logical(read_deepspeed(str(layouts[(2, "float32")])), loaded)
    verify = subprocess.run([sys.executable, "-m", "converters.cli", "verify", str(dst)], capture_output=True, text=True,
                            env=worker_env())
    assert verify.returncode == 0, verify.stdout + verify.stderr


@pytest.mark.parametrize("grouping", ["single", pytest.param("decay", marks=pytest.mark.slow)])
def test_user_script_with_its_own_param_groups_loads_the_output(layouts, tmp_path, grouping):
    """A user's DeepSpeed script groups its parameters its own way: one group (`model.parameters()`, which a
    config with an `optimizer` section implies) or transformers' decay / no-decay. `--param-groups` (or the
    config) lays the flat buffers out for that grouping; engine.load_checkpoint(DST) then loads every weight and
    Adam moment exactly. (With the source's grouping, DeepSpeed refuses: "different number of parameter groups".)"""
    saved = layouts[(2, "float32")]
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"train_batch_size": 4, "zero_optimization": {"stage": 2}, "gradient_clipping": 1.0,
                                  "optimizer": {"type": "AdamW", "params": {"lr": 0.003, "weight_decay": 0.1, "torch_adam": True}}}))
    # the config's optimizer section implies one group; a script that groups as transformers' Trainer says so
    flags = ["--deepspeed-config", str(config)] + (["--param-groups", "decay"] if grouping == "decay" else [])
    dst = tmp_path / "dst"
    result = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(saved), str(dst), "--to", "deepspeed",
                             "--world-size", "1", "--zero-stage", "2", *flags], capture_output=True, text=True, env=worker_env())
    assert result.returncode == 0, result.stderr
    manifest = json.loads((dst / "global_step2" / "manifest.json").read_text())
    assert manifest["optimizer"]["grouping"] == grouping
    run = last_json(ds_run(1, "user-load", str(dst), str(tmp_path / "saved"), str(config), grouping))
    assert run["loaded"] is not None and run["global_steps"] == 2 and run["groups"] == (1 if grouping == "single" else 2)
    source, loaded = read_deepspeed(str(saved)), read_deepspeed(str(tmp_path / "saved"))
    ta, tb = logical_tensors(source), logical_tensors(loaded)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


# --- DeepSpeed's universal layout ----------------------------------------------------------------------
def ds_to_universal(tag_dir, out):
    """DeepSpeed's own converter, as its docs run it: the output tag directory beside a `latest_universal`."""
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(tag_dir),
           "--output_folder", str(out / "global_step2_universal"), "--inject_missing_state",
           "--num_extract_workers", "1", "--num_merge_workers", "1"]
    env = worker_env()
    env["DS_ACCELERATOR"] = "cpu"
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def assert_same_logical(a, b):
    """Every tensor (weights, frozen, buffers, optimizer state) in the same dtype and bit for bit; steps, groups,
    ties and the frozen list equal."""
    ta, tb = logical_tensors(a), logical_tensors(b)
    assert sorted(ta) == sorted(tb)
    for k in ta:
        assert ta[k].dtype == tb[k].dtype and torch.equal(ta[k], tb[k]), k
    assert a.optimizer.scalars == b.optimizer.scalars
    assert a.optimizer.param_groups == b.optimizer.param_groups
    assert (a.tied, a.frozen, a.step) == (b.tied, b.frozen, b.step)


@pytest.mark.parametrize("stage,dtype", [(1, "bfloat16"), pytest.param(2, "float32", marks=pytest.mark.slow), (3, "float32")],
                         ids=["zero1-bf16", "zero2", "zero3"])
def test_reading_ds_to_universal_equals_reading_its_source(layouts, tmp_path, stage, dtype):
    native = layouts[(stage, dtype)]
    out = ds_to_universal(native, tmp_path / "universal")
    assert detect(str(out)).name == "ds-universal" and detect(str(native)).name == "deepspeed"
    ours = read_ds_universal(str(out))
    assert ours.source["zero_stage"] == stage and ours.frozen  # frozen parameters kept (ZeRO-3: from the model states)
    assert_same_logical(read_deepspeed(str(native)), ours)


def universal_config(tmp_path, stage: int) -> str:
    path = tmp_path / f"ds_zero{stage}_universal.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": stage}, "train_batch_size": 4,
                                "checkpoint": {"load_universal": True}}))
    return str(path)


def load_universal(tmp_path, source, stage: int, world: int) -> tuple[dict, object]:
    """DeepSpeed's engine.load_checkpoint with load_universal, on `world` ranks at `stage`; the engine then
    saves natively, and that is read back."""
    loaded = tmp_path / f"loaded-zero{stage}-w{world}"
    run = last_json(ds_run(world, "load", str(source), str(loaded), "--deepspeed_config", universal_config(tmp_path, stage),
                           "--seq-len", "16", "--output-dir", str(tmp_path / "unused")))
    return run, read_deepspeed(str(loaded))


@pytest.mark.parametrize("stage,world", [pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(2, 1, marks=pytest.mark.slow), (3, 2)])
def test_load_universal_accepts_ours_on_every_stage(layouts, tmp_path, stage, world):
    saved = layouts[(3, "float32")]
    out = tmp_path / "universal"
    result = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(saved), str(out), "--to", "ds-universal"],
                            capture_output=True, text=True, env=worker_env())
    assert result.returncode == 0, result.stderr
    source = read_deepspeed(str(saved))
    assert_same_logical(source, read_ds_universal(str(out)))  # frozen parameters and buffers included, exactly

    run, loaded = load_universal(tmp_path, out, stage, world)
    assert run["global_steps"] == 2
    # Trainable weights and every optimizer tensor as the engine holds them after load, and the per-group step.
    # (DeepSpeed's universal load leaves frozen parameters and buffers as the model was built: here the same.)
    assert_same_logical(source, loaded)
    assert run["weight_decay"] == [0.1, 0.0]  # decay and no-decay groups kept apart, ZeRO-3 included


@pytest.mark.slow  # DeepSpeed's own loss; ours keeps the groups in test_load_universal_accepts_ours_on_every_stage
def test_deepspeed_zero3_universal_loses_no_decay_groups_ours_does_not(layouts, tmp_path):
    """DeepSpeed's ZeRO-3 universal loader sets every group's hyper-parameters from group 0's: from
    ds_to_universal's output the no-decay group comes back with weight decay. Ours keeps both groups."""
    theirs = ds_to_universal(layouts[(3, "float32")], tmp_path / "theirs")
    run, _ = load_universal(tmp_path, theirs, 3, 2)
    assert run["weight_decay"] == [0.1, 0.1]


def test_damaged_universal_names_the_file(layouts, tmp_path):
    out = tmp_path / "universal"
    write_ds_universal(read_deepspeed(str(layouts[(2, "float32")])), str(out))
    tag = out / "global_step2_universal"
    zero = tag / "zero"
    victim = zero / "model.norm.weight" / "exp_avg.pt"
    victim.write_bytes(victim.read_bytes()[:100])
    with pytest.raises(CorruptCheckpointError, match="model.norm.weight/exp_avg.pt: size 100 bytes, manifest says"):
        read_ds_universal(str(out))  # our manifest beside DeepSpeed's files catches it before anything is read
    os.remove(tag / "manifest.json")  # as ds_to_universal leaves it: the reader's own checks
    with pytest.raises(CorruptCheckpointError, match="model.norm.weight/exp_avg.pt"):
        read_ds_universal(str(out)).optimizer.tensors["exp_avg"]["model.norm.weight"].load()
    os.remove(zero / "model.norm.weight" / "fp32.pt")
    with pytest.raises(MissingFileError, match="model.norm.weight/fp32.pt"):
        read_ds_universal(str(out))


# --- bad input -------------------------------------------------------------------------------------------
def copy_native(layouts, tmp_path, key=(2, "float32")):
    """DeepSpeed's own files of a checkpoint, as save_checkpoint leaves them: `latest` and the tag folder."""
    dst = tmp_path / "ckpt"
    shutil.copytree(layouts[key], dst / "global_step2", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    (dst / "latest").write_text("global_step2")
    return dst, dst / "global_step2"


def test_missing_rank_file(layouts, tmp_path):
    root, tag = copy_native(layouts, tmp_path)
    os.remove(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(MissingFileError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        read_deepspeed(str(root))


def test_files_of_two_world_sizes(layouts, tmp_path):
    root, tag = copy_native(layouts, tmp_path)
    other = tmp_path / "three"
    write_native(read_deepspeed(str(root)), str(other), NativeLayout(3, 2, "float32"))
    shutil.copy(other / "global_step2" / "zero_pp_rank_2_mp_rank_00_optim_states.pt", tag)
    with pytest.raises(TopologyError, match="two world sizes mixed"):
        read_deepspeed(str(root))


def test_truncated_optimizer_file(layouts, tmp_path):
    root, tag = copy_native(layouts, tmp_path)
    victim = tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match="zero_pp_rank_1_mp_rank_00_optim_states.pt"):
        read_deepspeed(str(root))
    result = subprocess.run([sys.executable, "-m", "converters.cli", "inspect", str(root)], capture_output=True,
                            text=True, env=worker_env())
    assert result.returncode == 2 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_unknown_optimizer_state(layouts, tmp_path):
    root, tag = copy_native(layouts, tmp_path)
    path = tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    sd = torch.load(path, weights_only=False)
    sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0]["mystery"] = torch.ones(3)
    torch.save(sd, path)
    with pytest.raises(UnsupportedStateError, match="'mystery'"):
        read_deepspeed(str(root)).optimizer


def test_deepspeed_launcher_example_and_zero_to_fp32_script(tmp_path):
    """`deepspeed --num_gpus 2 examples/...` with a user's DeepSpeed JSON; DeepSpeed's own recovery script
    (copied into the checkpoint by save_checkpoint) reads our checkpoint, and agrees with our reader."""
    from safetensors.torch import load_file

    env = worker_env()
    port = free_port()
    cmd = ["deepspeed", "--num_gpus", "2", "--master_port", str(port), str(ROOT / "examples" / "train_deepspeed.py"),
           "--deepspeed_config", str(ROOT / "examples" / "ds_zero2.json"), "--steps", "2", "--seq-len", "16",
           "--output-dir", str(tmp_path / "run")]
    launched = subprocess.run([os.path.join(os.path.dirname(sys.executable), cmd[0]), *cmd[1:]], env=env,
                              capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0, launched.stdout[-3000:] + launched.stderr[-3000:]
    # DeepSpeed's launcher sets LOCAL_SIZE, so its CPU allreduce maps a 66 MiB segment per rank that it never
    # unlinks; the trainer unlinks them once all ranks have mapped them (none left in RAM after the run)
    assert not glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{port}_*")
    ckpt = tmp_path / "run" / "checkpoint-2"
    script = subprocess.run([sys.executable, str(ckpt / "zero_to_fp32.py"), str(ckpt.parent), str(tmp_path / "fp32"),
                             "--safe_serialization"], env=env, capture_output=True, text=True, timeout=300)
    assert script.returncode == 0, script.stderr[-3000:]
    theirs = load_file(str(tmp_path / "fp32" / "model.safetensors"))
    ours = read_deepspeed(str(ckpt))
    assert set(theirs) == set(ours.model)
    for name, t in theirs.items():
        assert torch.equal(t, ours.model[name].load()), name
    assert ours.source["zero_stage"] == 2 and ours.optimizer.param_groups[0]["lr"] == 0.0  # linear decay ran to its end


@pytest.mark.parametrize("stage", [1, 3])
def test_mapped_pieces_are_the_tensor_bytes_without_a_copy(layouts, stage):
    """The safetensors writer streams a ZeRO tensor straight from the mapped rank files: the pieces it writes
    are views of those mappings (no copy) and together are exactly what load() assembles."""
    ckpt = read_deepspeed(str(layouts[(stage, "float32")]))
    for name, t in list(ckpt.model.items()) + list(ckpt.optimizer.tensors["exp_avg"].items())[:4]:
        if t.mapped_pieces is None:
            continue  # ZeRO-3's frozen parameters: fragments on every rank, concatenated and cut on load
        pieces = t.mapped_pieces()
        assert b"".join(bytes(p.data) for p in pieces) == t.load().detach().numpy().tobytes(), name
        for p in pieces:  # each a range of a rank file, read there
            with open(p.source[0], "rb") as f:
                f.seek(p.source[1])
                assert f.read(p.data.nbytes) == bytes(p.data), name
    trainable = {n for g in ckpt.optimizer.param_groups for n in g["params"]} | {target for target, *_ in ckpt.tied}
    whole_in_module = set(ckpt.model) - trainable - (set(ckpt.frozen) if stage == 3 else set())  # buffers; ZeRO-1's frozen
    assert {n for n, t in ckpt.model.items() if t.mapped_pieces is not None} == trainable | whole_in_module  # the tied alias too


def test_bare_zero_to_universal_notes_a_missing_config_and_takes_one(layouts, tmp_path):
    """DeepSpeed's own directory records no model config: converting it says so (stdout and manifest) instead
    of leaving a model/ that from_pretrained cannot load; with --config, model/ loads in transformers."""
    import transformers

    root, _ = copy_native(layouts, tmp_path)
    env = worker_env()
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    done = subprocess.run(cli + [str(root), str(tmp_path / "u0"), "--to", "universal"], capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    note = "the source carries no model config: the universal output has no config.json"
    assert f"note: {note}" in done.stdout and "--config" in done.stdout
    assert any(n.startswith(note) for n in json.loads((tmp_path / "u0" / "manifest.json").read_text())["notes"])

    config = json.loads((layouts[(2, "float32")] / "manifest.json").read_text())["model"]["config"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    done = subprocess.run(cli + [str(root), str(tmp_path / "u"), "--to", "universal", "--config", str(tmp_path / "config.json")],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert "note: the source carries no model config" not in done.stdout
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "u" / "model")
    source = read_deepspeed(str(layouts[(2, "float32")]))
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, source.model[name].load()), name


def test_staged_save_writes_the_state_of_its_step(tmp_path):
    """--async-save on ZeRO-3, 2 ranks: DeepSpeed's save_checkpoint staged in memory, its files written only after
    the next step changed every tensor in place, are byte for byte the files a blocking save at that step wrote."""
    ds_run(2, "staged", str(tmp_path), *ARGS, "--zero-stage", "3", "--output-dir", str(tmp_path / "run"))
    blocking, later = tmp_path / "blocking" / "checkpoint-2", tmp_path / "staged" / "checkpoint-2"
    engine_files = sorted(f.name for f in blocking.iterdir() if f.suffix == ".pt")
    assert len(engine_files) == 4 and engine_files == sorted(f.name for f in later.iterdir() if f.suffix == ".pt")
    for name in engine_files:
        assert (blocking / name).read_bytes() == (later / name).read_bytes(), name
    assert verify_checkpoint(str(later))[1] == []
    a, b = logical_tensors(read_deepspeed(str(blocking))), logical_tensors(read_deepspeed(str(later)))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("target", ["deepspeed", "ds-universal"])
def test_files_written_at_once_are_the_files_written_one_by_one(layouts, tmp_path, monkeypatch, target):
    """The writers write several rank files (deepspeed) or parameter folders (ds-universal) at once, reading the
    source one tensor at a time; the engine's files are byte for byte those of writing them one after another."""
    import converters.engine_checkpoint as engine_checkpoint

    from .conftest import native_files

    source = read_deepspeed(str(layouts[(2, "float32")]))

    def write(out, writers: int) -> dict[str, bytes]:
        monkeypatch.setattr(engine_checkpoint, "WRITERS", writers)
        if target == "deepspeed":
            tag = write_native(source, str(out), NativeLayout(4, 2, "float32"), {"train_batch_size": 4})
        else:
            tag = out / write_ds_universal(source, str(out))
        return native_files(tag)

    one, several = write(tmp_path / "one", 1), write(tmp_path / "several", 4)
    assert len(one) > 4 and one == several


def test_a_failed_file_stops_the_writers_before_the_rest_are_written(monkeypatch):
    """The writers' pool: a failure surfaces as itself, and the files not yet started are not written first
    (a conversion that fails on its first rank file does not write the other hundred before saying so)."""
    import converters.engine_checkpoint as engine_checkpoint

    monkeypatch.setattr(engine_checkpoint, "WRITERS", 2)
    started = []

    def work(i: int) -> int:
        started.append(i)
        if i == 1:
            raise OSError("disk full")
        time.sleep(0.05)  # a file being written
        return i

    results = engine_checkpoint.at_once(work, [(i,) for i in range(100)], "test")
    assert next(results) == 0
    with pytest.raises(OSError, match="disk full"):
        next(results)
    assert len(started) <= 4  # at most the window of items already submitted: the rest never start
