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
    done = cli("convert", src, tmp_path / "adapter", "--to", "peft", "--config", root / "base")
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
    assert cli("convert", src, tmp_path / "adapter", "--to", "peft", "--config", root / "base").returncode == 0
    done = cli("convert", src, tmp_path / "merged", "--to", "hf", "--merge-adapters", "--config", root / "base")
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
    done = cli("convert", src, tmp_path / "hf", "--to", "hf", "--config", root / "base")
    assert done.returncode == 2 and not (tmp_path / "hf").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        "interop convert: error: hf has no place for peft adapters (LORA 'default': r=4, alpha=8, targets=['q_proj', "
        "'v_proj'], dropout=0.0, 8 adapter tensors), and its loaders would not take the peft model's names: interop convert "
        "SRC DST --to peft writes the adapters apart, --to hf --merge-adapters the base model with them merged in")
    report = cli("inspect", src, "--config", root / "base")
    assert "adapters:  LORA 'default': r=4, alpha=8, targets=['q_proj', 'v_proj'], dropout=0.0, 8 adapter tensors" in report.stdout

    bare = tmp_path / "bare"  # the engine's files without peft's adapter_config.json: rank and alpha are not guessed
    shutil.copytree(src, bare, ignore=shutil.ignore_patterns("adapter_*"))
    done = cli("convert", bare, tmp_path / "x", "--to", "peft", "--config", root / "base")
    assert done.returncode == 2 and not (tmp_path / "x").exists()
    assert "holds peft adapters (e.g. base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight) but no " \
        "adapter_config.json lies beside it: pass peft's adapter config with --adapter-config" in done.stderr, done.stderr
    assert cli("convert", bare, tmp_path / "x", "--to", "peft", "--adapter-config", src / "adapter_config.json", "--config", root / "base").returncode == 0

    other = tmp_path / "other"  # an adapter config of another rank
    other.mkdir()
    config = json.loads((src / "adapter_config.json").read_text())
    (other / "adapter_config.json").write_text(json.dumps({**config, "r": 8}))
    done = cli("convert", bare, tmp_path / "y", "--to", "peft", "--adapter-config", other, "--config", root / "base")
    assert done.returncode == 2 and not (tmp_path / "y").exists()
    assert "base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight is [4, 32]; peft's model with this " \
        "adapter config has [8, 32]" in done.stderr, done.stderr

    # the adapter config names its base model by a path outside the checkpoint (peft's save_pretrained records it):
    # not followed (a checkpoint's paths stay inside it), the message says which --config to pass
    done = cli("convert", src, tmp_path / "w", "--to", "peft")
    assert done.returncode == 2 and not (tmp_path / "w").exists()
    assert done.stderr.strip().splitlines()[-1] == (
        f"interop convert: error: the base model's config is unknown (the adapter config names '{root / 'base'}'; paths a "
        f"checkpoint names outside itself are not followed): pass it with --config {root / 'base'} (the base model's "
        "directory or its config.json)")

    done = cli("convert", root / "base", tmp_path / "z", "--to", "peft")
    assert done.returncode == 2 and "--to peft: " in done.stderr and "holds no peft adapters" in done.stderr


def test_a_tied_head_is_one_tensor_to_peft_too(tmp_path):
    """A base model with a tied head (Llama with tie_word_embeddings): engines save the embedding once, so peft's
    model's lm_head is the embedding the checkpoint holds; recognised, and merged exactly as peft merges it."""
    from converters.models import adapters, facts
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
    ckpt = adapters.read_as_adapter(LogicalCheckpoint(model=held, config=config.to_dict()), str(tmp_path / "run"), None)
    assert adapters.summary(ckpt.adapter) == "LORA 'default': r=4, alpha=8, targets=['q_proj', 'v_proj'], dropout=0.0, 8 adapter tensors"
    assert ckpt.tied == [["lm_head.weight", "model.embed_tokens.weight"]] and "lm_head.weight" not in ckpt.model
    merged = adapters.merged(ckpt)
    theirs = model.merge_and_unload().state_dict()
    assert {k: bool(torch.equal(merged.model[k].load(), t)) for k, t in theirs.items()} == {k: True for k in theirs}

    # LoRA on the tied head itself: its base_layer is the embedding's tensor, still named lm_head (peft's module says
    # so), and the engines' names come back whole
    on_head = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "lm_head"], init_lora_weights=False))
    on_head.save_pretrained(tmp_path / "head")
    state = {k: LazyTensor.of(v.clone()) for k, v in on_head.state_dict().items()}
    ckpt = adapters.read_as_adapter(LogicalCheckpoint(model=dict(state), config=config.to_dict()), str(tmp_path / "head"), None)
    assert "lm_head.weight" in ckpt.model and "model.embed_tokens.weight" in ckpt.model
    assert sorted(adapters.in_peft_names(facts.in_module_names(ckpt)).model) == sorted(state)
    theirs = on_head.merge_and_unload().state_dict()
    merged = adapters.merged(ckpt)
    assert {k: bool(torch.equal(merged.model[k].load(), t)) for k, t in theirs.items() if k in merged.model} == \
        {k: True for k in theirs if k in merged.model}


