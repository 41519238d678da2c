"""Real megatron-core 0.16.1 (2 CPU processes, gloo) against our Megatron converter.

Checkpoints megatron-core's GPTModel and FP32Optimizer write at TP2 and at PP2 (in the files Megatron-LM's
save_checkpoint makes of them) convert to Hugging Face with logits equal to megatron-core's own forward; and a
checkpoint we write at another layout loads into megatron-core, optimizer included, and continues training
with exactly the losses of the uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest
import torch
import transformers

from converters.megatron import read_megatron, write_megatron
from tests.conftest import ROOT, run_workers, worker_env
from tests.mcore_worker import VOCAB, batch

# Only the workers import megatron-core: importing it adds argparse.Namespace and more to torch's weights_only
# allowlist for the whole process, which would change what the other tests' safe loading accepts.
pytestmark = [
    pytest.mark.dist,
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None,
                       reason="megatron-core is the optional test extra 'megatron' (pip install -e '.[test,megatron]', Python 3.11)"),
]
WORKER = str(ROOT / "tests" / "mcore_worker.py")
LAYOUTS = {"tp2": (2, 1), "pp2": (1, 2)}


def megatron_run(scenario: str, ckpt, out, tp: int, pp: int, bf16: bool = False, **extra: str) -> None:
    os.makedirs(out, exist_ok=True)
    env = {**worker_env(), "MCORE_TP": str(tp), "MCORE_PP": str(pp), "MCORE_BF16": "1" if bf16 else "0", **extra}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", WORKER, scenario, str(ckpt), str(out)]
    run_workers(cmd, env, timeout=300)


@pytest.fixture(scope="module")
def megatron_saved(tmp_path_factory):
    """megatron-core's checkpoints after one step at TP2 and at PP2, its logits there, and its run's losses."""
    root = tmp_path_factory.mktemp("mcore")
    runs = {}
    for name, (tp, pp) in LAYOUTS.items():
        megatron_run("save-legacy", root / name / "ckpt", root / name / "out", tp, pp)
        with open(root / name / "out" / "losses.json") as f:
            losses = json.load(f)
        runs[name] = (root / name / "ckpt", torch.load(root / name / "out" / "logits.pt"), losses)
    return runs


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_megatron_core_checkpoint_to_hf_has_its_logits(tmp_path, megatron_saved, layout):
    ckpt, logits, _ = megatron_saved[layout]
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert model.config.vocab_size == VOCAB  # Megatron's padding (256) is not part of the exported model
    with torch.no_grad():
        ours = model(input_ids=batch(99)[:, :-1]).logits
    assert logits.shape[-1] == 256 and ours.shape[-1] == VOCAB
    torch.testing.assert_close(ours, logits[..., :VOCAB], rtol=0, atol=1e-5)


@pytest.mark.parametrize("src,dst", [("tp2", "pp2"), pytest.param("pp2", "tp2", marks=pytest.mark.slow)])
def test_megatron_core_resumes_our_checkpoint_exactly(tmp_path, megatron_saved, src, dst):
    """megatron-core's TP2 checkpoint -> ours at PP2 (and back the other way) -> megatron-core loads model and
    optimizer and trains on: the same losses as the run that never stopped (bit for bit TP2 -> PP2 here; a TP
    split sums in another order, so to float rounding the other way). The padded
    vocabulary rows (part of Megatron's softmax) travel with the checkpoint."""
    ckpt, _, uninterrupted = megatron_saved[src]
    tp, pp = LAYOUTS[dst]
    write_megatron(read_megatron(str(ckpt)), str(tmp_path / "ours"), tp, pp, te_names=False)  # megatron-core's local spec
    megatron_run("load-legacy+optimizer", tmp_path / "ours", tmp_path / "out", tp, pp)
    with open(tmp_path / "out" / "losses.json") as f:
        resumed = json.load(f)
    assert resumed == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)
    assert resumed[-1] != pytest.approx(uninterrupted[0], abs=1e-3)  # it trained on, from where it stopped
    # and Megatron-LM's RNG restore took every rank's state, no --no-load-rng (the worker checks megatron-core's seeds)
    assert json.loads((tmp_path / "out" / "rng.json").read_text()) == {"restored": True}


