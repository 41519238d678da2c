"""Megatron-LM legacy checkpoints: HF -> Megatron at TP/PP -> HF bit-exact, the per-rank layout facts, optimizer
state, and bad input. Real megatron-core interop is in test_megatron_core.py."""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys

import pytest
import torch
import transformers

from converters.diff import diff_checkpoints
from converters.hf import read_hf, write_hf
from converters.megatron import load_megatron_file, read_megatron, write_megatron
from converters.pickle_safety import numpy_allowlist
from interop.errors import ConversionError, CorruptCheckpointError, MissingFileError, UnsafePickleError
from tests.conftest import ROOT, as_written, reads_in_a_child, worker_env

LAYOUTS = [(2, 1), (1, 2), (2, 2)]


def llama_config(vocab: int = 250, tied: bool = False):
    """vocab 250: Megatron pads it to 256 (a multiple of 128 x TP); 4 heads in 2 query groups."""
    return transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=48, intermediate_size=100, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=tied, bos_token_id=1, eos_token_id=2,
    )


def gpt2_config(tied: bool = True):
    return transformers.GPT2Config(vocab_size=250, n_positions=64, n_embd=48, n_layer=2, n_head=4, tie_word_embeddings=tied,
                                   bos_token_id=1, eos_token_id=2)


def make(config):
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def logits(model):
    ids = torch.arange(40).reshape(2, 20) % 250
    with torch.no_grad():
        return model(input_ids=ids).logits


def rank_file(root, t, p, pp, iteration=0):
    return os.path.join(root, f"iter_{iteration:07d}", f"mp_rank_{t:02d}" + (f"_{p:03d}" if pp > 1 else ""), "model_optim_rng.pt")


MODELS = {"llama": lambda: llama_config(), "llama-tied": lambda: llama_config(tied=True), "gpt2-tied": lambda: gpt2_config()}


@pytest.mark.parametrize("tp,pp", LAYOUTS, ids=[f"tp{t}pp{p}" for t, p in LAYOUTS])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_hf_to_megatron_to_hf_is_bit_exact(tmp_path, kind, tp, pp):
    model = make(MODELS[kind]())
    model.save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), tp, pp)
    write_hf(read_megatron(str(tmp_path / "meg")), str(tmp_path / "back"))
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back", output_loading_info=True)
    assert not any(info.values()), info
    original, restored = model.state_dict(), back.eval().state_dict()
    assert original.keys() == restored.keys()
    for name, t in original.items():
        assert torch.equal(t, restored[name]), name
    assert torch.equal(logits(model), logits(back))
    assert back.config.to_dict()["vocab_size"] == 250 and back.config.tie_word_embeddings == model.config.tie_word_embeddings


def test_rank_files_hold_megatrons_layout(tmp_path):
    """What Megatron itself expects in each file: fused QKV per query group, [gate_r; up_r] per rank, padded and
    split vocabulary, each stage numbering its layers from 0, args describing the grid."""
    model = make(llama_config())
    model.save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 2)
    assert (tmp_path / "meg" / "latest_checkpointed_iteration.txt").read_text() == "0"
    sd = model.state_dict()
    files = {(t, p): load_megatron_file(rank_file(tmp_path / "meg", t, p, 2)) for t in range(2) for p in range(2)}
    args = files[(0, 0)]["args"]
    assert isinstance(args, argparse.Namespace)
    assert (args.tensor_model_parallel_size, args.pipeline_model_parallel_size, args.padded_vocab_size) == (2, 2, 256)
    assert files[(0, 0)]["checkpoint_version"] == 3.0
    for t in range(2):
        stage0, stage1 = files[(t, 0)]["model"], files[(t, 1)]["model"]
        # layers 2 and 3 live on stage 1 as its layers 0 and 1
        assert torch.equal(stage1["decoder.layers.0.mlp.linear_fc2.weight"], sd["model.layers.2.mlp.down_proj.weight"].chunk(2, dim=1)[t])
        assert not any(k.startswith("decoder.layers.2.") for k in stage1)
        gate, up = sd["model.layers.2.mlp.gate_proj.weight"].chunk(2)[t], sd["model.layers.2.mlp.up_proj.weight"].chunk(2)[t]
        assert torch.equal(stage1["decoder.layers.0.mlp.linear_fc1.weight"], torch.cat([gate, up]))
        # one query group per rank: [q heads 2t, 2t+1; k head t; v head t]
        q = sd["model.layers.1.self_attn.q_proj.weight"].view(4, 12, 48)[2 * t : 2 * t + 2].reshape(24, 48)
        k = sd["model.layers.1.self_attn.k_proj.weight"].view(2, 12, 48)[t]
        v = sd["model.layers.1.self_attn.v_proj.weight"].view(2, 12, 48)[t]
        assert torch.equal(stage0["decoder.layers.1.self_attention.linear_qkv.weight"], torch.cat([q, k, v]))
        assert torch.equal(stage0["decoder.layers.1.self_attention.linear_qkv.layer_norm_weight"], sd["model.layers.1.input_layernorm.weight"])
        emb = stage0["embedding.word_embeddings.weight"]
        assert emb.shape == (128, 48)
        padded = torch.cat([sd["model.embed_tokens.weight"], torch.zeros(6, 48)])
        assert torch.equal(emb, padded.chunk(2)[t])
        assert "output_layer.weight" in stage1 and "output_layer.weight" not in stage0
        assert stage0["decoder.layers.1.self_attention.linear_qkv._extra_state"] is None