def test_a_run_that_trained_base_tensors_beside_its_adapters_is_refused(tmp_path):
    """peft's model keeps the base frozen; a run that also trained a base tensor (its optimizer holds it) would lose
    that state if written as peft's model: refused naming the tensor."""
    from converters.models import adapters
    from interop.errors import ConversionError
    from interop.logical import LogicalCheckpoint, OptimizerState
    from interop.tensors import LazyTensor

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    model = peft.get_peft_model(transformers.LlamaForCausalLM(config), peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    model.save_pretrained(tmp_path / "run")
    state = {k: LazyTensor.of(v.clone()) for k, v in model.state_dict().items()}
    trained = [n for n, p in model.named_parameters() if p.requires_grad] + ["base_model.model.model.norm.weight"]
    optimizer = OptimizerState("AdamW", [{"params": trained, "lr": 1e-3}], {"exp_avg": {n: state[n] for n in trained}})
    with pytest.raises(ConversionError, match=r"the run trained 'model.norm.weight' \(1 base tensors in all\), which this "
                       "adapter config's peft model keeps frozen"):
        adapters.read_as_adapter(LogicalCheckpoint(model=state, config=config.to_dict(), optimizer=optimizer), str(tmp_path / "run"), None)


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
    ckpt = LogicalCheckpoint(model={k: LazyTensor.of(v.clone()) for k, v in model.state_dict().items()}, config=config.to_dict())
    ckpt = adapters.read_as_adapter(ckpt, str(tmp_path / "run"), None)
    ours, theirs = adapters.adapter_state(ckpt), get_peft_model_state_dict(model)
    assert sorted(ours) == sorted(theirs) and any("lora_embedding_A" in k for k in ours) and any("lm_head" in k for k in ours)
    assert all(torch.equal(ours[k], theirs[k]) for k in theirs)
    adapters.write_peft(ckpt, str(tmp_path / "out"), overwrite=False)
    ids = (torch.arange(18).reshape(2, 9) * 7) % 96
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), tmp_path / "out")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=0)


def test_universal_holds_the_frozen_base_model_and_peft_adapter_directory(lora_runs, cli, tmp_path):
    """A LoRA run in universal: ``model/`` is the base model (from_pretrained loads it; the frozen base bit for bit),
    ``adapter/`` is peft's adapter directory (PeftModel.from_pretrained on it gives the trained logits), the manifest
    says which tensors are frozen and the adapters' Adam moments are kept; back into DeepSpeed and universal again,
    nothing changed."""
    root, run = lora_runs
    src = run(3)
    u = tmp_path / "u"
    assert cli("convert", src, u, "--to", "universal", "--config", root / "base").returncode == 0
    assert sorted(p.name for p in (u / "adapter").iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    base = transformers.AutoModelForCausalLM.from_pretrained(u / "model").eval()
    assert {k: bool(torch.equal(t, base_model(root).state_dict()[k])) for k, t in base.state_dict().items()} == \
        {k: True for k in base.state_dict()}
    base_names = sorted(base.state_dict())
    model = peft.PeftModel.from_pretrained(base, u / "adapter").eval()  # wraps base's modules in place
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=torch.load(root / "ids.pt")).logits, torch.load(src / "logits.pt"), rtol=0, atol=1e-6)
    manifest = json.loads((u / "manifest.json").read_text())
    adapter_keys = sorted(json.loads((u / "manifest.json").read_text())["tensors"])
    held = [k for k in adapter_keys if ".lora_" in k and not k.startswith("optimizer/")]
    assert len(held) == 8 and all(k.startswith("base_model.model.") and ".default." not in k for k in held)
    assert sorted(manifest["model"]["frozen"]) == base_names and manifest["model"]["adapter"]["name"] == "default"
    assert sorted(k.split("/", 2)[2] for k in adapter_keys if k.startswith("optimizer/exp_avg/")) == held
    report = cli("inspect", u)
    assert "adapters:  LORA 'default': r=4, alpha=8, targets=['q_proj', 'v_proj'], dropout=0.0, 8 adapter tensors" in report.stdout

    for target in (["deepspeed", "--world-size", "2", "--zero-stage", "2"], ["dcp"]):
        there, back = tmp_path / target[0], tmp_path / f"{target[0]}-back"
        assert cli("convert", u, there, "--to", *target).returncode == 0
        assert cli("convert", there, back, "--to", "universal").returncode == 0
        same = cli("diff", u, back)
        assert same.returncode == 0 and "0 different; 0 only in A, 0 only in B" in same.stdout, (target, same.stdout)
    done = cli("convert", u, tmp_path / "mcore", "--to", "megatron")
    assert done.returncode == 2 and not (tmp_path / "mcore").exists()
    assert "megatron has no place for peft adapters (LORA 'default': r=4" in done.stderr, done.stderr