@pytest.mark.slow  # megatron-core -> universal -> Megatron, bit-exact: the [distopt] row and resumes_our_checkpoint_exactly
def test_megatron_core_checkpoint_through_universal_keeps_every_byte(tmp_path, megatron_saved):
    """megatron-core TP2 -> universal -> Megatron TP2: each rank's tensors as megatron-core saved them,
    padded vocabulary rows and Adam moments included."""
    from converters.megatron import load_megatron_file, locate

    ckpt, _, _ = megatron_saved["tp2"]
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    for src, dst, extra in ((ckpt, tmp_path / "uni", ["--to", "universal"]),
                            (tmp_path / "uni", tmp_path / "meg", ["--to", "megatron", "--tp", "2", "--transformer-impl", "local"])):
        done = subprocess.run(cli + [str(src), str(dst), *extra], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr
    verify = subprocess.run([sys.executable, "-m", "converters.cli", "verify", str(tmp_path / "meg")], capture_output=True,
                            text=True, env=worker_env(), cwd=ROOT)
    assert verify.returncode == 0, verify.stdout + verify.stderr  # our manifest beside Megatron's files
    theirs, ours = locate(str(ckpt)), locate(str(tmp_path / "meg"))
    assert (ours.tp, ours.pp, ours.iteration) == (2, 1, 1)
    for key, path in theirs.paths.items():
        a, b = load_megatron_file(path), load_megatron_file(ours.paths[key])
        tensors = {k: v for k, v in a["model"].items() if isinstance(v, torch.Tensor)}
        assert tensors.keys() == {k for k, v in b["model"].items() if isinstance(v, torch.Tensor)}
        for name, t in tensors.items():
            assert torch.equal(t, b["model"][name]), (key, name)
        sa, sb = a["optimizer"]["state"], b["optimizer"]["state"]
        assert sa.keys() == sb.keys()
        for pid in sa:
            for k in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(sa[pid][k], sb[pid][k]), (key, pid, k)


# --- torch_dist ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def megatron_dist_saved(tmp_path_factory):
    """megatron-core's own dist_checkpointing.save (torch_dist) after one step at TP2: model and optimizer."""
    root = tmp_path_factory.mktemp("mcore_dist")
    megatron_run("save-dist", root / "ckpt", root / "out", 2, 1)
    with open(root / "out" / "losses.json") as f:
        losses = json.load(f)
    return root / "ckpt", torch.load(root / "out" / "logits.pt"), losses


def test_megatron_core_torch_dist_to_hf_has_its_logits(tmp_path, megatron_dist_saved):
    ckpt, logits, _ = megatron_dist_saved
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(ckpt), str(tmp_path / "hf"), "--to", "hf"],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        ours = model(input_ids=batch(99)[:, :-1]).logits
    torch.testing.assert_close(ours, logits[..., :VOCAB], rtol=0, atol=1e-5)


