"""Megatron MoE checkpoints (torch_dist): a Mixtral's router and SequentialMLP experts written as megatron-core
stacks them (``decoder.layers.mlp.experts.experts.linear_fc1.weight``: [layers, experts, ...]), loaded by
megatron-core's own MoE GPT model at EP2 and at TP2 on gloo with transformers' logits, and megatron-core's own save
of it at EP2 read back exactly. What is not mapped (Transformer Engine's grouped-GEMM experts in legacy files, the
distributed optimizer's flat buckets of a MoE model) is refused in one line, never half-done; megatron-core's MoE
optimizers (dense and expert, chained; plain or distributed in the fully_reshardable layout) are read and written,
and megatron-core resumes from them.

Megatron-LM's legacy per-rank files of a MoE run (``mp_rank_TT[_PPP]_EEE``: each expert-parallel rank's file holds
the dense layers and its experts numbered from 0, and at EP > 1 a ChainedOptimizer's list of the dense and expert
optimizers) are read and written at any EP x TP x PP, judged the same way."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers

from converters import registry
from converters.megatron_arch import MegatronArch
from converters.megatron_dist import COMMON
from converters.megatron import load_megatron_file
from interop.errors import ConversionError
from tests import architectures
from tests.conftest import ROOT, run_workers, worker_env

pytestmark = pytest.mark.dist


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converters.cli", *map(str, args)], capture_output=True, text=True,
                          env=worker_env(), cwd=ROOT)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny MoE model as save_pretrained writes it, and its torch_dist conversion at TP2 for megatron-core's local
    spec, the one that runs on CPU (made once per model)."""
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(name)
            model, hf = architectures.saved(root, name)
            done = cli("convert", hf, root / "dist", "--to", "megatron-dist", "--tp", "2", "--transformer-impl", "local")
            assert done.returncode == 0, done.stderr
            made[name] = model.eval(), hf, root / "dist"
        return made[name]
    return get


@pytest.fixture(scope="module")
def mixtral(converted):
    return converted("mixtral")


def test_the_arguments_are_megatron_lms_moe_flags(converted):
    """Mixtral renormalises its top-k weights (Megatron's default order); Qwen3-MoE with norm_topk_prob=False
    does not: --moe-router-pre-softmax (softmax over every expert, then the top k), and --qk-layernorm."""
    common = "iter_0000000/" + COMMON
    wanted = {"num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 52, "moe_grouped_gemm": False,
              "moe_router_score_function": "softmax", "moe_router_pre_softmax": False, "swiglu": True, "tensor_model_parallel_size": 2}
    args = vars(load_megatron_file(str(converted("mixtral")[2] / common))["args"])
    assert {k: args.get(k) for k in wanted} == wanted
    qwen = converted("qwen3_moe")
    assert qwen[0].config.norm_topk_prob is False
    args = vars(load_megatron_file(str(qwen[2] / common))["args"])
    wanted = {**wanted, "moe_ffn_hidden_size": qwen[0].config.moe_intermediate_size, "moe_router_pre_softmax": True, "qk_layernorm": True}
    assert {k: args.get(k) for k in wanted} == wanted
    qwen2 = converted("qwen2_moe")  # a shared expert scaled by a sigmoid gate, q/k/v biases
    args = vars(load_megatron_file(str(qwen2[2] / common))["args"])
    wanted = {**{k: v for k, v in wanted.items() if k != "qk_layernorm"}, "moe_shared_expert_intermediate_size": qwen2[0].config.shared_expert_intermediate_size,
              "moe_shared_expert_gate": True, "add_qkv_bias": True, "add_bias_linear": False}
    assert {k: args.get(k) for k in wanted} == wanted


# under -m slow for the suite's time: the default run's torch_dist MoE row at EP2 is GPT-OSS's (below: SequentialMLP experts
# split over expert ranks, megatron-core's own save read back), the Mixtral's logits at EP2 are its legacy files' (below);
# Qwen2-MoE's shared expert's arguments are checked above by default
LOADS = [pytest.param("mixtral", 2, marks=pytest.mark.slow), pytest.param("mixtral", 1, marks=pytest.mark.slow), pytest.param("qwen3_moe", 2, marks=pytest.mark.slow),
         pytest.param("qwen2_moe", 2, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("name", "ep"), LOADS, ids=["mixtral-ep2", "mixtral-tp2", "qwen3_moe-ep2", "qwen2_moe-ep2"])
def test_megatron_core_loads_it_with_transformers_logits(converted, tmp_path, name, ep):
    """megatron-core's MoE GPTModel (SequentialMLP experts, local spec) on 2 gloo processes, experts split over
    2 expert-parallel ranks or tensor-parallel 2: every key loaded (strict), each rank holds its share of the
    experts, logits equal transformers' on the source (Qwen3-MoE: its q/k norms and its pre-softmax routing;
    Qwen2-MoE: its gated shared expert and q/k/v biases).
    At EP2 megatron-core then saves the model itself (the arguments of a Megatron-LM run: no Hugging Face model
    type), and interop reads every tensor back exactly, the model type worked out from the arguments."""
    model, hf, dist = converted(name)
    ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
    torch.save(ids, dist / "ids.pt")
    own = tmp_path / "own"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "mcore_moe_worker.py"), "logits", str(dist), *([str(own)] if ep == 2 else [])]
    env = {**worker_env(), "MCORE_EP": str(ep)}
    run_workers(cmd, env, timeout=600)
    ranks = sorted((r["rank"], r["ep_rank"], r["local_experts"]) for r in (json.loads((dist / f"rank{i}.json").read_text()) for i in range(2)))
    # each rank's expert tensors: 2 layers x (fc1, fc2) x the experts it holds
    assert ranks == ([(0, 0, 8), (1, 1, 8)] if ep == 2 else [(0, 0, 16), (1, 0, 16)])
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(dist / "mcore_logits.pt"), expected, rtol=0, atol=1e-5)
    if ep == 2:
        fmt, ckpt = registry.read(str(own))
        assert (fmt.name, ckpt.source["ep"], ckpt.config["model_type"]) == ("megatron-dist", 2, name)
        report = cli("diff", hf, own)
        n = len(model.state_dict()) + (4 * 3 - 2) * 2  # the files hold each layer's experts one tensor each
        assert report.returncode == 0 and f"{n} compared, {n} exact, 0 within atol, 0 different; 0 only in A, 0 only in B" in report.stdout, report.stdout


def test_through_torch_dist_and_back_is_exact(mixtral, tmp_path):
    """HF -> megatron-dist (TP2, PP2) -> HF: every expert and the router bit-exact, from_pretrained's logits equal.
    The pre-MLP norm of a MoE layer is its own module: named as Transformer Engine's MoE spec saves it by default
    (pre_mlp_layernorm), as the local spec's key map does with --transformer-impl local."""
    from torch.distributed.checkpoint import FileSystemReader

    model, hf, local = mixtral
    assert cli("convert", hf, tmp_path / "d", "--to", "megatron-dist", "--tp", "2", "--pp", "2").returncode == 0
    for where, norm in ((tmp_path / "d", "decoder.layers.pre_mlp_layernorm.weight"), (local, "decoder.layers.mlp.linear_fc1.layer_norm_weight")):
        keys = set(FileSystemReader(str(where / "iter_0000000")).read_metadata().state_dict_metadata)
        other = ({"decoder.layers.pre_mlp_layernorm.weight", "decoder.layers.mlp.linear_fc1.layer_norm_weight"} - {norm}).pop()
        assert norm in keys and other not in keys
    assert cli("convert", tmp_path / "d", tmp_path / "back", "--to", "hf").returncode == 0
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back").eval()
    theirs = model.state_dict()
    assert {k: bool(torch.equal(t, theirs[k])) for k, t in back.state_dict().items()} == {k: True for k in theirs}


def test_what_is_not_mapped_is_refused_or_noted(mixtral, tmp_path):
    """Grouped-GEMM experts, shared experts on a model without them and other routers in a run's arguments are
    refused, and so are chained optimizers that name different layouts, with nothing written;
    experts that do not split over --ep-size, and --ep-size on a dense model, are refused in one line."""
    _, hf, _ = mixtral
    done = cli("convert", hf, tmp_path / "legacy", "--to", "megatron", "--ep-size", "3")
    assert done.returncode == 2 and not (tmp_path / "legacy").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "interop convert: error: 4 experts do not split over 3 expert-parallel ranks (--ep-size 3)")
    _, llama = architectures.saved(tmp_path / "llama", "llama")
    done = cli("convert", llama, tmp_path / "dense", "--to", "megatron-dist", "--ep-size", "2")
    assert done.returncode == 2 and not (tmp_path / "dense").exists()
    assert done.stderr.strip().splitlines()[-1] == "interop convert: error: --ep-size 2: a llama model has no experts to split"
    args = vars(load_megatron_file(str(mixtral[2] / "iter_0000000" / COMMON))["args"])
    for flag, value, what in (("moe_grouped_gemm", True, "grouped-GEMM experts"), ("moe_router_score_function", "sigmoid", "a router score function"),
                              ("moe_shared_expert_intermediate_size", 64, "shared experts")):
        with pytest.raises(ConversionError, match=rf"common.pt: this MoE run has {what}.*\(--{flag.replace('_', '-')} {value}\); the Megatron MoE map reads"):
            MegatronArch.from_args({**args, flag: value}, "common.pt")

    # a MoE run's chained optimizers name one distributed-optimizer layout each: parts that differ are refused
    from converters.megatron_dist import _sharding_type
    from interop.errors import CorruptCheckpointError

    with pytest.raises(CorruptCheckpointError, match="common.pt: optimizer chains parts of different layouts"):
        _sharding_type({0: {"param_state_sharding_type": "fully_reshardable"}, 1: {"param_state_sharding_type": "dp_reshardable"}}, "common.pt")