def test_a_base_model_and_a_peft_adapter_directory_continue_fine_tuning_in_deepspeed(cli, tmp_path):
    """Import: a Hugging Face base model and a peft adapter directory made for it (``--adapter``) -> universal -> a
    ZeRO-3 LoRA run on 2 processes, which resumes from it: its first loss is the loss of peft's own
    PeftModel.from_pretrained(base, adapter) on that batch, it trains the adapters only (the base it saves is the
    base model bit for bit) and its adapters are exported again. An adapter of another rank is refused naming the tensor."""
    from tests.resume_matrix import LORA_SOURCES, train
    from trainers.base import tiny_config
    from trainers.state import DataPosition, TokenDataset

    torch.manual_seed(5)
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "base")
    lora = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0, init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    batch = DataPosition(seed=1234).next_batch(TokenDataset(16), 4)
    with torch.no_grad():
        expected = float(lora.eval()(input_ids=batch, labels=batch).loss)

    u = tmp_path / "u"
    done = cli("convert", tmp_path / "base", u, "--to", "universal", "--adapter", tmp_path / "adapter")
    assert done.returncode == 0, done.stderr
    losses = train(LORA_SOURCES["ds-z3@lora"], tmp_path / "run", "--resume", str(u), "--stop-at", "2")
    assert len(losses) == 2 and abs(losses[0] - expected) / expected < 1e-5, (losses, expected)

    out = tmp_path / "out"
    assert cli("convert", tmp_path / "run" / "checkpoint-2", out, "--to", "universal").returncode == 0
    saved = transformers.AutoModelForCausalLM.from_pretrained(out / "model").state_dict()
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base").state_dict()
    assert {k: bool(torch.equal(t, base[k])) for k, t in saved.items()} == {k: True for k in base}
    from safetensors.torch import load_file

    before, after = load_file(tmp_path / "adapter" / "adapter_model.safetensors"), load_file(out / "adapter" / "adapter_model.safetensors")
    assert sorted(before) == sorted(after) and all(not torch.equal(before[k], after[k]) for k in before)

    other = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                peft.LoraConfig(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    other.save_pretrained(tmp_path / "r8")
    (tmp_path / "r8" / "adapter_config.json").write_text((tmp_path / "adapter" / "adapter_config.json").read_text())
    done = cli("convert", tmp_path / "base", tmp_path / "x", "--to", "universal", "--adapter", tmp_path / "r8")
    assert done.returncode == 2 and not (tmp_path / "x").exists()
    assert "adapter_model.safetensors: base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight is [8, 48]; peft's " \
        "model with this adapter config has [4, 48]" in done.stderr, done.stderr


def test_dora_magnitudes_travel_with_their_adapter(tmp_path):
    """DoRA (use_dora: a learned magnitude per output row, lora_magnitude_vector) read from a peft model's state dict as
    engines save it, written as universal: model/ + adapter/ load with PeftModel.from_pretrained to the model's
    logits exactly, and --to peft holds the magnitudes under peft's own keys."""
    from peft.utils import get_peft_model_state_dict

    from converters.cli import main
    from converters.models import adapters
    from interop.logical import LogicalCheckpoint
    from interop.tensors import LazyTensor
    from interop.universal import write_universal

    config = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"), peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], use_dora=True, init_lora_weights=False))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_magnitude_vector" in name:
                p.mul_(1.25)  # trained magnitudes differ from the weight norms they start at
    model.save_pretrained(tmp_path / "run")
    ckpt = LogicalCheckpoint(model={k: LazyTensor.of(v.clone()) for k, v in model.state_dict().items()}, config=config.to_dict())
    ckpt = adapters.read_as_adapter(ckpt, str(tmp_path / "run"), None)
    assert sum("lora_magnitude_vector" in k for k in ckpt.adapter.tensors) == 4
    write_universal(ckpt, str(tmp_path / "u"))
    ids = (torch.arange(18).reshape(2, 9) * 7) % 96
    loaded = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "u" / "model"), tmp_path / "u" / "adapter")
    with torch.no_grad():
        torch.testing.assert_close(loaded.eval()(input_ids=ids).logits, model.eval()(input_ids=ids).logits, rtol=0, atol=0)
    assert main(["convert", str(tmp_path / "u"), str(tmp_path / "p"), "--to", "peft"]) == 0
    from safetensors.torch import load_file

    ours, theirs = load_file(tmp_path / "p" / "adapter_model.safetensors"), get_peft_model_state_dict(model)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_a_trainer_checkpoint_of_a_lora_run_is_read_with_its_base_model(tmp_path, cli):
    """transformers' Trainer on a peft model saves the adapter only (Trainer.save_model -> adapter_config.json,
    adapter_model.safetensors) beside optimizer.pt, which numbers the trainable parameters. Read with --base-model:
    the adapters are the saved ones, each Adam moment is the Trainer's own for that adapter tensor (matched by the
    live optimizer's parameter objects), the base is frozen; without --base-model, one line says what to pass."""
    from safetensors.torch import load_file

    from trainers.base import tiny_config

    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
    rows = [{"input_ids": (torch.arange(16) * (i + 3)) % 256, "labels": (torch.arange(16) * (i + 3)) % 256} for i in range(8)]
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=2, per_device_train_batch_size=4,
                                          save_steps=2, save_strategy="steps", logging_strategy="no", report_to=[],
                                          use_cpu=True, learning_rate=1e-2, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-2"
    assert not (ckpt / "model.safetensors").exists() and (ckpt / "adapter_model.safetensors").exists()

    done = cli("inspect", ckpt)
    assert done.returncode == 2 and "holds the adapter only (adapter_config.json, adapter_model.safetensors); pass the " \
        "base model it trained with --base-model DIR" in done.stderr, done.stderr
    u = tmp_path / "u"
    done = cli("convert", ckpt, u, "--to", "universal", "--base-model", tmp_path / "base")
    assert done.returncode == 0, done.stderr
    saved, ours = load_file(ckpt / "adapter_model.safetensors"), load_file(u / "adapter" / "adapter_model.safetensors")
    assert sorted(saved) == sorted(ours) and all(torch.equal(saved[k], ours[k]) for k in saved)
    moments = load_file(u / "optimizer" / "exp_avg.safetensors")
    names = {p: n for n, p in model.named_parameters()}
    live = {names[p]: s["exp_avg"] for p, s in trainer.optimizer.state.items()}
    assert len(live) == 8 and sorted(moments) == sorted(saved)
    for key, moment in moments.items():  # base_model.model.X.lora_A.weight is the module's X.lora_A.default.weight
        module_name = key.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")
        assert torch.equal(moment, live[module_name]), key
    manifest = json.loads((u / "manifest.json").read_text())
    assert len(manifest["model"]["frozen"]) == 21 and manifest["step"] == 2