def test_megatron_core_torch_dist_exports_views_of_its_chunks_without_torch(tmp_path, megatron_dist_saved):
    """megatron-core's TP2 torch_dist, where each layer's weight lies in one chunk per TP rank: every Hugging Face
    tensor is offered as views of those chunks in the data files (rows copied file to file, a row-parallel
    weight's rows gathered from both chunks), byte for byte the tensor the reader's torch path merges; and the
    export (the config's answers kept after the first) imports neither torch nor transformers."""
    from converters.dcp import DCPReader
    from converters.megatron_dist import read_megatron_dist
    from interop.tensors import raw_bytes

    ckpt_dir, _, _ = megatron_dist_saved
    reader = DCPReader(str(ckpt_dir / "iter_0000001") if (ckpt_dir / "iter_0000001").is_dir() else str(ckpt_dir))
    tiles = {k: reader.tiles(k, (0,) if k.startswith("decoder.layers.") else ()) for k in reader.tensor_keys() if not k.startswith("optimizer.")}
    assert {t.dim for t in tiles.values() if len(t.pieces) == 2} == {0, 1}  # column- and row-parallel weights, in 2 chunks
    ckpt = read_megatron_dist(str(ckpt_dir))
    for name, t in ckpt.model.items():
        pieces = t.mapped_pieces() if t.mapped_pieces is not None else None
        assert pieces is not None, name
        assert b"".join(bytes(p.data) for p in pieces) == bytes(raw_bytes(t.load())), name
    env = dict(worker_env(), INTEROP_CACHE_DIR=str(tmp_path / "kept"))
    probe = ("import sys; from converters import cli; rc = cli.main(sys.argv[1:]); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    seen = []
    for out in ("first", "again"):
        done = subprocess.run([sys.executable, "-c", probe, "convert", str(ckpt_dir), str(tmp_path / out), "--to", "hf"],
                              env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip().splitlines()[-1])
    assert seen[1] == "[]", seen


def test_megatron_core_loads_our_torch_dist_on_another_layout(tmp_path, megatron_dist_saved):
    """megatron-core's TP2 torch_dist -> universal -> ours (`--to megatron-dist`) -> megatron-core at PP2 loads
    model and optimizer with dist_checkpointing.load and trains on with the uninterrupted run's losses."""
    ckpt, _, uninterrupted = megatron_dist_saved
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    for src, dst, extra in ((ckpt, tmp_path / "uni", ["--to", "universal"]),
                            (tmp_path / "uni", tmp_path / "ours", ["--to", "megatron-dist", "--tp", "2"])):
        done = subprocess.run(cli + [str(src), str(dst), *extra], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr
    megatron_run("load-dist+optimizer", tmp_path / "ours", tmp_path / "out", 1, 2)  # --load DST, as Megatron-LM
    with open(tmp_path / "out" / "losses.json") as f:
        resumed = json.load(f)
    assert resumed == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)


# --- the distributed optimizer ------------------------------------------------------------------------------
def assert_universal_equal(a, b) -> None:
    """``interop diff``: every tensor of the two universal checkpoints (weights, moments, step) bit-exact."""
    done = subprocess.run([sys.executable, "-m", "converters.cli", "diff", str(a), str(b)], capture_output=True, text=True,
                          env=worker_env(), cwd=ROOT)
    compared = re.search(r"(\d+) compared, (\d+) exact, 0 within atol, 0 different; 0 only in A, 0 only in B", done.stdout)
    tensors = json.loads((a / "manifest.json").read_text())["tensors"]
    assert done.returncode == 0 and compared and compared[1] == compared[2] and int(compared[1]) >= len(tensors), done.stdout
@pytest.mark.parametrize("plain", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["distopt", "distopt-and-plain"])
def test_distributed_optimizer_checkpoint_continues_on_another_layout(tmp_path, plain):
    """megatron-core's DistributedOptimizer at data parallel 2 (distrib_optim.pt: fp32 main params and Adam
    moments of the whole rank, flat in the gradient buffer's layout) -> universal -> Megatron at TP2 -> megatron-core
    loads it and trains on with the uninterrupted data-parallel run's losses."""
    megatron_run("save-legacy-distopt", tmp_path / "ckpt", tmp_path / "out", 1, 1)
    with open(tmp_path / "out" / "losses.json") as f:
        uninterrupted = json.load(f)
    assert (tmp_path / "ckpt" / "iter_0000001" / "mp_rank_00" / "distrib_optim.pt").is_file()
    source = read_megatron(str(tmp_path / "ckpt"))
    assert sorted(source.optimizer.tensors) == ["exp_avg", "exp_avg_sq"] and source.step == 1
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    for src, dst, extra in ((tmp_path / "ckpt", tmp_path / "uni", ["--to", "universal"]),
                            (tmp_path / "uni", tmp_path / "ours", ["--to", "megatron", "--tp", "2", "--transformer-impl", "local"])):
        done = subprocess.run(cli + [str(src), str(dst), *extra], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr
    if plain:  # megatron-core's own plain optimizer takes what we read from distrib_optim.pt
        megatron_run("load-legacy+optimizer", tmp_path / "ours", tmp_path / "resumed", 2, 1)
        with open(tmp_path / "resumed" / "losses.json") as f:
            assert json.load(f) == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)

    # and written for the distributed optimizer at TP2 x DP1: megatron-core's own load_parameter_state takes it
    done = subprocess.run(cli + [str(tmp_path / "uni"), str(tmp_path / "ours-dist"), "--to", "megatron", "--tp", "2",
                                 "--transformer-impl", "local", "--use-distributed-optimizer"],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "ours-dist" / "iter_0000001" / "mp_rank_01" / "distrib_optim.pt").is_file()
    megatron_run("load-legacy-distopt", tmp_path / "ours-dist", tmp_path / "resumed-dist", 2, 1)
    with open(tmp_path / "resumed-dist" / "losses.json") as f:
        assert json.load(f) == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)
    # and it reads back: through our distrib_optim.pt and back to universal, every tensor bit-exact
    done = subprocess.run(cli + [str(tmp_path / "ours-dist"), str(tmp_path / "back"), "--to", "universal"],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert_universal_equal(tmp_path / "uni", tmp_path / "back")


# under -m slow (a megatron-core bf16 run, its save, our round trip and its resume: 28 s): by default
# test_megatron.py's test_bf16_torch_dist_keeps_the_fp32_masters_bit_exact keeps the bf16 layout's masters bit for bit
@pytest.mark.slow
@pytest.mark.parametrize("pp2", [False, True], ids=["tp2", "tp2-and-pp2"])
def test_bf16_torch_dist_with_fp32_main_params_round_trips_and_loads(tmp_path, pp2):
    """megatron-core in bf16 (Float16Module, Float16OptimizerWithFloat16Params) saves torch_dist at TP2: its fp32
    main params are the masters. -> universal -> torch_dist at TP2: every stored tensor (bf16 weights, fp32 main
    params, Adam moments) bit-identical to megatron-core's, and megatron-core loads ours with dist_checkpointing.load
    and trains on with the uninterrupted run's losses."""
    from converters.dcp import DCPReader

    megatron_run("save-dist", tmp_path / "ckpt", tmp_path / "out", 2, 1, bf16=True)
    with open(tmp_path / "out" / "losses.json") as f:
        uninterrupted = json.load(f)
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    for src, dst, extra in ((tmp_path / "ckpt", tmp_path / "uni", ["--to", "universal"]),
                            (tmp_path / "uni", tmp_path / "ours", ["--to", "megatron-dist", "--tp", "2"])):
        done = subprocess.run(cli + [str(src), str(dst), *extra], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "uni" / "manifest.json").read_text())
    assert manifest["source"]["dtype"] == "bfloat16" and manifest["source"]["master_dtype"] == "float32"
    theirs, ours = DCPReader(str(tmp_path / "ckpt")), DCPReader(str(tmp_path / "ours" / "iter_0000001"))
    masters = [k for k in theirs.tensor_keys() if k.startswith("optimizer.state.fp32_param.")]
    assert masters and all(theirs.spec(k).dtype == torch.float32 for k in masters)
    for key in theirs.tensor_keys():
        assert torch.equal(theirs.read(key), ours.read(key)), key
    megatron_run("load-dist+optimizer", tmp_path / "ours", tmp_path / "resumed", 2, 1, bf16=True)
    with open(tmp_path / "resumed" / "losses.json") as f:
        assert json.load(f) == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)
    if not pp2:
        return
    # at PP2 the bf16 matmuls split differently: their own rounding (about 3e-5 relative here), not the checkpoint's
    megatron_run("load-dist+optimizer", tmp_path / "ours", tmp_path / "resumed-pp2", 1, 2, bf16=True)
    with open(tmp_path / "resumed-pp2" / "losses.json") as f:
        assert json.load(f) == pytest.approx(uninterrupted[1:], rel=1e-4)