# (the default run's MoE resume row is GLM-4.5's dp_reshardable below: the same buckets, chained, with a dense layer first;
# megatron-core's plain chained optimizers are GPT-OSS's slow row)
@pytest.mark.parametrize("optimizer", [pytest.param("megatron", marks=pytest.mark.slow), pytest.param("dp_reshardable", marks=pytest.mark.slow),
                                       pytest.param("fully_reshardable", marks=pytest.mark.slow)])
def test_megatron_core_resumes_a_moe_run_through_universal(mixtral, tmp_path, optimizer):
    """megatron-core trains the Mixtral one step at EP2 with its own optimizers for a MoE model (a ChainedOptimizer
    of the dense and the expert parameters'), megatron-core's plain ones or, with --use-distributed-optimizer, two
    DistributedOptimizers over DistributedDataParallel's dense and expert buffers (torch_dist's dp_reshardable
    layout, Megatron-LM's default: flat buckets of the dense optimizer per TP x PP rank and of the experts' per
    expert rank; or fully_reshardable, --dist-ckpt-optim-fully-reshardable), and saves it; interop reads every
    expert's Adam moments from it, goes through universal and back to torch_dist in the same layout; megatron-core
    loads model and optimizer at EP2 and trains on with the uninterrupted run's losses."""
    def check(u):
        assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in u.optimizer.tensors["exp_avg"]
        assert [len(g["params"]) for g in u.optimizer.param_groups] == [12, 5, 24]  # dense decay (router included), norms, experts

    resumes_through_universal(mixtral[2], tmp_path, optimizer, check)


def resumes_through_universal(source, tmp_path, optimizer: str, check) -> None:
    """megatron-core trains ``source`` a step at EP2 (``optimizer``: its plain chained optimizers, "megatron", or a
    distributed layout) and saves; through universal (``check``-ed) and back to torch_dist in the same layout, tensor
    for tensor; megatron-core loads it and trains on with the uninterrupted run's losses."""
    own, back, resumed = tmp_path / "own", tmp_path / "back", tmp_path / "resumed"
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "tests" / "mcore_moe_worker.py")]
    env = {**worker_env(), "MCORE_EP": "2", **({"MCORE_DISTOPT": optimizer} if optimizer != "megatron" else {})}
    run_workers(worker + ["train-save", str(source), str(own)], env, timeout=600)
    done = cli("convert", own, tmp_path / "u", "--to", "universal")
    assert done.returncode == 0, done.stderr
    check(registry.read(str(tmp_path / "u"))[1])
    target = [] if optimizer == "megatron" else ["--dist-optim-layout", optimizer]
    assert cli("convert", tmp_path / "u", back, "--to", "megatron-dist", "--transformer-impl", "local", *target).returncode == 0
    report = cli("diff", own, back)
    assert " 0 different; 0 only in A, 0 only in B" in report.stdout and " 0 exact" not in report.stdout, report.stdout
    resumed.mkdir()
    run_workers(worker + ["load-train", str(back), str(resumed)], env, timeout=600)
    expected = json.loads((own / "losses.json").read_text())
    assert json.loads((resumed / "losses.json").read_text()) == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("layout", ["dp_reshardable", pytest.param("fully_reshardable", marks=pytest.mark.slow)])
def test_expert_tensor_parallel_run_resumes_through_universal(mixtral, tmp_path, layout):
    """Megatron-LM's MoE recipes split the experts over their own tensor-parallel size
    (--expert-tensor-parallel-size 1 beside TP 2): megatron-core trains the Mixtral a step at TP2 x EP2 with ETP1
    (4 processes) and saves; the experts' buffers are per expert tensor x expert rank, each expert whole in them.
    interop reads it (the dp_reshardable read had failed, "holds no distributed-optimizer bucket ...dp_group_idx_2"),
    keeps the size through universal (a note says the target takes it), writes the same layout tensor for tensor,
    and megatron-core loads it at ETP1 and trains on with the uninterrupted run's losses. A legacy target, which is
    written with the two sizes equal, and a size that does not divide TP are refused in one line."""
    _, _, dist = mixtral
    own, back, resumed = tmp_path / "own", tmp_path / "back", tmp_path / "resumed"
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=4", str(ROOT / "tests" / "mcore_moe_worker.py")]
    env = {**worker_env(), "MCORE_EP": "2", "MCORE_ETP": "1", "MCORE_DISTOPT": layout}
    run_workers(worker + ["train-save", str(dist), str(own)], env, timeout=600)
    assert cli("convert", own, tmp_path / "u", "--to", "universal").returncode == 0
    assert registry.read(str(tmp_path / "u"))[1].source["etp"] == 1
    done = cli("convert", tmp_path / "u", back, "--to", "megatron-dist", "--transformer-impl", "local", "--dist-optim-layout", layout)
    assert done.returncode == 0, done.stderr
    assert "note: --expert-tensor-parallel-size 1: the source's" in done.stdout + done.stderr
    report = cli("diff", own, back)
    assert " 0 different; 0 only in A, 0 only in B" in report.stdout and " 0 exact" not in report.stdout, report.stdout
    resumed.mkdir()
    run_workers(worker + ["load-train", str(back), str(resumed)], env, timeout=600)
    assert json.loads((resumed / "losses.json").read_text()) == pytest.approx(json.loads((own / "losses.json").read_text()), rel=1e-6)
    for target, says in ((["--to", "megatron"], "--expert-tensor-parallel-size 1 with --tp 2: legacy files are written with the two equal; "
                                                "convert --to megatron-dist for such a run"),
                         (["--to", "megatron-dist", "--tp", "2", "--expert-tensor-parallel-size", "3"],
                          "--expert-tensor-parallel-size 3: an expert tensor-parallel size of 3 with TP 2: read and written where it divides TP")):
        bad = cli("convert", tmp_path / "u", tmp_path / "bad", *target)
        assert bad.returncode == 2 and not (tmp_path / "bad").exists()
        assert bad.stderr.strip().splitlines()[-1] == f"interop convert: error: {says}", bad.stderr


def test_a_damaged_chained_optimizer_entry_is_one_named_error(tmp_path):
    """A MoE run's common.pt with the distributed optimizer holds megatron-core's chained parts ({0: dense, 1:
    experts}); a value of another type in a part (a hyper-parameter, the layout's name) is one line naming common.pt
    and the key, nothing written: each part is checked, not passed as a single part's unknown keys."""
    import torch as real_torch

    from trainers.base import BaseTrainer, TrainerConfig

    BaseTrainer(TrainerConfig(model="mixtral", steps=1, batch_size=2, seq_len=8, save_every=1, output_dir=str(tmp_path / "run"))).train()
    for layout in ("fully_reshardable", "dp_reshardable"):
        source = tmp_path / layout
        done = cli("convert", tmp_path / "run" / "checkpoint-1", source, "--to", "megatron-dist", "--ep-size", "2",
                   "--dist-optim-layout", layout, "--transformer-impl", "local")
        assert done.returncode == 0, done.stderr
        assert cli("convert", source, tmp_path / f"{layout}-ok", "--to", "universal").returncode == 0  # as written, it reads
        # Megatron-LM's files alone (no manifest whose digests would catch the change first)
        bare = shutil.copytree(source, tmp_path / f"{layout}-bare", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
        common_path = bare / "iter_0000001" / COMMON
        common = real_torch.load(common_path, weights_only=False)
        assert sorted(common["optimizer"]) == [0, 1]
        common["optimizer"][1]["param_state_sharding_type"] = ["dp_reshardable"]
        real_torch.save(common, common_path)
        done = cli("convert", bare, tmp_path / f"{layout}-out", "--to", "universal")
        assert done.returncode != 0 and not (tmp_path / f"{layout}-out").exists()
        assert done.stderr.strip().splitlines()[-1].endswith(
            f"{common_path}: optimizer[1].param_state_sharding_type is a list of 1, not a str"), done.stderr


@pytest.mark.slow  # two more megatron-core runs; the dp_reshardable row above reads and writes the default layout
def test_one_moe_run_saved_in_both_distributed_layouts_reads_the_same(mixtral, tmp_path):
    """The same megatron-core MoE run at EP2 saved with the distributed optimizer in dp_reshardable (flat buckets
    of the dense and the expert optimizers) and in fully_reshardable (per parameter) reads to the same universal
    checkpoint, every weight, master and moment bit for bit: the buckets' layout puts each expert where
    megatron-core's own per-parameter save has it."""
    _, _, dist = mixtral
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "tests" / "mcore_moe_worker.py")]
    for layout in ("dp_reshardable", "fully_reshardable"):
        run_workers(worker + ["train-save", str(dist), str(tmp_path / layout)], {**worker_env(), "MCORE_EP": "2", "MCORE_DISTOPT": layout}, timeout=600)
        done = cli("convert", tmp_path / layout, tmp_path / f"u-{layout}", "--to", "universal")
        assert done.returncode == 0, done.stderr
    report = cli("diff", tmp_path / "u-dp_reshardable", tmp_path / "u-fully_reshardable")
    tensors = json.loads((tmp_path / "u-dp_reshardable" / "manifest.json").read_text())["tensors"]
    compared = re.search(r"(\d+) compared, (\d+) exact, 0 within atol, 0 different; 0 only in A, 0 only in B", report.stdout)
    assert compared and compared[1] == compared[2] and int(compared[1]) >= len(tensors), report.stdout