def test_local_spec_names(tmp_path):
    """--transformer-impl local names norms as the local spec's modules; reading accepts either naming."""
    model = make(llama_config())
    model.save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 1, te_names=False)
    sd = load_megatron_file(rank_file(tmp_path / "meg", 0, 0, 1))["model"]
    assert "decoder.layers.0.input_layernorm.weight" in sd and "decoder.layers.0.pre_mlp_layernorm.weight" in sd
    assert not any("layer_norm_weight" in k for k in sd)
    back = read_megatron(str(tmp_path / "meg"))
    assert torch.equal(back.model["model.layers.0.input_layernorm.weight"].load(), model.state_dict()["model.layers.0.input_layernorm.weight"])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base-trainer checkpoint (single process) after 2 AdamW steps: weights, moments, step, scheduler."""
    out = tmp_path_factory.mktemp("trained")
    cmd = [sys.executable, "-m", "trainers.base", "--steps", "2", "--output-dir", str(out), "--keep-last", "1"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=worker_env(), capture_output=True, timeout=300)
    return str(out / "checkpoint-2")


def test_a_tied_model_on_two_pipeline_stages_reads_back_with_its_optimizer(tmp_path):
    """Tied embeddings at PP 2: the last stage holds output_layer.weight, a parameter of its own that its optimizer
    numbers (megatron-core's shared_embedding_or_output_weight), so its groups count one more than the HF names
    it holds; read back (bare, with config.json: no record of the names), every weight, moment and step is the
    run's, the copy's state the embedding's."""
    import json
    import shutil

    from converters import cli, registry

    run = tmp_path / "run"
    subprocess.run([sys.executable, "-m", "trainers.base", "--steps", "2", "--tied", "--output-dir", str(run), "--keep-last", "1"],
                   check=True, cwd=ROOT, env=worker_env(), capture_output=True, timeout=300)
    meg, bare = tmp_path / "meg", tmp_path / "bare"
    assert cli.main(["convert", str(run / "checkpoint-2"), str(meg), "--to", "megatron", "--tp", "2", "--pp", "2"]) == 0
    last = torch.load(meg / "iter_0000002" / "mp_rank_00_001" / "model_optim_rng.pt", weights_only=False)
    inner = last["optimizer"].get("optimizer", last["optimizer"])  # torch's state dict (inside Megatron's mixed-precision one)
    assert "output_layer.weight" in last["model"] and sum(len(g["params"]) for g in inner["param_groups"]) == 8
    config = json.loads((meg / "iter_0000002" / "manifest.json").read_text())["model"]["config"]
    shutil.copytree(meg, bare, ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    (bare / "config.json").write_text(json.dumps(config))
    _, src = registry.read(str(run / "checkpoint-2"))
    for source in (meg, bare):
        report = diff_checkpoints(src, read_megatron(str(source)))
        assert not report.problems, [(e.key, e.status, e.detail) for e in report.problems][:5]
        assert report.count("exact") == len(report.entries) > 60


def test_optimizer_state_round_trips_through_tp2_pp2(tmp_path, trained):
    from converters import registry

    _, src = registry.read(trained)
    write_megatron(src, str(tmp_path / "meg"), 2, 2)
    back = read_megatron(str(tmp_path / "meg"))
    assert back.step == 2 and back.optimizer is not None
    report = diff_checkpoints(src, back)
    assert not report.problems, [(e.key, e.status, e.detail) for e in report.problems][:5]
    assert report.count("exact") == len(report.entries) > 0
    assert {k for k in back.optimizer.tensors} == {"exp_avg", "exp_avg_sq"}
    assert back.optimizer.scalars["step"]["model.norm.weight"]["value"] == 2
    # every rank numbers its own parameters: decay group first, then biases and norms
    state = load_megatron_file(rank_file(tmp_path / "meg", 1, 1, 2, iteration=2))
    opt, model = state["optimizer"], state["model"]
    decay = [k for k, v in model.items() if isinstance(v, torch.Tensor) and v.dim() > 1]
    assert opt["param_groups"][0]["params"] == list(range(len(decay)))
    assert opt["param_groups"][1]["weight_decay"] == 0.0


def test_cli_converts_and_refuses_bad_layouts(tmp_path):
    make(llama_config()).save_pretrained(tmp_path / "hf")
    cli = [sys.executable, "-m", "converters.cli"]
    done = subprocess.run(cli + ["convert", str(tmp_path / "hf"), str(tmp_path / "meg"), "--to", "megatron", "--tp", "2", "--pp", "2"],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    # Megatron-LM's --load restores every generator and fails on a partial state: the HF source has none, so each
    # rank holds the state Megatron-LM itself starts from with --seed 1234 (seed + 100 x pipeline rank)
    assert "note: Megatron RNG: Megatron-LM's initial streams for --seed 1234" in done.stdout
    state = load_megatron_file(rank_file(tmp_path / "meg", 1, 1, 2))
    assert state["args"].no_save_rng is False and state["args"].seed == 1234
    assert_megatron_initial_rng(state["rng_state"], 1234 + 100, tp_rank=1)
    assert sorted(n for n in os.listdir(tmp_path / "meg" / "iter_0000000") if n != "manifest.json") == ["mp_rank_00_000", "mp_rank_00_001", "mp_rank_01_000", "mp_rank_01_001"]
    bad = subprocess.run(cli + ["convert", str(tmp_path / "hf"), str(tmp_path / "meg3"), "--to", "megatron", "--tp", "3"],
                         capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert bad.returncode != 0
    assert "tensor-parallel size 3 does not divide the model's attention heads 4, query groups 2" in bad.stderr
    assert not (tmp_path / "meg3").exists()


def assert_megatron_initial_rng(rng_state, seed: int, tp_rank: int) -> None:
    """One replica's state, as Megatron-LM's _set_random_seed(seed) and megatron-core's model_parallel_cuda_manual_seed
    leave it: python, numpy and torch seeded with ``seed``; CUDA's and the tracker's generators (torch's CUDA state:
    the seed as uint64, the Philox offset as int64) with seed, seed + 2718 + TP rank, seed + 1024 + TP rank."""
    import random
    import struct

    import numpy as np

    (rng,) = rng_state
    assert rng["random_rng_state"] == random.Random(seed).getstate()
    theirs, ours = np.random.RandomState(seed).get_state(), rng["np_rng_state"]
    assert theirs[0] == ours[0] and np.array_equal(theirs[1], ours[1]) and tuple(theirs[2:]) == tuple(ours[2:])
    assert torch.equal(rng["torch_rng_state"], torch.Generator().manual_seed(seed).get_state())
    cuda = lambda s: torch.tensor(list(struct.pack("<Qq", s, 0)), dtype=torch.uint8)  # noqa: E731
    assert torch.equal(rng["cuda_rng_state"], cuda(seed))
    assert set(rng["rng_tracker_states"]) == {"data-parallel-rng", "model-parallel-rng", "expert-parallel-rng"}
    for name, s in (("data-parallel-rng", seed), ("model-parallel-rng", seed + 2718 + tp_rank), ("expert-parallel-rng", seed + 1024 + tp_rank)):
        assert torch.equal(rng["rng_tracker_states"][name], cuda(s)), name


def test_megatron_rng_round_trips_through_universal(tmp_path):
    """Every rank's whole RNG state (python, numpy, torch, CUDA, the tracker's streams) is read into universal and
    written back byte for byte, legacy and torch_dist alike, with no note: nothing is seeded afresh."""
    from converters.dcp import DCPReader

    from converters import registry

    make(llama_config()).save_pretrained(tmp_path / "hf")
    for src, dst, target, extra in (("hf", "meg", "megatron", {"tp": 2}), ("meg", "uni", "universal", {}),
                                    ("uni", "back", "megatron", {"tp": 2}), ("uni", "dist", "megatron-dist", {"tp": 2}),
                                    ("dist", "uni2", "universal", {}), ("uni2", "back2", "megatron", {"tp": 2})):
        _, ckpt = registry.read(str(tmp_path / src))
        registry.writer(target).write(ckpt, str(tmp_path / dst), registry.Options(extra=extra))
        assert any("Megatron RNG" in n for n in ckpt.notes) == (src == "hf"), ckpt.notes

    def same(a, b) -> bool:
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and torch.equal(a, b)
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, (list, tuple)):
            return isinstance(b, (list, tuple)) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
        if hasattr(a, "shape"):  # numpy's key array
            return a.tolist() == b.tolist()
        return a == b

    dist = DCPReader(str(tmp_path / "dist" / "iter_0000000"))
    for t in range(2):
        first = load_megatron_file(rank_file(tmp_path / "meg", t, 0, 1))["rng_state"]
        for copy in ("back", "back2"):
            assert same(first, load_megatron_file(rank_file(tmp_path / copy, t, 0, 1))["rng_state"]), (copy, t)
        assert same(first, dist.read_object(f"rng_state/shard_0.{t}_1.2", numpy_allowlist())[0]), t


def as_megatron_wrote_it(root) -> None:
    """Our output without our manifest: Megatron-LM's own files, which the reader's own checks must guard."""
    import shutil

    for iteration in root.glob("iter_*"):
        os.remove(iteration / "manifest.json")
        for ours in ("components", "ranks"):
            shutil.rmtree(iteration / ours, ignore_errors=True)


def test_missing_rank_directory_is_named(tmp_path):
    make(llama_config()).save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 2)
    import shutil

    as_megatron_wrote_it(tmp_path / "meg")
    shutil.rmtree(tmp_path / "meg" / "iter_0000000" / "mp_rank_01_001")
    with pytest.raises(MissingFileError, match=r"mp_rank_01_001: missing: a checkpoint with TP 2 x PP 2"):
        read_megatron(str(tmp_path / "meg"))
    shutil.rmtree(tmp_path / "meg" / "iter_0000000" / "mp_rank_01_000")  # the grid's edge: only args know TP 2
    with pytest.raises(MissingFileError, match=r"mp_rank_01_000: missing"):
        read_megatron(str(tmp_path / "meg"))


def test_mismatched_vocab_padding_is_named(tmp_path):
    make(llama_config()).save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 1)
    as_megatron_wrote_it(tmp_path / "meg")
    path = rank_file(tmp_path / "meg", 0, 0, 1)
    for t in range(2):
        p = rank_file(tmp_path / "meg", t, 0, 1)
        state = torch.load(p, weights_only=False)  # not mapped: the file is rewritten below
        state["args"].padded_vocab_size = 384  # as if written with --make-vocab-size-divisible-by 192
        torch.save(state, p)
    with pytest.raises(CorruptCheckpointError, match=r"128 rows per rank x TP 2 = 256, but args.padded_vocab_size is 384") as err:
        read_megatron(str(tmp_path / "meg"))
    assert err.value.path == path


def test_tp_that_does_not_divide_heads_is_refused(tmp_path):
    make(llama_config()).save_pretrained(tmp_path / "hf")
    with pytest.raises(ConversionError, match="tensor-parallel size 4 does not divide the model's query groups 2"):
        write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 4, 1)
    assert not (tmp_path / "meg").exists()