# both layouts under -m slow (the suite's time): the default run keeps the legacy distrib_optim.pt test above and
# megatron-core loading our torch_dist on another layout
@pytest.mark.parametrize("layout", [pytest.param("dp_reshardable", marks=pytest.mark.slow),
                                    pytest.param("fully_reshardable", marks=pytest.mark.slow)])
def test_torch_dist_distributed_optimizer_continues_on_another_layout(tmp_path, layout):
    """megatron-core's DistributedOptimizer at DP2 saved to torch_dist in Megatron-LM's default dp_reshardable layout
    (flat fp32 buckets per TP x PP rank) or in fully_reshardable (optimizer.state.{param,exp_avg,exp_avg_sq}.*) ->
    universal -> ours at TP2 in the same layout -> megatron-core reads its content metadata, loads, and continues
    the losses. Through our dp_reshardable and back, universal is bit-exact."""
    megatron_run("save-dist-distopt", tmp_path / "ckpt", tmp_path / "out", 1, 1, MCORE_DISTOPT_LAYOUT=layout)
    with open(tmp_path / "out" / "losses.json") as f:
        uninterrupted = json.load(f)
    cli = [sys.executable, "-m", "converters.cli"]
    target = ["--dist-optim-layout", layout, "--transformer-impl", "local"] if layout == "dp_reshardable" else ["--use-distributed-optimizer"]
    for src, dst, extra in ((tmp_path / "ckpt", tmp_path / "uni", ["--to", "universal"]),
                            (tmp_path / "uni", tmp_path / "ours", ["--to", "megatron-dist", "--tp", "2", *target]),
                            (tmp_path / "ours", tmp_path / "back", ["--to", "universal"])):
        done = subprocess.run(cli + ["convert", str(src), str(dst), *extra], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr
    uni = json.loads((tmp_path / "uni" / "manifest.json").read_text())
    assert uni["step"] == 1 and {"optimizer/exp_avg/model.norm.weight", "optimizer/exp_avg_sq/model.norm.weight"} <= set(uni["tensors"])
    assert_universal_equal(tmp_path / "uni", tmp_path / "back")
    megatron_run("load-dist-distopt", tmp_path / "ours", tmp_path / "resumed", 2, 1, MCORE_DISTOPT_LAYOUT=layout)
    with open(tmp_path / "resumed" / "losses.json") as f:
        assert json.load(f) == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)
    # at the TP x PP it was written for, Megatron-LM's load asks for each rank's rng_state object and restores it
    assert json.loads((tmp_path / "resumed" / "rng.json").read_text()) == {"restored": True}