# --- Megatron-LM's legacy per-rank files of a MoE run ------------------------------------------------------------
@pytest.fixture(scope="module")
def legacy(converted, tmp_path_factory):
    """A tiny MoE model as Megatron-LM's legacy files at EP2 for megatron-core's local spec (made once per model)."""
    made = {}

    def get(name: str):
        if name not in made:
            root = tmp_path_factory.mktemp(f"legacy-{name}")
            done = cli("convert", converted(name)[1], root / "leg", "--to", "megatron", "--ep-size", "2", "--transformer-impl", "local")
            assert done.returncode == 0, done.stderr
            made[name] = root / "leg"
        return made[name]
    return get


@pytest.fixture(scope="module")
def legacy_ep2(legacy):
    return legacy("mixtral")


def mcore_moe(scenario: str, ckpt, out=None, ep: int = 2, ranks: int = 2, fmt: str = "torch", grouped: bool = False,
              save: str | None = None, distributed: bool = False) -> None:
    """tests/mcore_moe_worker.py on ``ranks`` gloo processes at EP ``ep``: Megatron-LM's legacy files (torch) or
    torch_dist, SequentialMLP or (``grouped``) GroupedMLP experts; ``save``: the format it saves in (torch,
    torch_dist or both), default the one it loads; ``distributed``: --use-distributed-optimizer (distrib_optim.pt)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(ROOT / "tests" / "mcore_moe_worker.py"), scenario, str(ckpt), *([str(out)] if out else [])]
    env = {**worker_env(), "MCORE_EP": str(ep), "MCORE_CKPT": fmt, "MCORE_GROUPED": str(int(grouped)), "MCORE_SAVE": save or fmt,
           **({"MCORE_DISTOPT": "distrib_optim.pt"} if distributed else {})}
    run_workers(cmd, env, timeout=600)


@pytest.mark.parametrize("name", ["mixtral", pytest.param("qwen2_moe", marks=pytest.mark.slow)])
def test_legacy_moe_files_load_in_megatron_core_at_ep2(converted, legacy, name):
    """One directory per expert-parallel rank as Megatron-LM's get_checkpoint_name names them, each file the dense
    layers and that rank's experts numbered from 0; megatron-core at EP2 loads each rank's own file strictly (and its
    RNG: the expert-parallel tracker stream of each EP rank is checked against megatron-core's own seeding), logits
    equal transformers' (Qwen2-MoE: its gated shared expert and q/k/v biases)."""
    model, leg = converted(name)[0], legacy(name)
    iteration = leg / "iter_0000000"
    assert sorted(p.name for p in iteration.iterdir() if p.is_dir()) == ["mp_rank_00_000", "mp_rank_00_001"]
    down = next(k for k in model.state_dict() if k.startswith("model.layers.1.") and k.endswith("experts.down_proj"))
    for e in range(2):
        state = load_megatron_file(str(iteration / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt"))
        assert (state["args"].expert_model_parallel_size, state["args"].num_experts) == (2, 4)
        held = {k.split("local_experts.")[1].split(".")[0] for k in state["model"] if "local_experts." in k}
        assert held == {"0", "1"}
        torch.testing.assert_close(state["model"]["decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"],
                                   model.state_dict()[down][2 * e + 1], rtol=0, atol=0)
    ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
    torch.save(ids, leg / "ids.pt")
    mcore_moe("logits", leg)
    ranks = sorted((r["rank"], r["ep_rank"], r["local_experts"]) for r in (json.loads((leg / f"rank{i}.json").read_text()) for i in range(2)))
    assert ranks == [(0, 0, 8), (1, 1, 8)]
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(leg / "mcore_logits.pt"), expected, rtol=0, atol=1e-5)


def test_legacy_moe_files_at_tp2_pp2_ep2_round_trip_exactly(mixtral, tmp_path):
    """Eight rank files (mp_rank_TT_PPP_EEE): each tensor-parallel piece of each stage's dense layers and of its
    expert rank's experts; read back, every weight is the source's bit for bit."""
    model, hf, _ = mixtral
    out = tmp_path / "m"
    assert cli("convert", hf, out, "--to", "megatron", "--tp", "2", "--pp", "2", "--ep-size", "2").returncode == 0
    assert len([p for p in (out / "iter_0000000").iterdir() if p.name.startswith("mp_rank_")]) == 8
    state = load_megatron_file(str(out / "iter_0000000" / "mp_rank_01_001_001" / "model_optim_rng.pt"))
    assert state["model"]["decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight"].shape == (36, 26)  # fc2's columns split
    assert cli("convert", out, tmp_path / "back", "--to", "hf").returncode == 0
    back = transformers.MixtralForCausalLM.from_pretrained(tmp_path / "back")
    theirs = model.state_dict()
    assert {k: bool(torch.equal(t, theirs[k])) for k, t in back.state_dict().items()} == {k: True for k in theirs}


@pytest.mark.slow  # the suite's time: megatron-core's MoE resume through universal stays in CI from torch_dist
@pytest.mark.parametrize("distributed", [False, True], ids=["megatron", "distributed"])
def test_megatron_core_legacy_moe_run_resumes_through_universal(legacy_ep2, tmp_path, distributed):
    """megatron-core trains a step at EP2 and saves as Megatron-LM does with --ckpt-format torch (each EP rank its
    file, the ChainedOptimizer's list; with --use-distributed-optimizer each rank's distrib_optim.pt beside it, the
    list of the dense part, on expert rank 0 only, and that rank's experts' part); interop reads every expert and
    its Adam moments, through universal and back to legacy files at EP2 every tensor is the same, and megatron-core
    resumes model and optimizer with the uninterrupted run's losses."""
    own, u = tmp_path / "own", tmp_path / "u"
    mcore_moe("train-save", legacy_ep2, own, distributed=distributed)
    assert (own / "iter_0000001" / "mp_rank_00_001" / "distrib_optim.pt").is_file() == distributed
    assert cli("convert", own, u, "--to", "universal").returncode == 0
    ckpt = registry.read(str(u))[1]
    assert (ckpt.source["format"], ckpt.source["ep"]) == ("megatron", 2)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in ckpt.optimizer.tensors["exp_avg"]
    assert [len(g["params"]) for g in ckpt.optimizer.param_groups] == [12, 5, 24]  # dense decay (router included), norms, experts
    back = tmp_path / "back"
    flags = ["--use-distributed-optimizer"] if distributed else []
    assert cli("convert", u, back, "--to", "megatron", "--transformer-impl", "local", *flags).returncode == 0
    report = cli("diff", own, back)
    n = 2 * (41 + 41)  # model and both moments of every tensor
    assert f"{n} compared, {n} exact, 0 within atol, 0 different; 0 only in A, 0 only in B" in report.stdout, report.stdout
    mcore_moe("load-train", back, back, distributed=distributed)
    expected = json.loads((own / "losses.json").read_text())
    assert json.loads((back / "losses.json").read_text()) == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_megatron_core_loads_a_moe_run_at_ep1_from_legacy_files(legacy_ep2, tmp_path):
    """At EP1 megatron-core marks no parameter expert-parallel and keeps one optimizer over every parameter: a
    legacy EP2 run's state written for EP1 so loads strictly (model and optimizer), with every tensor the run's,
    and its first loss is the uninterrupted run's."""
    own, u = tmp_path / "own", tmp_path / "u"
    mcore_moe("train-save", legacy_ep2, own)
    assert cli("convert", own, u, "--to", "universal").returncode == 0
    expected = json.loads((own / "losses.json").read_text())
    n = 2 * (41 + 41)  # model and both moments of every tensor
    one = tmp_path / "ep1"
    assert cli("convert", u, one, "--to", "megatron", "--ep-size", "1", "--transformer-impl", "local").returncode == 0
    assert [p.name for p in (one / "iter_0000001").iterdir() if p.is_dir()] == ["mp_rank_00"]
    report = cli("diff", own, one)
    assert f"{n} compared, {n} exact" in report.stdout, report.stdout
    mcore_moe("load-train", one, one, ep=1, ranks=1)
    assert json.loads((one / "losses.json").read_text())[0] == expected[0]


def test_broken_legacy_moe_files_are_refused(legacy_ep2, tmp_path):
    """A missing expert-parallel rank, an expert the layout would duplicate, experts split over another expert
    tensor-parallel size and Transformer Engine's grouped experts are each one line naming the file, nothing written."""
    def refused(src, match: str) -> None:
        done = cli("convert", src, tmp_path / "x", "--to", "universal")
        assert done.returncode == 2 and not (tmp_path / "x").exists(), done.stderr
        assert re.search(match, done.stderr.strip().splitlines()[-1]), done.stderr

    broken = tmp_path / "broken"
    shutil.copytree(legacy_ep2, broken)
    (broken / "iter_0000000" / "manifest.json").unlink()  # Megatron-LM's own files: no manifest to check them against
    rank1 = broken / "iter_0000000" / "mp_rank_00_001" / "model_optim_rng.pt"
    state = torch.load(rank1, weights_only=False)
    rank1.rename(rank1.with_suffix(".bak"))
    refused(broken, r"mp_rank_00_001: missing: a checkpoint with TP 1 x PP 1 x EP 2 has one directory per rank")
    moved = {k.replace("local_experts.1.", "local_experts.2."): v for k, v in state["model"].items()}
    torch.save({**state, "model": moved}, rank1)
    refused(broken, r"mp_rank_00_001/model_optim_rng.pt: layer 0 holds local expert 2, but 4 experts over 2 expert-parallel "
            r"ranks give each 2: an expert would be duplicated or dropped")
    for index in ("-1", "01"):  # another rank's expert by a negative index; expert 1 twice, spelled two ways
        planted = {k.replace("local_experts.1.", f"local_experts.{index}."): v for k, v in state["model"].items()}
        torch.save({**state, "model": {**state["model"], **planted}}, rank1)
        refused(broken, r"mp_rank_00_001/model_optim_rng.pt: " + ("layer 0 holds local expert -1" if index == "-1" else
                                                                   r"holds decoder.layers.0.mlp.experts.local_experts.3.\S+ twice"))
    state["args"].expert_tensor_parallel_size = 2
    for e in range(2):
        path = broken / "iter_0000000" / f"mp_rank_00_{e:03d}" / "model_optim_rng.pt"
        torch.save({**torch.load(path, weights_only=False), "args": state["args"]}, path)
    refused(broken, r"mp_rank_00_000/model_optim_rng.pt: experts split over expert tensor-parallel size 2, the dense layers over TP 1")
    # Transformer Engine's grouped experts (TEGroupedMLP: linear_fc1.weight<i> per local expert) in legacy files
    state["args"].expert_tensor_parallel_size = None
    torch.save(state, rank1)
    rank0 = broken / "iter_0000000" / "mp_rank_00_000" / "model_optim_rng.pt"
    first = torch.load(rank0, weights_only=False)
    te = {k.replace("experts.local_experts.0.linear_fc1.weight", "experts.linear_fc1.weight0"): v for k, v in first["model"].items()}
    torch.save({**first, "args": state["args"], "model": te}, rank0)
    refused(broken, r"mp_rank_00_000/model_optim_rng.pt: 'decoder.layers.0.mlp.experts.linear_fc1.weight0' is Transformer "
            r"Engine's grouped-GEMM expert \(TEGroupedMLP\), whose legacy layout is not read here")


# --- grouped-GEMM experts (--moe-grouped-gemm) ----------------------------------------------------------------------
@pytest.mark.slow
def test_grouped_gemm_run_resumes_through_universal(mixtral, tmp_path):
    """megatron-core's GroupedMLP (``--moe-grouped-gemm``: each rank's experts as two tensors, weight1 / weight2,
    transposed) saves torch_dist under SequentialMLP's keys, by its own sharded_state_dict. A GroupedMLP run's save
    after a step of training at EP2, moments included, goes through universal and back, and megatron-core's
    GroupedMLP resumes with the uninterrupted run's losses. (The grouped_gemm package's CUDA kernel is a grouped
    matmul, done in torch on CPU: tests/mcore_moe_worker.py.)"""
    _, _, dist = mixtral
    own, u, back = tmp_path / "own", tmp_path / "u", tmp_path / "back"
    mcore_moe("train-save", dist, own, fmt="torch_dist", grouped=True)
    assert load_megatron_file(str(own / "iter_0000001" / COMMON))["args"].moe_grouped_gemm is True
    assert cli("convert", own, u, "--to", "universal").returncode == 0
    assert "model.layers.0.block_sparse_moe.experts.2.w1.weight" in registry.read(str(u))[1].optimizer.tensors["exp_avg_sq"]
    assert cli("convert", u, back, "--to", "megatron-dist", "--transformer-impl", "local").returncode == 0
    mcore_moe("load-train", back, back, fmt="torch_dist", grouped=True)
    expected = json.loads((own / "losses.json").read_text())
    assert json.loads((back / "losses.json").read_text()) == pytest.approx(expected, rel=1e-6)


@pytest.mark.slow
def test_grouped_gemm_loads_our_torch_dist_and_is_interchangeable_with_sequential(mixtral, tmp_path):
    """megatron-core's GroupedMLP at EP2 loads a Hugging Face Mixtral's torch_dist with transformers' logits; a
    GroupedMLP run's save read through interop resumes in SequentialMLP experts with the same losses, and the two
    runs' saves of the same step agree to float rounding (the grouped matmul sums in another order)."""
    model, _, dist = mixtral
    grouped = tmp_path / "grouped"
    shutil.copytree(dist, grouped)
    ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
    torch.save(ids, grouped / "ids.pt")
    mcore_moe("logits", grouped, fmt="torch_dist", grouped=True)
    with torch.no_grad():
        torch.testing.assert_close(torch.load(grouped / "mcore_logits.pt"), model(input_ids=ids).logits, rtol=0, atol=1e-5)
    own, seq, back = tmp_path / "own", tmp_path / "seq", tmp_path / "back"
    mcore_moe("train-save", dist, own, fmt="torch_dist", grouped=True)
    mcore_moe("train-save", dist, seq, fmt="torch_dist")
    report = cli("diff", own, seq, "--atol", "1e-5")
    assert " 0 different; 0 only in A, 0 only in B" in report.stdout, report.stdout
    assert cli("convert", own, back, "--to", "megatron-dist", "--transformer-impl", "local").returncode == 0
    mcore_moe("load-train", back, back, fmt="torch_dist")
    assert json.loads((back / "losses.json").read_text()) == pytest.approx(json.loads((own / "losses.json").read_text()), rel=1e-6)


def test_grouped_gemm_legacy_files_are_read(mixtral, tmp_path):
    """A GroupedMLP run's legacy files: each EP rank's experts as two tensors, weight1 ([hidden, experts x 2 ffn]) and
    weight2, and their Adam moments, numbered as two parameters per layer. megatron-core trains a step at EP2 and
    saves both its legacy files and torch_dist (which it lays out per expert itself): read, the two are equal tensor
    for tensor, moments included. Written back as legacy files (SequentialMLP experts, with a note for grouped-GEMM
    runs), megatron-core resumes them with the grouped run's losses."""
    _, _, dist = mixtral
    own = tmp_path / "own"
    mcore_moe("train-save", dist, own, fmt="torch_dist", grouped=True, save="both")
    state = load_megatron_file(str(own / "iter_0000001" / "mp_rank_00_001" / "model_optim_rng.pt"))
    assert state["model"]["decoder.layers.0.mlp.experts.weight1"].shape == (36, 2 * 2 * 52)  # 2 experts x [w1; w3]
    report = cli("diff", own, str(own) + "_dist")
    n = 2 * (41 + 41)  # model and both moments of every tensor
    assert f"{n} compared, {n} exact, 0 within atol, 0 different; 0 only in A, 0 only in B" in report.stdout, report.stdout
    back = tmp_path / "back"
    done = cli("convert", own, back, "--to", "megatron", "--transformer-impl", "local")
    assert done.returncode == 0 and "note: experts written as SequentialMLP's (local_experts.<j>)" in done.stdout + done.stderr, done.stderr
    mcore_moe("load-train", back, back)
    expected = json.loads((own / "losses.json").read_text())
    assert json.loads((back / "losses.json").read_text()) == pytest.approx(expected, rel=1e-6)


# --- DeepSeek-V3-style MoE on grouped-query attention: GLM-4.5 --------------------------------------------------
def test_glm4_moe_arguments_and_per_layer_keys_are_megatron_cores(converted, tmp_path):
    """GLM-4.5's model as Megatron-LM's arguments: the dense first layer (--moe-layer-freq [0]*1+[1]*2, its own
    --ffn-hidden-size), the sigmoid router with its expert bias, group-limited and scaled top-k, the shared expert's
    width, q/k norms, q/k/v biases and half-rotary heads; torch_dist keeps each layer under its own keys
    (megatron-core's non-homogeneous layers: decoder.layers.<i>.x, the experts stacked per layer), the router's
    expert bias among them, fp32. Back to Hugging Face every tensor is the source's, the score-correction bias too."""
    from torch.distributed.checkpoint import FileSystemReader

    model, hf, dist = converted("glm4_moe")
    args = vars(load_megatron_file(str(dist / "iter_0000000" / COMMON))["args"])
    wanted = {"num_layers": 3, "moe_layer_freq": [0, 1, 1], "ffn_hidden_size": 52, "moe_ffn_hidden_size": 20, "num_experts": 4,
              "moe_router_topk": 2, "moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
              "moe_router_num_groups": 2, "moe_router_group_topk": 1, "moe_router_topk_scaling_factor": 2.5, "moe_router_dtype": "fp32",
              "moe_shared_expert_intermediate_size": 20, "qk_layernorm": True, "add_qkv_bias": True, "add_bias_linear": False,
              "rotary_percent": 0.5, "kv_channels": 8}
    assert {k: args.get(k) for k in wanted} == wanted
    meta = FileSystemReader(str(dist / "iter_0000000")).read_metadata().state_dict_metadata
    assert tuple(meta["decoder.layers.0.mlp.linear_fc1.weight"].size) == (104, 36)  # the dense layer's [gate; up]
    assert tuple(meta["decoder.layers.2.mlp.experts.experts.linear_fc2.weight"].size) == (4, 36, 20)
    bias = meta["decoder.layers.1.mlp.router.expert_bias"]
    assert (tuple(bias.size), bias.properties.dtype) == ((4,), torch.float32)
    assert not any(k.startswith(("decoder.layers.mlp.", "decoder.layers.self_attention.")) for k in meta)  # no stacked key
    assert cli("convert", dist, tmp_path / "back", "--to", "hf").returncode == 0
    back = transformers.Glm4MoeForCausalLM.from_pretrained(tmp_path / "back").eval()
    theirs = model.state_dict()
    assert {k: bool(torch.equal(t, theirs[k])) for k, t in back.state_dict().items()} == {k: True for k in theirs}
    assert theirs["model.layers.2.mlp.gate.e_score_correction_bias"].abs().sum() > 0  # randomised: a dropped one shows


def test_glm4_moe_routing_megatron_cannot_hold_is_refused(tmp_path):
    """What megatron-core cannot route as transformers' GLM-4.5 does is refused in one line, nothing written: groups
    ranked by other than their top-2 scores, top-k weights not renormalised; a run's dense layers interleaved
    (--moe-layer-freq 2), which no Hugging Face config says."""
    model = architectures.build("glm4_moe")
    for change, message in (
        (dict(n_group=2, topk_group=2), "group-limited routing of top-2 over 2 groups: megatron-core ranks groups by their best 2/2 scores, "
                                        "transformers by their best 2"),
        (dict(norm_topk_prob=False), "glm4_moe with norm_topk_prob=False: megatron-core renormalises a sigmoid router's top-k scores always"),
    ):
        for k, v in change.items():
            setattr(model.config, k, v)
        model.save_pretrained(tmp_path / "hf")
        done = cli("convert", tmp_path / "hf", tmp_path / "out", "--to", "megatron-dist")
        assert done.returncode == 2 and not (tmp_path / "out").exists(), done.stderr
        assert message in done.stderr.strip().splitlines()[-1]
        model = architectures.build("glm4_moe")
    args = {**MegatronArch._asked_from_hf(model.config.to_dict()).to_args(1, 1), "moe_layer_freq": 2}
    with pytest.raises(ConversionError, match=r"common.pt: --moe-layer-freq 2: only dense layers first, then MoE layers"):
        MegatronArch.from_args(args, "common.pt")
    for scaling in (0.0, -2.5, float("inf"), "2.5", True):  # an untrusted run's top-k scaling: a positive number
        with pytest.raises(ConversionError, match=re.escape(f"common.pt: --moe-router-topk-scaling-factor {scaling!r} is not a positive number")):
            MegatronArch.from_args({**args, "moe_layer_freq": [0, 1, 1], "moe_router_topk_scaling_factor": scaling}, "common.pt")


# megatron-core's judgement of GLM-4.5 and DeepSeek-V3: GLM-4.5's logits and DeepSeek-V2-Lite-shaped DeepSeek-V3's
# (no q bottleneck, YaRN, rotary halves) at EP2 by default, DeepSeek-V3's own shape and TP2 slow; a GLM-4.5 training
# run resumed from torch_dist's dp_reshardable layout by default, the plain optimizer, DeepSeek-V3 and (GLM-4.5)
# legacy files, plain and with distrib_optim.pt, slow
DEEPSEEK_STYLE = [("glm4_moe", 2), pytest.param("deepseek_v3", 2, marks=pytest.mark.slow), ("deepseek_v3_plain_q", 2),
                  pytest.param("glm4_moe", 1, marks=pytest.mark.slow), pytest.param("deepseek_v3", 1, marks=pytest.mark.slow)]
RUNS = [("glm4_moe", "torch_dist", "dp_reshardable"), pytest.param("glm4_moe", "torch_dist", None, marks=pytest.mark.slow),
        pytest.param("glm4_moe", "torch", None, marks=pytest.mark.slow), pytest.param("glm4_moe", "torch", "distrib_optim.pt", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "torch_dist", "dp_reshardable", marks=pytest.mark.slow),
        pytest.param("deepseek_v3", "torch_dist", None, marks=pytest.mark.slow)]


@pytest.mark.parametrize(("name", "ep"), DEEPSEEK_STYLE, ids=["glm4_moe-ep2", "deepseek_v3-ep2", "deepseek_v3_plain_q-ep2",
                                                                            "glm4_moe-tp2", "deepseek_v3-tp2"])
def test_megatron_core_routes_deepseek_style_moe_as_transformers(converted, tmp_path, name, ep):
    """megatron-core's GPT model built from our arguments (Megatron-LM's per-layer specs: a dense layer, then MoE
    layers with the sigmoid router, expert bias, expert groups, scaling and shared expert; DeepSeek-V3's
    multi-latent attention with interleaved rotary pairs) loads our torch_dist checkpoint strictly and gives
    transformers' logits; it saves the model itself (a Megatron-LM run's arguments, no Hugging Face model type: the
    family told by its sigmoid router and its attention) and interop reads every tensor back."""
    model, hf, dist = converted(name)
    ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
    torch.save(ids, dist / "ids.pt")
    own = tmp_path / "own"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "mcore_moe_worker.py"), "logits", str(dist), str(own)]
    run_workers(cmd, {**worker_env(), "MCORE_EP": str(ep)}, timeout=600)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(dist / "mcore_logits.pt"), expected, rtol=0, atol=1e-5)
    fmt, ckpt = registry.read(str(own))
    assert (fmt.name, ckpt.config["model_type"], ckpt.config["first_k_dense_replace"]) == ("megatron-dist", architectures.spec(name)[0], 1)
    moe_layers = len({k.split(".mlp.")[0] for k in model.state_dict() if ".mlp.experts." in k})
    n = len(model.state_dict()) + (4 * 3 - 2) * moe_layers  # the files hold each layer's experts one tensor each
    report = cli("diff", hf, own)
    assert f"{n} compared, {n} exact, 0 within atol, 0 different; 0 only in A, 0 only in B" in report.stdout, report.stdout