def test_transformers_trainer_resumes_a_lora_run_from_our_trainer_checkpoint(tmp_path, cli):
    """The engine's own loader as the judge: transformers' Trainer saved a LoRA run at step 2 (the adapter and
    optimizer.pt only); through universal (with --base-model) and back --to hf-trainer, a plain Trainer on a fresh
    peft model resumes from our directory (Trainer._load_from_checkpoint, its optimizer, scheduler and RNG loads)
    and its steps 3 and 4 are the uninterrupted run's."""
    from trainers.base import tiny_config

    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(tiny_config("llama")).save_pretrained(tmp_path / "base")
    rows = [{"input_ids": (torch.arange(16) * (i + 3)) % 256, "labels": (torch.arange(16) * (i + 3)) % 256} for i in range(16)]

    def run(out, resume=None) -> list[float]:
        torch.manual_seed(11)  # a fresh adapter: the resumed run's must come from the checkpoint
        model = peft.get_peft_model(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                    peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0))
        args = transformers.TrainingArguments(output_dir=str(out), max_steps=4, per_device_train_batch_size=4, save_steps=2,
                                              logging_steps=1, report_to=[], use_cpu=True, learning_rate=1e-2,
                                              disable_tqdm=True, seed=5)
        losses = []

        class Recorded(transformers.Trainer):  # each step's loss (the log's cadence is the checkpoint's on resume)
            def training_step(self, *a, **k):
                losses.append(float(super().training_step(*a, **k)))
                return torch.tensor(losses[-1])

        Recorded(model=model, args=args, train_dataset=rows).train(resume_from_checkpoint=str(resume) if resume else None)
        return losses

    full = run(tmp_path / "full")
    assert cli("convert", tmp_path / "full" / "checkpoint-2", tmp_path / "u", "--to", "universal",
               "--base-model", tmp_path / "base").returncode == 0
    assert cli("convert", tmp_path / "u", tmp_path / "ours", "--to", "hf-trainer").returncode == 0
    resumed = run(tmp_path / "resumed", tmp_path / "ours")
    assert len(full) == 4 and len(resumed) == 2
    assert resumed == pytest.approx(full[2:], rel=1e-6), (resumed, full)
    # the Trainer's own trainer_state.json travelled with it (its log and cadence), at the step it was saved
    theirs, ours = (json.loads((d / "trainer_state.json").read_text()) for d in (tmp_path / "full" / "checkpoint-2", tmp_path / "ours"))
    assert ours["log_history"] == theirs["log_history"] and len(ours["log_history"]) == 2
    assert (ours["logging_steps"], ours["save_steps"], ours["global_step"]) == (1, 2, 2)