# --- the distributed optimizer's buffer: a tied embedding's buckets, --overlap-grad-reduce's buckets -----------------
def convert(src, dst, *extra: str) -> None:
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(dst), *extra], capture_output=True,
                          text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr


def resumed_losses(scenario: str, ckpt, out, tp: int, pp: int, **extra: str) -> list[float]:
    megatron_run(scenario, ckpt, out, tp, pp, **extra)
    with open(out / "losses.json") as f:
        return json.load(f)


def test_a_tied_model_on_two_stages_with_the_distributed_optimizer_reads_and_loads(tmp_path):
    """megatron-core, embedding tied to the output layer, at PP2 with --use-distributed-optimizer: the last stage
    keeps its own copy of the embedding (output_layer.weight), in a bucket of its own in distrib_optim.pt. Read
    (-> universal -> TP2 at one stage, which megatron-core loads and trains on with the uninterrupted run's
    losses), and written back at PP2 (megatron-core's load_parameter_state takes it, the same losses)."""
    tied = {"MCORE_TIED": "1"}
    uninterrupted = resumed_losses("save-legacy-distopt", tmp_path / "ckpt", tmp_path / "out", 1, 2, **tied)
    convert(tmp_path / "ckpt", tmp_path / "uni", "--to", "universal")
    for name, tp, pp in (("tp2", 2, 1), ("pp2", 1, 2)):
        convert(tmp_path / "uni", tmp_path / name, "--to", "megatron", "--tp", str(tp), "--pp", str(pp), "--transformer-impl",
                "local", "--use-distributed-optimizer")
        resumed = resumed_losses("load-legacy-distopt", tmp_path / name, tmp_path / f"resumed-{name}", tp, pp, **tied)
        assert resumed == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5), name