def test_untrusted_pickle_is_refused(tmp_path):
    make(llama_config()).save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 1, 1)
    as_megatron_wrote_it(tmp_path / "meg")
    path = rank_file(tmp_path / "meg", 0, 0, 1)
    state = torch.load(path, weights_only=False)  # not mapped: the file is rewritten below
    state["hook"] = os.getcwd  # a global outside the allowlist: loading would call into os
    torch.save(state, path)
    with pytest.raises(UnsafePickleError, match="references posix.getcwd"):
        read_megatron(str(tmp_path / "meg"))


# --- torch_dist ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["llama", "gpt2-tied"])
def test_hf_to_megatron_dist_to_hf_is_bit_exact(tmp_path, kind):
    """HF -> torch_dist -> HF: every tensor and the logits bit-exact; the layers stacked, QKV and fc1 in their
    TP=1 layout, the vocabulary padded, metadata.json and common.pt as megatron-core writes them."""
    from converters.dcp import DCPReader
    from converters.megatron_dist import read_megatron_dist, write_megatron_dist

    model = make(MODELS[kind]())
    model.save_pretrained(tmp_path / "hf")
    write_megatron_dist(read_hf(str(tmp_path / "hf")), str(tmp_path / "dist"), tp=2)
    directory = tmp_path / "dist" / "iter_0000000"
    assert sorted(os.listdir(directory)) == [".metadata", "__0_0.distcp", "common.pt", "manifest.json", "metadata.json"]
    assert (directory / "metadata.json").read_text() == (
        '{"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch", "common_backend_version": 1}')
    common = load_megatron_file(str(directory / "common.pt"))
    assert common["args"].no_save_rng is False  # Megatron-LM restores the rng_state objects at this TP x PP
    for t in range(2):
        assert_megatron_initial_rng(DCPReader(str(directory)).read_object(f"rng_state/shard_0.{t}_1.2", numpy_allowlist())[0], 1234, tp_rank=t)
    assert common["iteration"] == 0 and common["args"].padded_vocab_size == 256 and common["args"].ckpt_format == "torch_dist"
    reader = DCPReader(str(directory))
    if kind == "llama":
        assert reader.spec("decoder.layers.self_attention.linear_qkv.weight").shape == (4, (4 + 2 * 2) * 12, 48)
        assert reader.spec("decoder.layers.mlp.linear_fc1.weight").shape == (4, 200, 48)
        layer1 = model.model.layers[1]
        fc1 = reader.read("decoder.layers.mlp.linear_fc1.weight", (1, 0, 0), (1, 200, 48))[0]
        assert torch.equal(fc1, torch.cat([layer1.mlp.gate_proj.weight, layer1.mlp.up_proj.weight]))
        qkv = reader.read("decoder.layers.self_attention.linear_qkv.weight", (1, 0, 0), (1, 96, 48))[0]
        q, k, v = (layer1.self_attn.q_proj.weight, layer1.self_attn.k_proj.weight, layer1.self_attn.v_proj.weight)
        assert torch.equal(qkv[:48], torch.cat([q[:24], k[:12], v[:12]]))  # query group 0: its two q heads, k_0, v_0
        assert "decoder.layers.self_attention.linear_qkv.layer_norm_weight" in reader.tensor_keys()
    assert reader.spec("embedding.word_embeddings.weight").shape == (256, 48)
    write_hf(read_megatron_dist(str(tmp_path / "dist")), str(tmp_path / "back"))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    for name, t in model.state_dict().items():
        assert torch.equal(t, back.state_dict()[name]), name
    assert torch.equal(logits(model), logits(back))


