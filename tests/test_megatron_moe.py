"""Megatron MoE checkpoints (torch_dist): a Mixtral's router and SequentialMLP experts written as megatron-core
stacks them (``decoder.layers.mlp.experts.experts.linear_fc1.weight``: [layers, experts, ...]), loaded by
megatron-core's own MoE GPT model at EP2 and at TP2 on gloo with transformers' logits, and megatron-core's own save
of it at EP2 read back exactly. What is not mapped (the legacy per-rank files of a MoE run, grouped-GEMM experts,
the distributed optimizer's expert buffers) is refused in one line, never half-done; megatron-core's MoE
optimizers (dense and expert, chained) are read and written, and megatron-core resumes from them."""

from __future__ import annotations

import argparse
import json
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


# the Mixtral at EP2 and Qwen2-MoE (shared expert) by default; TP2 and Qwen3-MoE under -m slow
LOADS = [("mixtral", 2), pytest.param("mixtral", 1, marks=pytest.mark.slow), pytest.param("qwen3_moe", 2, marks=pytest.mark.slow),
         ("qwen2_moe", 2)]


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
    """The legacy per-rank files of a MoE model are refused both ways in one line, nothing written; grouped-GEMM
    experts on a model without them, and other routers in a run's arguments are refused, and so is the distributed optimizer's layout of a
    MoE model (its expert buffers), with nothing written."""
    _, hf, _ = mixtral
    done = cli("convert", hf, tmp_path / "legacy", "--to", "megatron", "--tp", "2")
    assert done.returncode == 2 and not (tmp_path / "legacy").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "interop convert: error: --to megatron writes legacy per-rank files, not laid out here for a MoE model's 4 experts; "
        "write --to megatron-dist (torch_dist), which megatron-core loads at any EP x TP x PP")
    args = vars(load_megatron_file(str(mixtral[2] / "iter_0000000" / COMMON))["args"])
    for flag, value, what in (("moe_grouped_gemm", True, "grouped-GEMM experts"), ("moe_router_score_function", "sigmoid", "a router score function"),
                              ("moe_shared_expert_intermediate_size", 64, "shared experts")):
        with pytest.raises(ConversionError, match=rf"common.pt: this MoE run has {what}.*\(--{flag.replace('_', '-')} {value}\); the Megatron MoE map reads"):
            MegatronArch.from_args({**args, flag: value}, "common.pt")

    # a MoE run saved with megatron-core's distributed optimizer: each chained part names its layout; refused on read
    from converters.megatron_dist import _chained_parts

    with pytest.raises(ConversionError, match="common.pt: a MoE model's distributed optimizer .* is not read here"):
        _chained_parts({0: {"param_state_sharding_type": "fully_reshardable"}, 1: {"param_state_sharding_type": "fully_reshardable"}},
                       [], "common.pt")

    # Megatron-LM's legacy files of a MoE run: one directory per expert-parallel rank, or (EP1) --num-experts in args
    legacy = tmp_path / "mcore-legacy" / "iter_0000001"
    for rank_dir in ("mp_rank_00_000_000", "mp_rank_00_000_001"):
        (legacy / rank_dir).mkdir(parents=True)
        torch.save({"args": argparse.Namespace(**args), "iteration": 1}, legacy / rank_dir / "model_optim_rng.pt")
    (legacy.parent / "latest_checkpointed_iteration.txt").write_text("1")
    done = cli("convert", legacy.parent, tmp_path / "x", "--to", "universal")
    assert done.returncode == 2 and "mp_rank_00_000_000: an expert-parallel rank directory (a MoE model's legacy per-rank files) is " \
        "not read here; save it with --ckpt-format torch_dist" in done.stderr, done.stderr
    (legacy / "mp_rank_00_000_001" / "model_optim_rng.pt").unlink()
    (legacy / "mp_rank_00_000_001").rmdir()
    (legacy / "mp_rank_00_000_000").rename(legacy / "mp_rank_00")
    done = cli("convert", legacy.parent, tmp_path / "x", "--to", "universal")
    assert done.returncode == 2 and "a MoE model's legacy per-rank files (--num-experts 4, expert-parallel rank directories) are not " \
        "read here" in done.stderr, done.stderr
    assert not (tmp_path / "x").exists()

    from trainers.base import BaseTrainer, TrainerConfig

    trained = BaseTrainer(TrainerConfig(model="mixtral", steps=1, batch_size=2, seq_len=8, save_every=1, output_dir=str(tmp_path / "run")))
    trained.train()
    done = cli("convert", tmp_path / "run" / "checkpoint-1", tmp_path / "opt", "--to", "megatron-dist", "--use-distributed-optimizer")
    assert done.returncode == 2 and not (tmp_path / "opt").exists()
    assert "the distributed optimizer's layout of a MoE model (its expert optimizer's buffers) is not written here" in done.stderr


def test_megatron_core_resumes_a_moe_run_through_universal(mixtral, tmp_path):
    """megatron-core trains the Mixtral one step at EP2 with its own optimizers for a MoE model (a ChainedOptimizer
    of the dense and the expert parameters') and saves it; interop reads every expert's Adam moments from it,
    goes through universal and back to torch_dist; megatron-core loads model and optimizer at EP2 and trains on
    with the uninterrupted run's losses."""
    _, _, dist = mixtral
    own, back, resumed = tmp_path / "own", tmp_path / "back", tmp_path / "resumed"
    worker = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / "tests" / "mcore_moe_worker.py")]
    env = {**worker_env(), "MCORE_EP": "2"}
    run_workers(worker + ["train-save", str(dist), str(own)], env, timeout=600)
    assert cli("convert", own, tmp_path / "u", "--to", "universal").returncode == 0
    u = registry.read(str(tmp_path / "u"))[1]
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in u.optimizer.tensors["exp_avg"]
    assert [len(g["params"]) for g in u.optimizer.param_groups] == [12, 5, 24]  # dense decay (router included), norms, experts
    assert cli("convert", tmp_path / "u", back, "--to", "megatron-dist", "--transformer-impl", "local").returncode == 0
    report = cli("diff", own, back)
    assert " 0 different; 0 only in A, 0 only in B" in report.stdout and " 0 exact" not in report.stdout, report.stdout
    resumed.mkdir()
    run_workers(worker + ["load-train", str(back), str(resumed)], env, timeout=600)
    expected = json.loads((own / "losses.json").read_text())
    assert json.loads((resumed / "losses.json").read_text()) == pytest.approx(expected, rel=1e-6)