@pytest.mark.parametrize(("name", "fmt", "optimizer"), RUNS, ids=["glm4_moe-dist-dp_reshardable", "glm4_moe-dist-megatron", "glm4_moe-legacy",
                                                                  "glm4_moe-legacy-distrib_optim", "deepseek_v3-dist-dp_reshardable",
                                                                  "deepseek_v3-dist-megatron"])
def test_megatron_core_resumes_a_deepseek_style_run_through_universal(converted, legacy, tmp_path, name, fmt, optimizer):
    """megatron-core trains GLM-4.5 or DeepSeek-V3 a step at EP2 (its router's expert biases move by the step's token
    counts, as Megatron-LM's finalize_model_grads moves them: buffers, in no optimizer) and saves; interop reads it
    through universal (the moments of every parameter, none of the buffer) and writes the same format back tensor for
    tensor; megatron-core loads it and trains on with the uninterrupted run's losses."""
    source = converted(name)[2] if fmt == "torch_dist" else legacy(name)
    own, back, resumed = tmp_path / "own", tmp_path / "back", tmp_path / "resumed"
    if fmt == "torch_dist":
        worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "tests" / "mcore_moe_worker.py")]
        env = {**worker_env(), "MCORE_EP": "2", **({"MCORE_DISTOPT": optimizer} if optimizer else {})}
        run_workers(worker + ["train-save", str(source), str(own)], env, timeout=600)
    else:
        mcore_moe("train-save", source, own, distributed=bool(optimizer))
    u = tmp_path / "u"
    assert cli("convert", own, u, "--to", "universal").returncode == 0
    ckpt = registry.read(str(u))[1]
    bias = "model.layers.1.mlp.gate.e_score_correction_bias"
    assert bias in ckpt.model and bias not in ckpt.optimizer.tensors["exp_avg"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in ckpt.optimizer.tensors["exp_avg"]
    moved = ckpt.model[bias].load() - converted(name)[0].state_dict()[bias]
    assert moved.abs().min() > 0  # each expert's bias moved by the update rate, up or down
    target = (["--to", "megatron-dist"] + (["--dist-optim-layout", optimizer] if optimizer else []) if fmt == "torch_dist"
              else ["--to", "megatron", "--ep-size", "2"] + (["--use-distributed-optimizer"] if optimizer else []))
    done = cli("convert", u, back, *target, "--transformer-impl", "local")
    assert done.returncode == 0, done.stderr
    report = cli("diff", own, back)
    assert " 0 different; 0 only in A, 0 only in B" in report.stdout and " 0 exact" not in report.stdout, report.stdout
    resumed.mkdir()
    if fmt == "torch_dist":
        run_workers(worker + ["load-train", str(back), str(resumed)], env, timeout=600)
    else:
        mcore_moe("load-train", back, resumed, distributed=bool(optimizer))
    expected = json.loads((own / "losses.json").read_text())
    assert json.loads((resumed / "losses.json").read_text()) == pytest.approx(expected, rel=1e-6)


def test_multi_token_prediction_layers_megatron_core_runs_them_as_transformers(tmp_path):
    """A hub DeepSeek-V3 keeps its multi-token-prediction (MTP) layer as model.layers.<num_hidden_layers> (its norms,
    eh_proj, a MoE decoder layer, shared_head.norm, copies of the embedding and head), which transformers' MtpModel
    loads. Written as megatron-core's MTP block (--mtp-num-layers 1, mtp.layers.0.*: its experts stacked, its
    transformer layer's keys unstacked), megatron-core's GPTModel with Megatron-LM's MTP spec loads it strictly at EP2
    and gives transformers' logits for the main model and for the MTP layer; megatron-core's own save comes back to
    the hub's tensors exactly (the copies from the model's embedding and head), and MtpModel loads that export."""
    from torch.distributed.checkpoint import FileSystemReader

    model, hf = architectures.saved(tmp_path, "deepseek_v3")
    added = architectures.with_mtp(model, hf)
    loaded, mtp = architectures.mtp_model(hf)
    expected, expected_mtp = architectures.logits(loaded, loaded.config), architectures.mtp_logits(loaded, mtp)
    dist, own, back = tmp_path / "dist", tmp_path / "own", tmp_path / "back"
    done = cli("convert", hf, dist, "--to", "megatron-dist", "--transformer-impl", "local")
    assert done.returncode == 0, done.stderr
    assert "multi-token-prediction" not in done.stdout + done.stderr  # held whole: nothing to say
    args = vars(load_megatron_file(str(dist / "iter_0000000" / COMMON))["args"])
    assert args["mtp_num_layers"] == 1
    meta = FileSystemReader(str(dist / "iter_0000000")).read_metadata().state_dict_metadata
    for key, shape in (("mtp.layers.0.eh_proj.weight", (36, 72)), ("mtp.layers.0.final_layernorm.weight", (36,)),
                       ("mtp.layers.0.transformer_layer.self_attention.linear_q_up_proj.weight", (60, 12)),
                       ("mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc2.weight", (4, 36, 20))):
        assert tuple(meta[key].size) == shape, key
    torch.save((torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size, dist / "ids.pt")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "mcore_moe_worker.py"), "logits", str(dist), str(own)]
    run_workers(cmd, {**worker_env(), "MCORE_EP": "2"}, timeout=600)
    torch.testing.assert_close(torch.load(dist / "mcore_logits.pt"), expected, rtol=0, atol=1e-5)
    # megatron-core's MTP layer at position i sees token i + 1; the last position has none (transformers leaves it out)
    torch.testing.assert_close(torch.load(dist / "mcore_mtp_logits.pt")[:, :, :-1], expected_mtp, rtol=0, atol=1e-5)
    done = cli("convert", own, back, "--to", "hf")
    assert done.returncode == 0, done.stderr
    shown = cli("inspect", own, "--limit", "1").stdout
    assert (f"beyond:    {len(added)} tensors in model.layers.2, past the model's own layers (multi-token prediction): kept by "
            "universal, hf and the Megatron targets, left out of the engine formats") in shown, shown
    from safetensors.torch import load_file

    theirs, ours = load_file(str(next(hf.glob("*.safetensors")))), load_file(str(next(back.glob("*.safetensors"))))
    assert set(added) <= set(theirs) and {k: bool(torch.equal(t, theirs.get(k, t[:0]))) for k, t in ours.items()} == {k: True for k in theirs}
    assert json.loads((back / "config.json").read_text())["num_nextn_predict_layers"] == 1
    again, again_mtp = architectures.mtp_model(back)
    assert {k: bool(torch.equal(t, mtp.state_dict()[k])) for k, t in again_mtp.state_dict().items()} == {k: True for k in mtp.state_dict()}