def test_optimizer_state_round_trips_through_megatron_dist(tmp_path, trained):
    from converters import registry

    _, src = registry.read(trained)
    cli = [sys.executable, "-m", "converters.cli", "convert", trained, str(tmp_path / "dist"), "--to", "megatron-dist"]
    done = subprocess.run(cli, capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    fmt, back = registry.read(str(tmp_path / "dist"))
    assert fmt.name == "megatron-dist" and back.step == 2
    report = diff_checkpoints(src, back)
    assert not report.problems, [(e.key, e.status, e.detail) for e in report.problems][:5]
    assert report.count("exact") == len(report.entries) > 0
    assert [g["weight_decay"] for g in back.optimizer.param_groups] == [0.1, 0.0]
    assert back.optimizer.scalars["step"]["model.norm.weight"]["value"] == 2


def test_a_megatron_dist_export_plans_only_what_it_writes_and_checks_its_first_weight_while_planning(tmp_path, trained, monkeypatch):
    """Reading torch_dist plans no rows (each tensor's row plan is made when a writer first asks for its bytes): an
    export to Hugging Face plans the model's tensors once each and none of the optimizer's. The first weight's
    blocks are already being checked against the manifest when the read returns, the rest only as they are used."""
    from converters import megatron, registry
    from converters.dcp import DCPReader
    from converters.megatron_map import rules
    from interop import ranged
    from tests.conftest import by_blocks

    _, src = registry.read(trained)
    registry.writer("megatron-dist").write(src, str(tmp_path / "dist"), registry.Options(extra={"tp": 2}))
    iteration = tmp_path / "dist" / "iter_0000002"
    blocked = by_blocks(iteration, 4096)
    assert "__0_0.distcp" in blocked  # (the one data file: many blocks)
    planned = []
    real = megatron.row_runs
    monkeypatch.setattr(megatron, "row_runs", lambda rule, *a, **k: planned.append(rule.megatron) or real(rule, *a, **k))
    _, ckpt = registry.read(str(tmp_path / "dist"))
    assert planned == [] and ckpt.optimizer is not None
    check = ranged.registered(str(iteration / "__0_0.distcp"))
    reader = DCPReader(str(iteration))
    first = "embedding.word_embeddings.weight"  # (an fp32 run: the weights are the model's, no master copy)
    spans = [(c.offset, c.offset + c.length) for c in reader._chunks[first]]
    first_blocks = {i for lo, hi in spans for i in range(lo // 4096, (hi - 1) // 4096 + 1)}
    assert set(check._checks) == first_blocks  # started by the read, nothing else yet
    registry.writer("hf").write(ckpt, str(tmp_path / "hf"), registry.Options())
    arch = megatron.MegatronArch.from_args(vars(megatron.load_megatron_file(str(iteration / "common.pt"))["args"]), "", grouped_gemm=True)
    assert sorted(planned) == sorted(r.megatron for r in rules(arch)), "each model tensor planned once, no optimizer state"
    back = read_hf(str(tmp_path / "hf"))
    for name, t in src.model.items():
        assert torch.equal(back.model[name].load(), t.load()), name


@pytest.mark.parametrize("target", [("deepspeed", "--zero-stage", "2", "--world-size", "2"),
                                    ("deepspeed", "--zero-stage", "3", "--world-size", "4"), ("ds-universal",)],
                         ids=["zero2", "zero3", "ds-universal"])
def test_megatron_tp_pp_into_deepspeed_equals_the_way_through_universal(tmp_path, trained, target):
    """A TP 2 x PP 2 checkpoint into DeepSpeed's files: each rank's partitions streamed from the rank files' rows
    (a column split's halves side by side, fused QKV taken apart) are the bytes the same conversion writes from
    the universal checkpoint of it, whose way into DeepSpeed the engine's own loader checks (test_deepspeed)."""
    from converters import cli

    meg, uni = str(tmp_path / "meg"), str(tmp_path / "uni")
    assert cli.main(["convert", trained, meg, "--to", "megatron", "--tp", "2", "--pp", "2"]) == 0
    assert cli.main(["convert", meg, uni, "--to", "universal"]) == 0
    files = {}
    for name, source in (("direct", meg), ("through", uni)):
        out = tmp_path / name
        assert cli.main(["convert", source, str(out), "--to", *target]) == 0
        files[name] = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file() and p.name != "manifest.json"}
    assert sorted(files["direct"]) == sorted(files["through"]) and len(files["direct"]) > 2
    assert [rel for rel, data in files["direct"].items() if files["through"][rel] != data] == []


def test_distributed_optimizer_layout_is_refused_where_it_is_not_known(tmp_path):
    """distrib_optim.pt's flat layout follows megatron-core's module order, known here for its local spec: with
    TransformerEngine's fused norms the converter refuses with one line instead of writing a layout it guesses."""
    make(llama_config()).save_pretrained(tmp_path / "hf")
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(tmp_path / "hf"), str(tmp_path / "meg"),
                           "--to", "megatron", "--use-distributed-optimizer"], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert "--use-distributed-optimizer is written for --transformer-impl local" in done.stderr
    assert not (tmp_path / "meg").exists()


def test_fully_reshardable_round_trips_exactly(tmp_path, trained):
    """The distributed optimizer's fully_reshardable layout (optimizer.state.param / exp_avg / exp_avg_sq per tensor,
    the step in the groups, the layout in common.pt's content metadata) reads back exactly; megatron-core's own load
    of it runs in test_megatron_core.py under -m slow."""
    from converters import registry
    from converters.dcp import DCPReader
    from converters.megatron_dist import read_megatron_dist, write_megatron_dist

    _, src = registry.read(trained)
    write_megatron_dist(src, str(tmp_path / "dist"), 2, distributed_optimizer="fully_reshardable")
    common = load_megatron_file(str(tmp_path / "dist" / "iter_0000002" / "common.pt"))
    assert common["content_metadata"]["distrib_optim_sharding_type"] == "fully_reshardable"
    assert "optimizer.state.param.decoder.final_layernorm.weight" in DCPReader(str(tmp_path / "dist" / "iter_0000002")).tensor_keys()
    back = read_megatron_dist(str(tmp_path / "dist"))
    report = diff_checkpoints(src, back)
    assert not report.problems, [(e.key, e.status, e.detail) for e in report.problems][:5]
    assert report.count("exact") == len(report.entries) > 0 and back.optimizer.scalars["step"]["model.norm.weight"]["value"] == 2


def test_dp_reshardable_buckets_round_trip_and_a_wrong_module_order_is_refused(tmp_path, trained, monkeypatch):
    """torch_dist's dp_reshardable buckets at TP2 x PP2 (four flat buckets) round-trip exactly in the local spec's
    module order and in Transformer Engine's (the reader finds which one from the fp32 masters of the norms); a
    bucket laid out in neither is refused with one line, not read as shifted garbage."""
    from converters import megatron_buckets as buckets
    from converters import registry
    from converters.megatron_dist import read_megatron_dist, write_megatron_dist

    _, src = registry.read(trained)
    real = buckets.module_orders
    te_first = lambda arch: list(reversed(real(arch)))  # noqa: E731

    def broken(arch):  # the last stage's head and final norm swapped
        name, order = real(arch)[0]
        i, j = len(order) - 2, len(order) - 1
        order = order[:i] + [order[j], order[i]]
        return [("broken", order)]

    for name, orders in (("local", real), ("transformer_engine", te_first), ("broken", broken)):
        monkeypatch.setattr(buckets, "module_orders", orders)
        write_megatron_dist(src, str(tmp_path / name), 2, distributed_optimizer="dp_reshardable", pp=2, transformer_impl="local")
        monkeypatch.setattr(buckets, "module_orders", real)
        if name == "broken":
            with pytest.raises(CorruptCheckpointError, match="fit no known module order"):
                read_megatron_dist(str(tmp_path / name))
            continue
        back = read_megatron_dist(str(tmp_path / name))
        report = diff_checkpoints(src, back)
        assert not report.problems, [(e.key, e.status, e.detail) for e in report.problems][:5]
        assert report.count("exact") == len(report.entries) > 0
        assert back.optimizer.scalars["step"]["model.norm.weight"]["value"] == 2
    assert "decoder.final_layernorm.weight's fp32 master is not its weight" in str(
        pytest.raises(CorruptCheckpointError, read_megatron_dist, str(tmp_path / "broken")).value)


def test_the_distributed_optimizer_buffer_is_megatron_cores():
    """megatron-core's _ParamAndGradBuffer, step by step: reverse module order, each start rounded up to 64 from its
    bucket's start; a shared (tied) embedding in a bucket of its own, the bucket closed before it keeping its
    alignment gap; --overlap-grad-reduce's bucket closed once it holds bucket_size. distrib_optim.pt concatenates
    the buckets' unpadded parts."""
    from converters.megatron_buffer import Bucket, buckets, coalesced, run_bucket_size

    params = [("a", (3, 5)), ("b", (7,)), ("c", (100,))]
    assert buckets(params) == [Bucket({"c": (0, 100), "b": (128, 135), "a": (192, 207)}, 207)]
    assert coalesced(buckets(params)) == ({"c": (0, 100), "b": (128, 135), "a": (192, 207)}, 207)
    # the first stage's tied embedding is last in reverse order: the bucket before it ends at its aligned start
    assert buckets(params, shared={"a"}) == [Bucket({"c": (0, 100), "b": (128, 135)}, 192), Bucket({"a": (0, 15)}, 15)]
    # the last stage's copy is first: closed right after it, the next bucket counting from 0 again
    assert buckets(params, shared={"c"}) == [Bucket({"c": (0, 100)}, 100), Bucket({"b": (0, 7), "a": (64, 79)}, 79)]
    assert coalesced(buckets(params, shared={"c"})) == ({"c": (0, 100), "b": (100, 107), "a": (164, 179)}, 179)
    assert buckets(params, bucket_size=120) == [Bucket({"c": (0, 100), "b": (128, 135)}, 135), Bucket({"a": (0, 15)}, 15)]
    assert buckets(params, bucket_size=100) == [Bucket({"c": (0, 100)}, 100), Bucket({"b": (0, 7), "a": (64, 79)}, 79)]
    # the bucket size of the run, from Megatron-LM's args: only with --overlap-grad-reduce, on the first stage
    assert run_bucket_size({"overlap_grad_reduce": False, "ddp_bucket_size": 10}, 0) is None
    assert run_bucket_size({"overlap_grad_reduce": True, "ddp_bucket_size": 10}, 1) is None
    assert run_bucket_size({"overlap_grad_reduce": True, "ddp_bucket_size": 10}, 0) == 10
    assert run_bucket_size({"overlap_grad_reduce": True, "data_parallel_size": 8}, 0) == 40_000_000
    assert run_bucket_size({"overlap_grad_reduce": True, "data_parallel_size": 64}, 0) == 64_000_000


def test_bf16_torch_dist_keeps_the_fp32_masters_bit_exact(tmp_path):
    """A trained fp32 run -> torch_dist in bf16: the model's weights are the masters rounded to bf16, and the
    optimizer's fp32 main params (optimizer.state.fp32_param.*) the masters themselves; read back, the masters are
    the weights (not their rounding), so bf16 -> universal -> bf16 keeps every master and moment bit for bit."""
    from converters.dcp import DCPReader
    from converters.megatron_dist import read_megatron_dist
    from converters.registry import read
    from trainers.base import BaseTrainer, TrainerConfig

    BaseTrainer(TrainerConfig(steps=1, save_every=1, output_dir=str(tmp_path / "run"))).train()
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    steps = [(tmp_path / "run", tmp_path / "d1"), (tmp_path / "d1", tmp_path / "u"), (tmp_path / "u", tmp_path / "d2")]
    for src, dst in steps:
        to = ["--to", "universal"] if dst.name == "u" else ["--to", "megatron-dist", "--dtype", "bfloat16"]
        done = subprocess.run(cli + [str(src), str(dst), *to], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        assert done.returncode == 0, done.stderr
    source = dict(read(str(tmp_path / "run"))[1].tensors())
    back = read_megatron_dist(str(tmp_path / "d1"))
    assert back.source["dtype"] == "bfloat16" and back.source["master_dtype"] == "float32"
    for name, t in back.tensors():
        assert t.spec.dtype == torch.float32 and torch.equal(t.load(), source[name].load()), name
    first, second = DCPReader(str(tmp_path / "d1" / "iter_0000001")), DCPReader(str(tmp_path / "d2" / "iter_0000001"))
    key = "decoder.layers.self_attention.linear_qkv.weight"
    master = first.read(f"optimizer.state.fp32_param.{key}")
    assert master.dtype == torch.float32 and torch.equal(first.read(key), master.to(torch.bfloat16))
    assert sorted(first.tensor_keys()) == sorted(second.tensor_keys())
    for k in first.tensor_keys():
        assert torch.equal(first.read(k), second.read(k)), k


def test_megatron_without_args_converts_with_config(tmp_path):
    """Rank files without `args` (what some conversion scripts write): the model's shape comes from --config;
    without it, one line asking for it."""
    make(llama_config()).save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 1)
    as_megatron_wrote_it(tmp_path / "meg")
    for t in range(2):
        path = rank_file(tmp_path / "meg", t, 0, 1)
        state = torch.load(path, weights_only=False)
        del state["args"]
        torch.save(state, path)
    cli = [sys.executable, "-m", "converters.cli", "convert", str(tmp_path / "meg")]
    done = subprocess.run(cli + [str(tmp_path / "out0"), "--to", "hf"], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 2 and "holds no 'args'" in done.stderr and "--config" in done.stderr
    done = subprocess.run(cli + [str(tmp_path / "out"), "--to", "hf", "--config", str(tmp_path / "hf")],
                          capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert done.returncode == 0, done.stderr
    report = diff_checkpoints(read_hf(str(tmp_path / "hf")), read_hf(str(tmp_path / "out")))
    assert not report.problems and report.count("exact") > 0


def test_rank_files_are_checked_only_where_an_export_reads_them(tmp_path, trained):
    """Megatron rank files recorded block by block are read as stand-ins (Megatron-LM's own objects in ``args``
    too): an HF export checks (and reads) the weights it writes, not the Adam moments beside them. A flipped byte
    in a moment leaves the export exact; a conversion that keeps the moments, and verify, refuse the file by name."""
    from converters.cli import main

    from .conftest import by_blocks, reseal

    meg = tmp_path / "meg"
    assert main(["convert", trained, str(meg), "--to", "megatron", "--tp", "2", "--pp", "2"]) == 0
    iteration = meg / "iter_0000002"
    path = iteration / "mp_rank_01_001" / "model_optim_rng.pt"
    from megatron.core.enums import ModelType  # as Megatron-LM's args hold it: a global the stand-in reader stands in for
    state = torch.load(path, weights_only=False)
    state["args"].model_type = ModelType.encoder_or_decoder
    torch.save(state, path)
    reseal(iteration, "mp_rank_01_001/model_optim_rng.pt")
    assert "mp_rank_01_001/model_optim_rng.pt" in by_blocks(iteration, 512)
    assert main(["convert", str(meg), str(tmp_path / "hf0"), "--to", "hf"]) == 0
    exported = {p.name: p.read_bytes() for p in (tmp_path / "hf0").iterdir()}
    opt = load_megatron_file(str(path), stored=True)["optimizer"]  # read as stand-ins, the enum in args included
    moments = [e["exp_avg"] for e in opt.get("optimizer", opt)["state"].values()]
    assert all(type(m).__name__ == "StoredTensor" for m in moments)
    lo, hi = max((m._span() for m in moments), key=lambda span: span[1] - span[0])
    at = (lo // 512 + 2) * 512 + 100  # inside a block that holds nothing but the moment
    assert at + 512 < hi, "the moment is too small to hold a block of its own"
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    assert main(["convert", str(meg), str(tmp_path / "hf1"), "--to", "hf"]) == 0
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf1").iterdir()} == exported
    assert main(["verify", str(meg), "-q"]) == 1
    failed = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(meg), str(tmp_path / "uni"), "--to", "universal"],
                            capture_output=True, text=True, env=worker_env(), cwd=ROOT)
    assert failed.returncode == 2 and "model_optim_rng.pt" in failed.stderr and "differ from the manifest" in failed.stderr, failed.stderr
    assert not (tmp_path / "uni").exists()


@pytest.mark.parametrize("kind", ["llama", "gpt2-tied"])
def test_whole_rows_are_offered_as_views_of_the_rank_files(tmp_path, kind):
    """A tensor whose tensor-parallel merge and unfuse move whole rows (a row split, the vocabulary, [gate; up], a
    fused QKV) is offered as views of the rank files, which a writer copies file to file; a column split's rows (one
    row of each piece, side by side) as their bytes joined without torch; their bytes are the merged tensor's,
    exactly. GPT-2's transposed weights are merged with torch."""
    from interop.tensors import raw_bytes

    make(MODELS[kind]()).save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 2)
    ckpt = read_megatron(str(tmp_path / "meg"))
    viewed = {}
    for name, t in ckpt.model.items():
        pieces = t.mapped_pieces() if t.mapped_pieces is not None else None
        viewed[name] = pieces is not None
        if pieces is not None:
            assert b"".join(bytes(p.data) for p in pieces) == bytes(raw_bytes(t.load())), name
    if kind == "llama":
        layer = "model.layers.1"
        assert all(viewed[f"{layer}.{n}.weight"] for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                              "mlp.gate_proj", "mlp.up_proj", "input_layernorm"))
        assert viewed["model.embed_tokens.weight"] and viewed["lm_head.weight"]
        assert viewed[f"{layer}.self_attn.o_proj.weight"] and viewed[f"{layer}.mlp.down_proj.weight"]  # column splits
        joined = ckpt.model[f"{layer}.mlp.down_proj.weight"].mapped_pieces()
        assert len(joined) == 1 and joined[0].source is None  # short runs: one buffer, not a write per piece row
    else:
        assert not viewed["transformer.h.0.attn.c_attn.weight"] and viewed["transformer.h.0.ln_1.weight"]