@pytest.mark.parametrize("fmt", ["torch_dist", pytest.param("torch", marks=pytest.mark.slow)])
def test_overlap_grad_reduce_buckets_are_read_and_written(tmp_path, fmt):
    """megatron-core with --overlap-grad-reduce --ddp-bucket-size 7000 at DP2 (Megatron-LM's production setting; its
    default bucket is 40M parameters): the distributed optimizer's state in six buckets, torch_dist's dp_reshardable
    layout (a tensor per bucket) or distrib_optim.pt (the buckets concatenated, their end padding dropped). Read
    with the bucket size the saved args give -> universal -> TP2 -> megatron-core (no buckets) trains on with the
    uninterrupted run's losses. And written for a run with those buckets (the same flags to convert), which
    megatron-core loads with them: without the flags it refuses ours (its buckets are not ours)."""
    bucket = {"MCORE_BUCKET": "7000", "MCORE_DISTOPT_LAYOUT": "dp_reshardable"}
    scenario = "save-dist-distopt" if fmt == "torch_dist" else "save-legacy-distopt"
    uninterrupted = resumed_losses(scenario, tmp_path / "ckpt", tmp_path / "out", 1, 1, **bucket)
    if fmt == "torch_dist":
        from converters.dcp import DCPReader

        keys = DCPReader(str(tmp_path / "ckpt" / "iter_0000001")).tensor_keys()
        assert len({k.rsplit(".", 1)[0] for k in keys if ".bucket_idx_" in k}) == 6
    convert(tmp_path / "ckpt", tmp_path / "uni", "--to", "universal")
    convert(tmp_path / "uni", tmp_path / "ours", "--to", "megatron", "--tp", "2", "--transformer-impl", "local", "--use-distributed-optimizer")
    resumed = resumed_losses("load-legacy-distopt", tmp_path / "ours", tmp_path / "resumed", 2, 1)
    assert resumed == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)

    flags = ["--overlap-grad-reduce", "--ddp-bucket-size", "7000"]
    if fmt == "torch_dist":
        convert(tmp_path / "uni", tmp_path / "bucketed", "--to", "megatron-dist", "--tp", "1", "--dist-optim-layout", "dp_reshardable",
                "--transformer-impl", "local", *flags)
        resumed = resumed_losses("load-dist-distopt", tmp_path / "bucketed", tmp_path / "resumed-bucketed", 1, 1, **bucket)
    else:
        convert(tmp_path / "uni", tmp_path / "bucketed", "--to", "megatron", "--tp", "2", "--transformer-impl", "local",
                "--use-distributed-optimizer", *flags)
        resumed = resumed_losses("load-legacy-distopt", tmp_path / "bucketed", tmp_path / "resumed-bucketed", 2, 1, **bucket)
    assert resumed == pytest.approx(uninterrupted[1:], rel=0, abs=1e-5)
    convert(tmp_path / "bucketed", tmp_path / "back", "--to", "universal")  # our args record the buckets: read back exactly
    assert_universal_equal(tmp_path / "uni", tmp_path / "back")
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(tmp_path / "uni"), str(tmp_path / "half"), "--to",
                           "megatron", "--use-distributed-optimizer", "--ddp-bucket-size", "7000"], capture_output=True, text=True,
                          env=worker_env(), cwd=ROOT)
    assert done.returncode != 0 and "--ddp-bucket-size sizes --overlap-grad-reduce's buckets" in done.stderr
    assert not (tmp_path / "half").exists()