def test_multi_token_prediction_layers_megatron_cannot_hold_are_refused_or_noted(tmp_path):
    """What a Megatron target cannot hold of a model's MTP layers is refused in one line, nothing written: an MTP
    layer's copy of the embedding that is not the model's (megatron-core's MTP layers use the model's own), an MTP
    layer missing a tensor, legacy files over pipeline stages (megatron-core's last stage keeps its own embedding
    copy for them), a Megatron-LM run's MTP layers for a family with none in its Hugging Face layout. The config's
    declared layers the checkpoint does not hold (transformers' save_pretrained writes none) and tensors past them
    are said in a note, never dropped in silence."""
    from converters.megatron import write_megatron
    from converters.megatron_dist import write_megatron_dist

    model, hf = architectures.saved(tmp_path, "glm4_moe")
    plain = registry.read(str(hf))[1]
    architectures.with_mtp(model, hf)
    original = registry.read(str(hf))[1]

    def refused(model: dict, write, message: str, **options) -> None:
        with pytest.raises(ConversionError) as raised:
            write(dataclasses.replace(original, model=model, notes=[]), str(tmp_path / "x"), **options)
        assert str(raised.value) == message and not (tmp_path / "x").exists()

    m = original.model
    refused({**m, "model.layers.3.embed_tokens.weight": m["model.layers.3.shared_head.head.weight"]}, write_megatron_dist,
            "model.layers.3.embed_tokens.weight is not model.embed_tokens.weight: megatron-core's multi-token-prediction layers "
            "use the model's own embedding and output layer, so it has no place for another")
    refused({k: v for k, v in m.items() if k != "model.layers.3.enorm.weight"}, write_megatron,
            "the source has no ['model.layers.3.enorm.weight'] for Megatron's mtp.layers.0.enorm.weight", tp=1, pp=1)
    refused(m, write_megatron, "--to megatron: legacy per-rank files of a model with 1 multi-token-prediction layer(s) over 2 "
            "pipeline stages are not read or written (the last stage's own embedding copy); use torch_dist (--to megatron-dist, "
            "fully_reshardable for a distributed optimizer)", tp=1, pp=2)
    refused(m, write_megatron_dist, "--dist-optim-layout dp_reshardable buckets of a model with 1 multi-token-prediction layer(s) over 2 "
            "pipeline stages are not read or written (the last stage's own embedding copy); use torch_dist (--to megatron-dist, "
            "fully_reshardable for a distributed optimizer)", pp=2, distributed_optimizer="dp_reshardable", transformer_impl="local")
    stray = dataclasses.replace(original, model={**m, "model.layers.4.eh_proj.weight": m["model.layers.3.eh_proj.weight"]}, notes=[])
    write_megatron(stray, str(tmp_path / "stray"), 1, 1)
    assert "Megatron's model has no place for 1 tensor(s), not written: ['model.layers.4.eh_proj.weight']" in stray.notes
    args = vars(load_megatron_file(str(tmp_path / "stray" / "iter_0000000" / "mp_rank_00" / "model_optim_rng.pt"))["args"])
    assert args["mtp_num_layers"] == 1
    write_megatron_dist(plain, str(tmp_path / "plain"))
    assert ("the config declares 1 multi-token-prediction layer(s), the checkpoint holds none (transformers' save_pretrained "
            "writes none): written without them (no --mtp-num-layers)") in plain.notes
    with pytest.raises(ConversionError, match=r"^common.pt: the run has 1 multi-token-prediction layer\(s\) \(--mtp-num-layers\), which a "
                                              r"mixtral model's Hugging Face layout has no place for$"):
        MegatronArch.from_args({**MegatronArch.from_hf(architectures.build("mixtral").config.to_dict()).to_args(1, 1), "mtp_num_layers": 1},
                               "common.pt")