def test_a_lora_run_resumes_only_with_its_own_adapter_config(tmp_path):
    """The single-process trainer with --lora-rank: its resume is bit-exact; resumed with another --lora-alpha (same
    names and shapes, every update at another scale) or without --lora-rank, it refuses in one line before loading
    anything, naming the flag and both values."""
    from interop.errors import InteropError
    from trainers.base import BaseTrainer, TrainerConfig

    cfg = dict(steps=4, lora_rank=4, lora_alpha=8.0, batch_size=2, seq_len=16)
    full = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "full"), **cfg)).train()
    first = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "split"), **cfg))
    head = first.train(until=2)
    first.save()
    second = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "split"), **cfg))
    assert second.resume() == 2 and head + second.train() == full
    assert len(full) == 4 and full[0] != full[-1]

    saved = str(tmp_path / "split" / "checkpoint-2")
    other = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "other"), **{**cfg, "lora_alpha": 16.0}))
    with pytest.raises(InteropError, match=f"{saved} trains another adapter than this run: --lora-alpha: the "
                       "checkpoint's 8.0, this run's 16.0"):
        other.resume(saved)
    full_tune = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "plain"), steps=4, batch_size=2, seq_len=16))
    with pytest.raises(InteropError, match="trains peft adapters \\(LORA 'default': r=4, alpha=8.0, targets=\\['q_proj', "
                       "'v_proj'\\].*resume it with the same --lora-rank, --lora-alpha and --lora-targets"):
        full_tune.resume(saved)


def test_a_universal_adapter_section_is_checked_before_use(tmp_path, cli):
    """Universal's adapter/ is read only as its manifest records it: a manifest whose adapter config is not a file
    of the checkpoint, or a checkpoint missing adapter_model.safetensors, is refused naming the file."""
    import shutil

    from interop.commit import write_manifest
    from interop.manifest import read_manifest
    from trainers.base import BaseTrainer, TrainerConfig

    trainer = BaseTrainer(TrainerConfig(output_dir=str(tmp_path / "run"), steps=1, lora_rank=4, batch_size=2, seq_len=16))
    trainer.train()
    trainer.save()
    u = tmp_path / "u"
    assert cli("convert", tmp_path / "run" / "checkpoint-1", u, "--to", "universal").returncode == 0
    assert cli("verify", u).returncode == 0

    inline = tmp_path / "inline"
    shutil.copytree(u, inline)
    manifest = read_manifest(str(inline))
    manifest.model["adapter"]["config"] = {"peft_type": "LORA", "r": 64}
    write_manifest(str(inline), manifest)
    done = cli("convert", inline, tmp_path / "x", "--to", "peft")
    assert done.returncode == 2 and not (tmp_path / "x").exists()
    assert f"{inline / 'manifest.json'}: model.adapter.config must name the adapter's adapter/adapter_config.json file" in done.stderr

    gone = tmp_path / "gone"
    shutil.copytree(u, gone)
    (gone / "adapter" / "adapter_model.safetensors").unlink()
    done = cli("convert", gone, tmp_path / "y", "--to", "peft")
    assert done.returncode != 0 and not (tmp_path / "y").exists()
    assert "adapter/adapter_model.safetensors" in done.stderr, done.stderr
