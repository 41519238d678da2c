"""LoRA adapters out of a real DeepSpeed run: a user's own script wraps a tiny Llama with peft's LoRA (r=4 on
q_proj and v_proj), trains it with ZeRO-2 or ZeRO-3 on 2 gloo processes and saves the engine's checkpoint and peft's
adapter config beside it (tests/peft_worker.py). From the engine's files alone:

- ``--to peft`` writes the adapter directory that ``PeftModel.from_pretrained(base, DST)`` loads, with the trained
  model's outputs;
- ``--to hf --merge-adapters`` writes the base model with the adapters merged, equal to peft's own
  ``merge_and_unload()`` of that adapter, bit for bit;
- plain ``--to hf`` is refused in one line offering both, nothing written (it used to exit 0 with peft's names,
  which from_pretrained initialises at random);
- the adapter config is never guessed: without one beside the checkpoint, or with one of another rank, the
  conversion is refused naming what is missing; ``inspect`` shows rank, alpha and targets."""

from __future__ import annotations

import json
import sys

import pytest
import torch
import transformers

from tests.conftest import ROOT, run_workers, worker_env

pytestmark = pytest.mark.dist

peft = pytest.importorskip("peft")


@pytest.fixture
def cli(capsys):
    """``interop`` in this process (the subprocess's start-up, torch and peft imports, is most of a conversion's time)."""
    from types import SimpleNamespace

    from converters.cli import main

    def run(*args) -> SimpleNamespace:
        capsys.readouterr()
        code = main([str(a) for a in args])
        out = capsys.readouterr()
        return SimpleNamespace(returncode=code, stdout=out.out, stderr=out.err)
    return run


@pytest.fixture(scope="module")
def lora_runs(tmp_path_factory):
    """The base model as save_pretrained writes it, and a LoRA run on it per ZeRO stage (made once per stage)."""
    root = tmp_path_factory.mktemp("lora")
    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(root / "base")
    torch.save((torch.arange(18).reshape(2, 9) * 7) % 96, root / "ids.pt")
    made = {}

    def get(stage: int):
        if stage not in made:
            out = root / f"zero{stage}"
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                   str(ROOT / "tests" / "peft_worker.py"), str(root / "base"), str(out), str(stage)]
            run_workers(cmd, worker_env(), timeout=600)
            made[stage] = out
        return made[stage]
    return root, get


def base_model(root):
    return transformers.AutoModelForCausalLM.from_pretrained(root / "base").eval()


@pytest.mark.parametrize("stage", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_adapters_out_of_a_zero_checkpoint_load_in_peft_with_the_trained_outputs(lora_runs, cli, tmp_path, stage):
    root, run = lora_runs
    src = run(stage)
    done = cli("convert", src, tmp_path / "adapter", "--to", "peft")
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    written = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert (written["r"], written["lora_alpha"], sorted(written["target_modules"])) == (4, 8, ["q_proj", "v_proj"])
    model = peft.PeftModel.from_pretrained(base_model(root), tmp_path / "adapter").eval()
    ids = torch.load(root / "ids.pt")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    torch.testing.assert_close(logits, torch.load(src / "logits.pt"), rtol=0, atol=1e-6)
    # the adapters are the trained ones, not the initial B = 0 (which would give the base model's outputs)
    with torch.no_grad():
        assert (base_model(root)(input_ids=ids).logits - logits).abs().max() > 1e-3


def test_merged_adapters_are_peft_merge_and_unload_exactly(lora_runs, cli, tmp_path):
    root, run = lora_runs
    src = run(3)
    assert cli("convert", src, tmp_path / "adapter", "--to", "peft").returncode == 0
    done = cli("convert", src, tmp_path / "merged", "--to", "hf", "--merge-adapters")
    assert done.returncode == 0, done.stderr
    assert "note: adapters merged by peft's merge_and_unload (LORA 'default': r=4, alpha=8" in done.stdout
    theirs = peft.PeftModel.from_pretrained(base_model(root), tmp_path / "adapter").merge_and_unload().state_dict()
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").state_dict()
    assert {k: bool(torch.equal(t, theirs[k])) for k, t in ours.items()} == {k: True for k in theirs}
    ids = torch.load(root / "ids.pt")
    with torch.no_grad():
        logits = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()(input_ids=ids).logits
    torch.testing.assert_close(logits, torch.load(src / "logits.pt"), rtol=0, atol=1e-5)  # merging rounds once per weight


def test_what_cannot_be_done_is_refused_in_one_line(lora_runs, cli, tmp_path):
    import shutil

    root, run = lora_runs
    src = run(3)
    done = cli("convert", src, tmp_path / "hf", "--to", "hf")
    assert done.returncode == 2 and not (tmp_path / "hf").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        f"interop convert: error: {src} holds peft adapters (LORA 'default': r=4, alpha=8, targets=['q_proj', 'v_proj'], "
        "dropout=0.0, 8 adapter tensors): --to hf would write peft's module names that from_pretrained does not load; use "
        "--to peft (the adapter directory PeftModel.from_pretrained loads) or --to hf --merge-adapters (the base model "
        "with the adapters merged in)")
    report = cli("inspect", src)
    assert "adapters:  LORA 'default': r=4, alpha=8, targets=['q_proj', 'v_proj'], dropout=0.0, 8 adapter tensors" in report.stdout

    bare = tmp_path / "bare"  # the engine's files without peft's adapter_config.json: rank and alpha are not guessed
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("adapter_*"))
    done = cli("convert", bare, tmp_path / "x", "--to", "peft")
    assert done.returncode == 2 and not (tmp_path / "x").exists()
    assert "holds peft adapters (e.g. base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight) but no " \
        "adapter_config.json lies beside it: pass peft's adapter config with --adapter-config" in done.stderr, done.stderr
    assert cli("convert", bare, tmp_path / "x", "--to", "peft", "--adapter-config", src / "adapter_config.json").returncode == 0

    other = tmp_path / "other"  # an adapter config of another rank
    other.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    done = cli("convert", bare, tmp_path / "y", "--to", "peft", "--adapter-config", other)
    assert done.returncode == 2 and not (tmp_path / "y").exists()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight is [4, 32]; peft's model with this " \
        "adapter config has [8, 32]" in done.stderr, done.stderr

    hub = tmp_path / "hub"  # an adapter config naming its base model on the hub (not asked): the base config from --config
    hub.mkdir()
    (hub / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "org/tiny-llama"}))
    done = cli("convert", bare, tmp_path / "w", "--to", "peft", "--adapter-config", hub)
    assert done.returncode == 2 and "the base model's config is unknown (the adapter config names 'org/tiny-llama', not a " \
        "local model directory): pass it with --config" in done.stderr, done.stderr
    assert cli("convert", bare, tmp_path / "w", "--to", "peft", "--adapter-config", hub, "--config", root / "base").returncode == 0

    done = cli("convert", root / "base", tmp_path / "z", "--to", "peft")
    assert done.returncode == 2 and "--to peft: " in done.stderr and "holds no peft adapters" in done.stderr