@pytest.mark.slow  # two more megatron-core runs each; the default run holds MTP layers' loading, logits and save above
@pytest.mark.parametrize(("name", "fmt", "optimizer"), [("glm4_moe", "torch", None), ("deepseek_v3", "torch_dist", "dp_reshardable")],
                         ids=["glm4_moe-legacy", "deepseek_v3-dist-dp_reshardable"])
def test_megatron_core_resumes_a_run_with_mtp_layers_through_universal(tmp_path, name, fmt, optimizer):
    """megatron-core trains a step with its MTP layer (the MTP loss's gradients reach the shared embedding and head)
    at EP2 and saves; through universal and back to the same format tensor for tensor (the MTP layer's Adam moments
    too, the distributed optimizer's buckets in module order: the MTP block after the decoder, before the output
    layer), megatron-core trains on with the uninterrupted run's losses."""
    model, hf = architectures.saved(tmp_path, name)
    architectures.with_mtp(model, hf)
    src, own, u, back, resumed = (tmp_path / n for n in ("src", "own", "u", "back", "resumed"))
    target = ["--to", "megatron-dist" if fmt == "torch_dist" else "megatron", "--ep-size", "2", "--transformer-impl", "local"]
    assert cli("convert", hf, src, *target).returncode == 0
    env = {**worker_env(), "MCORE_EP": "2", "MCORE_CKPT": fmt, **({"MCORE_DISTOPT": optimizer} if optimizer else {})}
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "tests" / "mcore_moe_worker.py")]
    run_workers(worker + ["train-save", str(src), str(own)], env, timeout=600)
    assert cli("convert", own, u, "--to", "universal").returncode == 0
    assert f"model.layers.{model.config.num_hidden_layers}.eh_proj.weight" in registry.read(str(u))[1].optimizer.tensors["exp_avg"]
    done = cli("convert", u, back, *target, *(["--dist-optim-layout", optimizer] if optimizer else []))
    assert done.returncode == 0, done.stderr
    report = cli("diff", own, back)
    assert " 0 different; 0 only in A, 0 only in B" in report.stdout and " 0 exact" not in report.stdout, report.stdout
    resumed.mkdir()
    run_workers(worker + ["load-train", str(back), str(resumed)], env, timeout=600)
    assert json.loads((resumed / "losses.json").read_text()) == pytest.approx(json.loads((own / "losses.json").read_text()), rel=1e-6)