@pytest.mark.parametrize("order", ["columns", "shuffled", "one piece"])
def test_a_row_plans_rows_are_gathered_in_its_order(order):
    """The bytes gathered for a plan of short runs are its piece rows one after another, in the plan's order: a
    column split's (every TP-th row from one piece: one strided copy) and any other order (row by row)."""
    import numpy as np

    from converters.megatron import RowPlan, _gather_rows
    from interop.tensors import Piece

    rows, row_bytes, tp = 6, 12, 3
    data = {t: bytes(np.random.default_rng(t).integers(0, 256, rows * row_bytes, dtype=np.uint8)) for t in range(tp)}
    ids = {"columns": np.array([t * rows + r for r in range(rows) for t in range(tp)]),
           "shuffled": np.random.default_rng(7).permutation(tp * rows),
           "one piece": np.array([rows + r for r in (5, 0, 1, 2)])}[order].astype(np.int64)
    plan = RowPlan(ids, np.arange(ids.size), rows)
    whole = {t: Piece(memoryview(data[t]), dtype="uint8") for t in sorted(set((ids // rows).tolist()))}
    want = b"".join(data[int(i) // rows][int(i) % rows * row_bytes : (int(i) % rows + 1) * row_bytes] for i in ids)
    assert bytes(_gather_rows(plan, whole, row_bytes)) == want


def test_rank_files_written_at_once_are_the_files_written_one_by_one(tmp_path, trained, monkeypatch):
    """A stage's rank files are pickled and written on several threads; each is byte for byte the file written
    alone (and the manifest's files are the same ones)."""
    import converters.engine_checkpoint as engine_checkpoint
    from converters import registry

    from .conftest import native_files

    _, src = registry.read(trained)

    def write(out, writers: int) -> dict[str, bytes]:
        monkeypatch.setattr(engine_checkpoint, "WRITERS", writers)
        write_megatron(src, str(out), 2, 2)
        return native_files(out / "iter_0000002")

    one, several = write(tmp_path / "one", 1), write(tmp_path / "several", 4)
    assert len(one) == 4 and one == several


def test_an_export_to_hf_imports_no_torch(tmp_path):
    """Megatron -> Hugging Face only moves bytes: the rank files are read as stand-ins, the merges are planned on
    row numbers (numpy), a column split's rows are joined as bytes, and the RNG states and the padded vocabulary
    rows (nonzero, as a Megatron-LM run trains them) are built only for a target that keeps them. With the config's
    answers kept (the first conversion asks transformers), the export imports neither torch nor transformers, and
    gives the merged tensors exactly; a reader that does want the padded rows gets them exactly."""
    from safetensors.torch import load_file

    from converters.megatron import PADDING

    make(llama_config()).save_pretrained(tmp_path / "hf")
    src = read_hf(str(tmp_path / "hf"))
    trained_rows = {"model/embedding.word_embeddings.weight": torch.randn(6, 48)}  # vocab 250 padded to 256
    src.extra_state[PADDING] = trained_rows
    write_megatron(src, str(tmp_path / "meg"), 2, 2)
    kept = read_megatron(str(tmp_path / "meg")).extra_state[PADDING]
    assert torch.equal(kept["model/embedding.word_embeddings.weight"], trained_rows["model/embedding.word_embeddings.weight"])
    assert torch.equal(kept["model/output_layer.weight"], torch.zeros(6, 48))  # padded by the writer
    env = dict(worker_env(), INTEROP_CACHE_DIR=str(tmp_path / "kept"))
    probe = ("import sys; from converters import cli; rc = cli.main(sys.argv[1:]); "
             "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules)); sys.exit(rc)")
    seen = []
    for out in ("first", "again"):
        done = subprocess.run([sys.executable, "-c", probe, "convert", str(tmp_path / "meg"), str(tmp_path / out), "--to", "hf"],
                              env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
        assert done.returncode == 0, done.stderr
        seen.append(done.stdout.strip().splitlines()[-1])
    assert seen[1] == "[]", seen
    ours, theirs = load_file(tmp_path / "again" / "model.safetensors"), load_file(tmp_path / "hf" / "model.safetensors")
    assert set(ours) == set(theirs) and all(torch.equal(ours[n], theirs[n]) for n in theirs)


def test_row_numbers_chunk_and_split_as_torch_does():
    """The planning stand-in answers chunk, split, t and cat as torch does (the merges and fusers run on it)."""
    import numpy as np

    from converters.megatron_map import cat
    from converters.row_numbers import RowNumbers

    for shape, dim, n in (((7, 3), 0, 3), ((8, 4), 1, 2), ((5,), 0, 5), ((6, 2, 2), 0, 4), ((0, 3), 0, 2)):
        t = torch.arange(math.prod(shape)).reshape(shape)
        r = RowNumbers.of(np.arange(math.prod(shape)).reshape(shape))
        assert [x.tolist() for x in r.chunk(n, dim)] == [x.tolist() for x in t.chunk(n, dim)]
        assert [x.tolist() for x in r.split(2, dim)] == [x.tolist() for x in t.split(2, dim)]
        sizes = [1, shape[dim] - 1] if shape[dim] else [0]
        assert [x.tolist() for x in r.split(sizes, dim)] == [x.tolist() for x in t.split(sizes, dim)]
        assert cat([r, r], dim).tolist() == torch.cat([t, t], dim).tolist()
    m = torch.arange(6).reshape(2, 3)
    assert RowNumbers.of(m.numpy()).t().tolist() == m.t().tolist()
    assert RowNumbers.shaped((4, 5)).reshape(2, 2, 5).shape == (2, 2, 5)


def test_padded_rows_are_judged_zero_from_their_bytes_as_torch_judges_them(tmp_path):
    """Whether a source's padded vocabulary rows are kept (they are, unless all zero) is read from the stand-ins'
    bytes without torch, with torch's answer: -0.0 is zero, a denormal or a NaN is not."""
    from converters import torch_zip
    from converters.megatron import _nonzero

    values = [torch.zeros(4), torch.tensor([0.0, -0.0]), torch.tensor([0.0, 1e-40]), torch.tensor([-0.0, float("nan")]),
              torch.tensor([-0.0], dtype=torch.bfloat16), torch.tensor([0.0, 2.0], dtype=torch.float16),
              torch.zeros(3, dtype=torch.int64), torch.tensor([0, -1], dtype=torch.int32)]
    torch.save(values, tmp_path / "rows.pt")
    stored = torch_zip.load(str(tmp_path / "rows.pt"))
    assert all(isinstance(s, torch_zip.StoredTensor) for s in stored)
    assert [_nonzero(s) for s in stored] == [bool(v.any()) for v in values] == [False, False, True, True, False, True, False, True]


def test_rng_states_are_built_once_when_first_read():
    """The RNG states a Megatron read defers: built on first use, once; a build that fails fails again where used
    (never an empty list that would reseed every rank in silence); read-only."""
    from interop.logical import DeferredList

    calls = []
    states = DeferredList(lambda: calls.append(1) or [{"torch": 1}, {"torch": 2}])
    assert not calls and len(states) == 2 and states[1] == {"torch": 2} and list(states) == [{"torch": 1}, {"torch": 2}]
    assert states == [{"torch": 1}, {"torch": 2}] and len(calls) == 1

    def broken():
        raise ValueError("damaged rng_state")

    failing = DeferredList(broken)
    for _ in range(2):
        with pytest.raises(ValueError, match="damaged"):
            len(failing)
    with pytest.raises(AttributeError):
        failing.append(3)


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("kind", ["llama", "gpt2-tied"])
def test_each_ranks_piece_streams_the_sources_rows_and_equals_the_split(tmp_path, kind, tp):
    """A Megatron writer's TP pieces (converters.megatron_pieces): each equals the rule's own fuse, padding and split
    of the loaded tensors, byte for byte as streamed; where those move whole rows (row splits, [gate; up], a GQA
    QKV, the padded vocabulary) the piece is runs of the sources' mapped rows, copied file to file, never built (a
    cast: each run's rows read and cast); a column split or GPT-2's transposed QKV is built once for every rank."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from converters.megatron_arch import MegatronArch, padded_vocab
    from converters.megatron_map import megatron_pieces, rules
    from converters.megatron_pieces import RankPieces
    from interop.hashed_writes import Beside, tensor_bytes
    from interop.tensors import raw_bytes

    make(MODELS[kind]()).save_pretrained(tmp_path / "hf")
    ckpt = read_hf(str(tmp_path / "hf"))
    arch = MegatronArch.from_hf(ckpt.config)
    padded = padded_vocab(arch.vocab, tp)
    streamed, built, cut = set(), set(), set()
    with Beside() as beside, ThreadPoolExecutor(1) as ahead:
        for rule in rules(arch, True):
            if not all(n in ckpt.model for n in rule.hf):
                continue
            values = [ckpt.model[n] for n in rule.hf]
            expected = megatron_pieces(rule, [v.load() for v in values], tp, padded)
            for dtype in (torch.float32, torch.bfloat16):
                pieces = RankPieces(tp, padded, threading.Lock()).pieces(rule, values, dtype, None, "model")
                for t, piece in enumerate(pieces):
                    want = expected[t].to(dtype)
                    assert piece.spec.shape == tuple(want.shape) and torch.equal(piece.load(), want), (rule.megatron, t)
                    chunks = as_written(tensor_bytes(piece, beside, ahead))
                    assert b"".join(data for data, _ in chunks) == bytes(raw_bytes(want))
                    # every byte read from a source's file but the vocabulary's padding (zeros here)
                    mapped = any(ok for _, ok in chunks) and all(ok or not any(data) for data, ok in chunks)
                    (streamed if mapped else built).add((rule.megatron, dtype))
                    if piece.parts is not None:
                        cut.add((rule.megatron, dtype))  # made run by run, not built whole
    if kind == "llama":
        layer = "decoder.layers.1"
        for name in (f"{layer}.self_attention.linear_qkv.weight", f"{layer}.mlp.linear_fc1.weight", "embedding.word_embeddings.weight",
                     "output_layer.weight", f"{layer}.self_attention.linear_qkv.layer_norm_weight"):
            assert (name, torch.float32) in streamed, name
        assert (f"{layer}.self_attention.linear_proj.weight", torch.float32) in (built if tp > 1 else streamed)  # a column split
    else:
        assert ("decoder.layers.0.self_attention.linear_qkv.weight", torch.float32) in built  # GPT-2's Conv1D: transposed
    assert not any(dtype == torch.bfloat16 for _, dtype in streamed)  # a cast is read and cast, not copied ...
    if kind == "llama":  # ... run by run, each run's bytes alone, never the whole fused tensor
        assert (f"{layer}.self_attention.linear_qkv.weight", torch.bfloat16) in cut
        assert (f"{layer}.mlp.linear_fc1.weight", torch.bfloat16) in cut


def test_torch_dist_streams_fused_layers_from_the_sources_rows(tmp_path, copied):
    """torch_dist's stacked QKV and fc1 (each layer q, k, v's rows interleaved; gate's then up's) and the padded
    vocabulary are written from the Hugging Face files' rows, copied file to file, never fused in memory: every byte
    of the model's weights (fp32, as the source's) goes through copy_file_range."""
    from converters.megatron_dist import write_megatron_dist

    make(MODELS["llama"]()).save_pretrained(tmp_path / "hf")
    ckpt = read_hf(str(tmp_path / "hf"))
    write_megatron_dist(ckpt, str(tmp_path / "dist"), tp=2)
    assert sum(copied) == sum(t.spec.nbytes for t in ckpt.model.values())  # all of it: only the padding rows are not
    back = read_hf(str(tmp_path / "hf"))
    from converters.megatron_dist import read_megatron_dist

    again = read_megatron_dist(str(tmp_path / "dist"))
    for name, t in back.model.items():
        assert torch.equal(again.model[name].load(), t.load()), name


CUT_SHORT_UNDER_A_READ = """
import os, sys
from converters.megatron import read_megatron

src, cut = sys.argv[1], sys.argv[2]
ckpt = read_megatron(src)
layer = "model.layers.0"
assert ckpt.model[f"{layer}.self_attn.q_proj.weight"].mapped_pieces()  # both TP ranks' files mapped now
os.truncate(cut, 4096)  # then cut short: their mappings would fault past the cut
reads = [("joined", lambda: ckpt.model[f"{layer}.mlp.down_proj.weight"].mapped_pieces()),
         ("loaded", lambda: ckpt.model[f"{layer}.self_attn.o_proj.weight"].load())]
"""


def test_a_rank_file_cut_short_under_a_read_is_named_not_a_crash(tmp_path):
    """A column split's rows (joined without torch) and a tensor merged with torch are read from the rank files,
    not through their mappings: a file cut short after it was mapped is one error naming it, each time. Read from
    the mappings, the process died of SIGBUS (in a child process here: the signal would take the test run with it)."""
    make(llama_config()).save_pretrained(tmp_path / "hf")
    write_megatron(read_hf(str(tmp_path / "hf")), str(tmp_path / "meg"), 2, 2)
    as_megatron_wrote_it(tmp_path / "meg")  # no manifest: the reader's own reads meet the cut, not a digest check
    cut = rank_file(tmp_path / "meg", 1, 0, 2)
    said = reads_in_a_child(CUT_SHORT_UNDER_A_READ, str(tmp_path / "meg"), cut)
    assert [what for what, _ in said] == ["joined", "loaded"], said
    for what, message in said:
        assert message.startswith(f"{cut}: ended ") and "bytes early" in message, (what, message)