def test_a_tied_head_is_one_tensor_to_peft_too(tmp_path):
    """A base model with a tied head (Llama with tie_word_embeddings): engines save the embedding once, so peft's
    model's lm_head is the embedding the checkpoint holds; recognised, and merged exactly as peft merges it."""
    from converters.models import adapters
    from interop.logical import LogicalCheckpoint
    from interop.tensors import LazyTensor

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    model.save_pretrained(tmp_path / "run")  # the adapter config beside the engine's files
    held = {k: LazyTensor.of(v.clone()) for k, v in model.state_dict().items() if k != "base_model.model.lm_head.weight"}
    ckpt = LogicalCheckpoint(model=held)
    found = adapters.recognise(ckpt, str(tmp_path / "run"), None)
    assert found.summary() == "LORA 'default': r=4, alpha=8, targets=['q_proj', 'v_proj'], dropout=0.0, 8 adapter tensors"
    merged = adapters.merged(ckpt, found)
    theirs = model.merge_and_unload().state_dict()
    assert {k: bool(torch.equal(merged.model[k].load(), t)) for k, t in theirs.items()} == {k: True for k in theirs}


def test_embedding_adapters_and_modules_to_save_are_exported_as_peft_saves_them(tmp_path):
    """LoRA on the embedding (lora_embedding_A/B, parameters without a trailing '.weight') and a fully trained head
    (modules_to_save): the exported adapter state is peft's own get_peft_model_state_dict of the model, key for key,
    and PeftModel.from_pretrained of the written directory gives the model's logits."""
    from peft.utils import get_peft_model_state_dict

    from converters.models import adapters
    from interop.logical import LogicalCheckpoint
    from interop.tensors import LazyTensor

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "embed_tokens"], modules_to_save=["lm_head"], init_lora_weights=False))
    with torch.no_grad():
        model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)  # the trained head differs from the base's
    model.save_pretrained(tmp_path / "run")
    ckpt = LogicalCheckpoint(model={k: LazyTensor.of(v.clone()) for k, v in model.state_dict().items()})
    found = adapters.recognise(ckpt, str(tmp_path / "run"), None)
    ours, theirs = adapters.adapter_state(ckpt, found), get_peft_model_state_dict(model)
    assert sorted(ours) == sorted(theirs) and any("lora_embedding_A" in k for k in ours) and any("lm_head" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    adapters.write_peft(ckpt, found, str(tmp_path / "out"), overwrite=False)
    ids = (torch.arange(18).reshape(2, 9) * 7) % 96
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=0)