def test_deepseek_v3_arguments_and_keys_are_megatron_cores(converted, tmp_path):
    """DeepSeek-V3's multi-latent attention as Megatron-LM's arguments (--multi-latent-attention, its ranks and head
    sizes, --rope-type rope, --qk-layernorm for the local spec's q/kv norms)
    and megatron-core's local-spec keys (each norm under its own module: the MLA layer has no key map), every
    tensor back exactly. YaRN (a Megatron-LM MLA run's default) as --rotary-scaling-factor / --mscale / --mscale-all-dim and
    back; what Megatron-LM's arguments cannot hold (other correction betas or context, a cos/sin factor its mscales
    cannot give) and legacy files (their down-projection pieces depend on the run's spec) are refused in one line. transformers builds the q/kv latent norms with
    1e-6 whatever rms_norm_eps says, megatron-core with --norm-epsilon: another rms_norm_eps is said both ways."""
    from torch.distributed.checkpoint import FileSystemReader

    model, hf, dist = converted("deepseek_v3")
    args = vars(load_megatron_file(str(dist / "iter_0000000" / COMMON))["args"])
    c = model.config
    wanted = {"multi_latent_attention": True, "q_lora_rank": c.q_lora_rank, "kv_lora_rank": c.kv_lora_rank, "qk_head_dim": c.qk_nope_head_dim,
              "qk_pos_emb_head_dim": c.qk_rope_head_dim, "v_head_dim": c.v_head_dim, "hf_rope_interleave": True, "rope_type": "rope",
              "qk_layernorm": True, "moe_layer_freq": [0, 1], "moe_router_score_function": "sigmoid", "moe_router_num_groups": 2}
    assert {k: args.get(k) for k in wanted} == wanted
    meta = FileSystemReader(str(dist / "iter_0000000")).read_metadata().state_dict_metadata
    for key, shape in (("decoder.layers.1.self_attention.linear_kv_down_proj.weight", (c.kv_lora_rank + c.qk_rope_head_dim, 36)),
                       ("decoder.layers.1.self_attention.q_layernorm.weight", (c.q_lora_rank,)),
                       ("decoder.layers.0.pre_mlp_layernorm.weight", (36,)), ("decoder.layers.1.mlp.router.expert_bias", (4,))):
        assert tuple(meta[key].size) == shape, key
    assert cli("convert", dist, tmp_path / "back", "--to", "hf").returncode == 0
    back = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "back").eval()
    theirs = model.state_dict()
    assert {k: bool(torch.equal(t, theirs[k])) for k, t in back.state_dict().items()} == {k: True for k in theirs}
    done = cli("convert", hf, tmp_path / "legacy", "--to", "megatron")
    assert done.returncode == 2 and not (tmp_path / "legacy").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "interop convert: error: --to megatron: a deepseek_v3 model's multi-latent attention in legacy per-rank files is not read or "
        "written (its pieces depend on the run's spec); use --ckpt-format torch_dist (--to megatron-dist)")
    run = MegatronArch.from_args({**args, "rope_type": None, "hf_model_type": None, "rotary_scaling_factor": 40.0, "mscale": 1.0,
                                  "mscale_all_dim": 0.0}, "common.pt").to_hf()  # Megatron-LM's MLA default: YaRN
    assert run["rope_parameters"] == {"rope_theta": 10000.0, "rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                                      "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0}
    yarn = converted("deepseek_v3_plain_q")  # YaRN's arguments, and back to the same rope_parameters
    yarn_args = vars(load_megatron_file(str(yarn[2] / "iter_0000000" / COMMON))["args"])
    assert {k: yarn_args.get(k) for k in ("rope_type", "rotary_scaling_factor", "mscale", "mscale_all_dim", "q_lora_rank")} == {
        "rope_type": "yarn", "rotary_scaling_factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "q_lora_rank": None}
    assert cli("convert", yarn[2], tmp_path / "yarn-back", "--to", "hf").returncode == 0
    back_config = json.loads((tmp_path / "yarn-back" / "config.json").read_text())
    assert (back_config["rope_parameters"], back_config["q_lora_rank"]) == (yarn[0].config.rope_parameters, None)
    for change, message in ((dict(beta_fast=16.0), "beta_fast 16.0; a Megatron-LM run's multi-latent attention computes with 32.0"),
                            (dict(original_max_position_embeddings=8192), "original_max_position_embeddings 8192; a Megatron-LM run's"),
                            (dict(mscale=None, mscale_all_dim=1.0), "an attention factor 1.36889 beside mscale_all_dim 1, which megatron-core's")):
        config = yarn[0].config.to_dict()
        config["rope_parameters"] = {**config["rope_parameters"], **change}
        with pytest.raises(ConversionError, match=re.escape(f"deepseek_v3 with YaRN rotary scaling: {message}")):
            MegatronArch._asked_from_hf(config)
    model.config.rms_norm_eps = 1e-5  # transformers' latent norms keep 1e-6: both ways, said
    model.save_pretrained(tmp_path / "eps")
    for src, dst, to in ((tmp_path / "eps", tmp_path / "eps-dist", "megatron-dist"), (tmp_path / "eps-dist", tmp_path / "eps-hf", "hf")):
        done = cli("convert", src, dst, "--to", to)
        assert done.returncode == 0, done.stderr
        assert ("note: transformers builds model.layers.<n>.self_attn.kv_a_layernorm, model.layers.<n>.self_attn.q_a_layernorm with eps "
                "1e-06, megatron-core every norm with --norm-epsilon 1e-05: their outputs differ slightly") in done.stdout + done.stderr, done.stderr


@pytest.mark.parametrize("ranks", [2, pytest.param(4, marks=pytest.mark.slow)], ids=["ep2", "tp2-ep2-etp1"])
def test_gpt_oss_megatron_core_runs_it_as_transformers(converted, tmp_path, ranks):
    """GPT-OSS as Megatron-LM's own recipe runs it (--quick-geglu --glu-linear-offset 1.0 --activation-func-clamp-value,
    --softmax-type learnable for its attention sinks, --window-size W-1,0 --window-attn-skip-freq 2, YaRN with the
    correction range unrounded, biases everywhere): megatron-core's GPTModel built from our arguments loads our
    torch_dist strictly at EP2, or TP2 x EP2 with the experts at ETP1 (megatron-core builds biased experts at ETP1 only;
    the sinks split with the heads), each expert a slice of transformers' stacked, interleaved gate_up_proj, and gives
    transformers' logits on sequences three windows long; it saves the model itself (a Megatron-LM run's arguments:
    the family told by --quick-geglu) and every tensor comes back to transformers' stacked layout exactly."""
    model, hf, dist = converted("gpt_oss_yarn")
    args = vars(load_megatron_file(str(dist / "iter_0000000" / COMMON))["args"])
    wanted = {"quick_geglu": True, "swiglu": False, "glu_linear_offset": 1.0, "activation_func_clamp_value": 0.5, "softmax_type": "learnable",
              "window_size": [7, 0], "window_attn_skip_freq": 2, "add_bias_linear": True, "add_qkv_bias": True, "num_experts": 4,
              "position_embedding_type": "yarn", "yarn_correction_range_round_to_int": False, "rotary_base": 150000}
    assert {k: args.get(k) for k in wanted} == wanted
    ids = (torch.arange(48).reshape(2, 24) * 5) % model.config.vocab_size
    torch.save(ids, dist / "ids.pt")
    own = tmp_path / "own"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
           str(ROOT / "tests" / "mcore_moe_worker.py"), "logits", str(dist), str(own)]
    run_workers(cmd, {**worker_env(), "MCORE_EP": "2", **({"MCORE_ETP": "1"} if ranks == 4 else {})}, timeout=600)
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    torch.testing.assert_close(torch.load(dist / "mcore_logits.pt"), expected, rtol=0, atol=1e-5)
    fmt, ckpt = registry.read(str(own))
    assert (fmt.name, ckpt.config["model_type"], ckpt.config["sliding_window"], ckpt.config["layer_types"]) == (
        "megatron-dist", "gpt_oss", 8, ["sliding_attention", "full_attention"])
    n = len(model.state_dict())
    report = cli("diff", hf, own)
    assert f"{n} compared, {n} exact, 0 within atol, 0 different; 0 only in A, 0 only in B" in report.stdout, report.stdout


# under -m slow for the suite's time: the default run holds GPT-OSS's logits and own save (above), its stacked experts'
# optimizer view (test_stacked_experts_are_seen_one_expert_at_a_time_and_back), and a MoE resume row (GLM-4.5's)
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", ["megatron", "dp_reshardable"])
def test_megatron_core_resumes_a_gpt_oss_run_through_universal(converted, tmp_path, optimizer):
    """megatron-core trains GPT-OSS a step at EP2 (its sinks, router bias and expert biases in the optimizers: the dense
    one, the experts' chained beside it) and saves; interop reads each expert's moments into transformers' stacked
    tensors (one state tensor per stack, in its place among the parameters), goes through universal and back to the same
    layout tensor for tensor, and megatron-core loads it and trains on with the uninterrupted run's losses."""
    model, _, dist = converted("gpt_oss_yarn")

    def check(u):
        params = [n for g in u.optimizer.param_groups for n in g["params"]]
        assert sorted(params) == sorted(n for n, _ in model.named_parameters()) and len(params) == len(set(params))
        for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj_bias", "model.layers.0.self_attn.sinks"):
            moment, weight = u.optimizer.tensors["exp_avg"][name].load(), u.model[name].load()
            assert moment.shape == weight.shape == model.state_dict()[name].shape
            assert moment.abs().amax() > 0 and not torch.equal(weight, model.state_dict()[name])  # trained: the step's state

    resumes_through_universal(dist, tmp_path, optimizer, check)


def test_stacked_experts_are_seen_one_expert_at_a_time_and_back():
    """The view the Megatron writers and readers put on a checkpoint whose tensors hold every expert of a layer
    (GPT-OSS's): each expert's slice under its own name, with its optimizer state, its place among the parameters and
    its step; back to the one tensor exactly. A slice is checked against the digest recorded for the whole tensor."""
    from interop.digests import ALGO
    from interop.errors import CorruptCheckpointError
    from interop.logical import DeferredScalars, LogicalCheckpoint, OptimizerState
    from interop.tensors import LazyTensor, tensor_digest
    from converters.stacked_experts import per_expert, restacked

    stack, other = torch.arange(24.0).reshape(3, 2, 4), torch.ones(5)
    moment = -stack
    stacks = {"m.experts.up": [f"m.experts.{e}.up" for e in range(3)]}
    steps = DeferredScalars({"step": {"m.experts.up": lambda: {"value": 7, "dtype": "int64"}, "b": lambda: {"value": 7, "dtype": "int64"}}})
    ckpt = LogicalCheckpoint(
        model={"b": LazyTensor.of(other), "m.experts.up": LazyTensor.of(stack)}, frozen=["m.experts.up"],
        optimizer=OptimizerState("AdamW", [{"params": ["b", "m.experts.up"], "lr": 0.1}],
                                 {"exp_avg": {"b": LazyTensor.of(other), "m.experts.up": LazyTensor.of(moment)}}, steps))
    seen = per_expert(ckpt, stacks)
    assert list(seen.model) == ["b", *stacks["m.experts.up"]] and seen.frozen == stacks["m.experts.up"]
    assert all(torch.equal(seen.model[f"m.experts.{e}.up"].load(), stack[e]) for e in range(3))
    assert all(torch.equal(seen.optimizer.tensors["exp_avg"][f"m.experts.{e}.up"].load(), moment[e]) for e in range(3))
    assert seen.optimizer.param_groups == [{"params": ["b", *stacks["m.experts.up"]], "lr": 0.1}]
    assert seen.optimizer.scalars["step"]["m.experts.2.up"] == {"value": 7, "dtype": "int64"}
    back = restacked(seen, stacks)
    assert list(back.model) == ["b", "m.experts.up"] and back.frozen == ["m.experts.up"]
    assert torch.equal(back.model["m.experts.up"].load(), stack) and torch.equal(back.optimizer.tensors["exp_avg"]["m.experts.up"].load(), moment)
    assert back.optimizer.param_groups == ckpt.optimizer.param_groups and set(back.optimizer.scalars["step"]) == {"b", "m.experts.up"}
    damaged = stack.clone()
    damaged[2, 1, 3] += 1  # the last expert's bytes, not the first's: the first slice's load checks the whole
    recorded = LazyTensor(LazyTensor.of(damaged).spec, lambda: damaged, "model.safetensors:m.experts.up", digest=tensor_digest(stack, ALGO))
    with pytest.raises(CorruptCheckpointError, match="m.experts.up.*differ from the digest"):
        per_expert(LogicalCheckpoint(model={"m.experts.up": recorded}), stacks).model["m.experts.0.up"].load()
    with pytest.raises(ConversionError, match=r"m.experts.up: float32\[2, 2, 4\] does not hold the model's 3 experts"):
        per_expert(LogicalCheckpoint(model={"m.experts.up": LazyTensor.of(stack[:2])}), stacks)
    # parts that do not make one parameter: state for some experts only (the first's missing too), other steps, other groups
    opt = seen.optimizer
    for damage, says in ((lambda o: o.tensors["exp_avg"].pop("m.experts.2.up"), "optimizer state 'exp_avg' of m.experts.up: m.experts.2.up has none"),
                         (lambda o: o.tensors["exp_avg"].pop("m.experts.0.up"), "optimizer state 'exp_avg' of m.experts.up: m.experts.0.up has none"),
                         (lambda o: o.param_groups.append({"params": [o.param_groups[0]["params"].pop()], "lr": 0.2}), "its parts are in 2 different groups")):
        damaged = OptimizerState(opt.cls, [dict(g, params=list(g["params"])) for g in opt.param_groups], {"exp_avg": dict(opt.tensors["exp_avg"])},
                                 opt.scalars)
        damage(damaged)
        with pytest.raises(ConversionError, match=re.escape(says)):
            restacked(dataclasses.replace(seen, optimizer=damaged), stacks)
    steps = DeferredScalars({"step": {f"m.experts.{e}.up": (lambda e=e: {"value": 7 + e, "dtype": "int64"}) for e in range(3)}})
    later = restacked(dataclasses.replace(seen, optimizer=dataclasses.replace(opt, scalars=steps)), stacks)
    with pytest.raises(ConversionError, match="optimizer state of m.experts.up: its parts hold different values"):
        later.optimizer.scalars  # (read when first asked for, as the readers' scalars are)


def test_gpt_oss_arguments_megatron_cannot_hold_are_refused():
    """In one line each: a GPT-OSS run without --activation-func-clamp-value (transformers' GPT-OSS clamps always; its
    default 7.0 would stand in for a clamp the run never applied), a config's sliding window that is no number of
    tokens, another swiglu_alpha than quick-GELU's, a Megatron expert's fc1 of another shape than the arguments'."""
    from converters.megatron import hf_shapes
    from converters.megatron_map import rules
    from interop.errors import CorruptCheckpointError

    config = architectures.build("gpt_oss").config.to_dict()
    arch = MegatronArch.from_hf(config)
    run = {k: v for k, v in arch.to_args(1, 1).items() if k not in ("hf_model_type", "activation_func_clamp_value")}
    with pytest.raises(ConversionError, match=r"common.pt: the run has no --activation-func-clamp-value, which every gpt_oss model has"):
        MegatronArch.from_args(run, "common.pt")
    with pytest.raises(ConversionError, match=r"--activation-func-clamp-value 'x' is not a positive number"):
        MegatronArch.from_args({**run, "activation_func_clamp_value": "x"}, "common.pt")
    assert MegatronArch.from_args({**run, "activation_func_clamp_value": 7.0}, "common.pt").model_type == "gpt_oss"
    # Megatron-LM's own GPT-OSS example trains with --disable-bias-linear: transformers' GPT-OSS has no model without them
    unbiased = MegatronArch.from_args({**run, "activation_func_clamp_value": 7.0, "add_bias_linear": False, "add_qkv_bias": False}, "common.pt")
    with pytest.raises(ConversionError, match=r"gpt_oss's MLP \(its experts and router\) always has biases, .* \(--disable-bias-linear\)"):
        unbiased.to_hf()
    for key, value, says in (("sliding_window", -6, "gpt_oss with sliding_window -6: not a number of tokens"),
                             ("swiglu_alpha", 1.5, "gpt_oss with swiglu_alpha 1.5: megatron-core computes its Megatron map with 1.702")):
        with pytest.raises(ConversionError, match=re.escape(says)):
            MegatronArch.from_hf({**config, key: value})
    fc1 = next(r for r in rules(arch) if r.megatron.endswith("local_experts.0.linear_fc1.weight"))
    assert hf_shapes(fc1, arch, (40, 36), "iter_0000001") == [(36, 40)]
    with pytest.raises(CorruptCheckpointError, match=r"iter_0000001.*local_experts.0.linear_fc1.weight is \[41, 36\], the arguments' model has \[40, 36\]"):
        hf_shapes(fc1, arch, (41, 36), "iter_0000001")
    qkv = next(r for r in rules(arch) if r.megatron.endswith("layers.1.self_attention.linear_qkv.weight"))  # (6 + 2 x 2 heads of 6)
    with pytest.raises(CorruptCheckpointError, match=r"linear_qkv.weight is \[66, 36\], the arguments' model has \[60, 36\]"):
        hf_shapes(qkv, arch, (66, 36), "iter_0000001")


def test_an_interleaved_bias_is_built_whole_not_cut_row_by_row(tmp_path):
    """GPT-OSS's gate/up bias is interleaved element by element: a plan of its sources' rows would make one part per
    element (a real model's 5,760 per expert: a megatron-dist write of a 4-layer, 32-expert GPT-OSS took 44 s, 3.5 s
    built whole). Built whole, it is the same tensor."""
    import threading

    from safetensors.torch import save_file

    from converters.megatron_map import rules
    from converters.megatron_pieces import RankPieces
    from interop.safetensors_io import read_hf_safetensors

    config = {**architectures.build("gpt_oss").config.to_dict(), "intermediate_size": 1030}
    arch = MegatronArch.from_hf(config)
    rule = next(r for r in rules(arch) if r.megatron.endswith("layers.0.mlp.experts.local_experts.0.linear_fc1.bias"))
    bias = torch.arange(2060, dtype=torch.float32)
    save_file({"b": bias}, tmp_path / "model.safetensors")
    stored = read_hf_safetensors(str(tmp_path))["b"]
    assert stored.mapped_pieces is not None
    (piece,) = RankPieces(1, 128, threading.Lock()).pieces(rule, [stored], torch.float32, None, "model")
    assert piece.parts is None and torch.equal(piece.load(), torch.cat([bias[0::2], bias[1::2]]))
