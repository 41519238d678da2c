"""transformers' own Trainer as the Hugging Face trainer: its losses are the base trainer's, its checkpoints are
Trainer's own files (resumed by Trainer itself, exactly), and they read as the base trainer's state."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from converters.registry import detect, read
from interop.errors import CorruptCheckpointError
from trainers.base import BaseTrainer, TrainerConfig

from . import architectures
from .conftest import held_commit_cmd, native_files, worker_env

SIZES = ["--steps", "4", "--batch-size", "4", "--seq-len", "16"]


def hf_run(*args: str) -> dict:
    result = subprocess.run([sys.executable, "-m", "trainers.hf_trainer", *SIZES, *args], env=worker_env(),
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads([line for line in result.stdout.splitlines() if line.startswith('{"')][-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf")
    base = BaseTrainer(TrainerConfig(steps=4, batch_size=4, seq_len=16, save_every=2, output_dir=str(out / "base")))
    return out, base.train(), hf_run("--save-every", "2", "--output-dir", str(out / "hf"))


def test_trainer_losses_are_the_base_trainers_and_resume_is_exact(runs):
    """Same AdamW groups, schedule, clipping and data order as every other trainer: bit-identical losses.
    Resumed from step 2, Trainer's own resume_from_checkpoint gives steps 3 and 4 exactly."""
    out, base, hf = runs
    assert hf["losses"] == base
    files = {p.name for p in (out / "hf" / "checkpoint-2").iterdir()}  # Trainer's files beside our manifest
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "trainer_state.json"} <= files
    assert detect(str(out / "hf" / "checkpoint-2")).name == "hf-trainer"
    resumed = hf_run("--resume", str(out / "hf" / "checkpoint-2"), "--output-dir", str(out / "resumed"))
    assert resumed["losses"] == base[2:]


def test_async_save_stages_what_trainer_writes(runs, tmp_path):
    """--async-save: the weights, optimizer, scheduler, RNG state and training arguments Trainer hands torch.save and
    safetensors are copied in memory (not on disk when the save returns) and written by those functions only when
    the commit is awaited, after later steps changed the tensors in place: byte for byte a blocking save's files."""
    out, base, _ = runs
    cmd = [sys.executable, *held_commit_cmd(tmp_path / "returned.json", "trainers.hf_trainer", *SIZES, "--save-every", "2",
                                            "--async-save", "--output-dir", str(tmp_path / "staged"))]
    result = subprocess.run(cmd, env=worker_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-4000:]
    assert json.loads([line for line in result.stdout.splitlines() if line.startswith('{"')][-1])["losses"] == base
    returned_with = json.loads((tmp_path / "returned.json").read_text())[0]  # the step-2 save's staging directory
    assert not {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} & set(returned_with), returned_with
    a, b = native_files(out / "hf" / "checkpoint-2"), native_files(tmp_path / "staged" / "checkpoint-2")
    assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth", "training_args.bin"} <= set(a)
    assert sorted(a) == sorted(b) and [n for n in a if a[n] != b[n] and n != "training_args.bin"] == []


def test_checkpoint_reads_as_the_base_trainers_state(runs):
    """optimizer.pt keeps parameters by position; read by name they are the base trainer's AdamW state."""
    out, _, _ = runs
    _, ours = read(str(out / "hf" / "checkpoint-4"))
    _, base = read(str(out / "base" / "checkpoint-4"))
    assert ours.step == base.step == 4
    got, want = dict(ours.tensors()), dict(base.tensors())
    assert set(got) == set(want)
    for key, t in want.items():
        assert torch.equal(got[key].load(), t.load()), key
    assert [g["params"] for g in ours.optimizer.param_groups] == [g["params"] for g in base.optimizer.param_groups]
    assert [g["weight_decay"] for g in ours.optimizer.param_groups] == [0.1, 0.0]


def test_truncated_optimizer_file_is_named(runs, tmp_path):
    import shutil

    out, _, _ = runs
    ckpt = shutil.copytree(out / "hf" / "checkpoint-2", tmp_path / "bare",  # a bare Trainer checkpoint
                           ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    optim = ckpt / "optimizer.pt"
    optim.write_bytes(optim.read_bytes()[:1000])
    with pytest.raises(CorruptCheckpointError, match="optimizer.pt"):
        read(str(ckpt))


# --- optimizer.pt of any architecture: Trainer groups by transformers' rule, not by dimensions ------------------
# GPT-OSS: 1-D attention sinks Trainer decays, 2-D expert biases it does not; T5: a 2-D relative_attention_bias it
# does not decay; Ernie 4.5 MoE: a 2-D e_score_correction_bias built frozen, which from_pretrained makes trainable
TRAINER_ARCHITECTURES = ["gpt_oss", "t5", "ernie4_5_moe"]
SLOW_TRAINER_ARCHITECTURES = ["llava", "deepseek_v3", "bert", "opt"]


def saved_model(root, name: str):
    """``architectures.saved``, and the model's class."""
    import transformers

    _, hf = architectures.saved(root, name)
    return getattr(transformers, architectures.spec(name)[1]), hf


def trainer_on(model, out, steps: int = 1, **optimizer):
    """transformers' own Trainer on ``model`` (weight decay on: its two groups differ), a few rows of data;
    ``optimizer``: Trainer's ``optim`` and ``optim_args`` (AdamW by default)."""
    import transformers

    ids = (torch.arange(8 * 7).reshape(8, 7) * 5) % model.config.get_text_config().vocab_size
    rows = [{"input_ids": r, "labels": r, **({"decoder_input_ids": r} if model.config.is_encoder_decoder else {})} for r in ids]
    args = transformers.TrainingArguments(output_dir=str(out), use_cpu=True, report_to=[], max_steps=steps, per_device_train_batch_size=2,
                                          save_strategy="steps", save_steps=steps, weight_decay=0.1, learning_rate=1e-2, **optimizer)
    return transformers.Trainer(model=model, args=args, train_dataset=rows)


def optimizer_by_module_name(ckpt) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    """A read checkpoint's optimizer groups and exp_avg under the module's names (MoE experts fused as the module holds them)."""
    from converters.models.facts import in_module_names

    module = in_module_names(ckpt)
    return [g["params"] for g in module.optimizer.param_groups], {n: t.load() for n, t in module.optimizer.tensors["exp_avg"].items()}


def trainer_optimizer(trainer) -> tuple[list[list[str]], dict[str, torch.Tensor]]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    groups = [[names[id(p)] for p in g["params"]] for g in trainer.optimizer.param_groups]
    return groups, {names[id(p)]: s["exp_avg"] for p, s in trainer.optimizer.state.items()}


@pytest.mark.parametrize("name", TRAINER_ARCHITECTURES + [pytest.param(n, marks=pytest.mark.slow) for n in SLOW_TRAINER_ARCHITECTURES])
def test_a_transformers_trainer_checkpoint_reads_by_name_for_any_architecture(tmp_path, name):
    """Trainer's checkpoint-N (no manifest: Trainer's files only): optimizer.pt numbers the parameters in the two
    groups transformers' get_decay_parameter_names makes, which for these models are not matrices / the rest; each
    parameter's state reads under its own name, exactly Trainer's."""
    cls, hf = saved_model(tmp_path, name)
    model = cls.from_pretrained(hf)
    trainer = trainer_on(model, tmp_path / "run")
    trainer.train()
    groups, state = trainer_optimizer(trainer)
    _, ckpt = read(str(tmp_path / "run" / "checkpoint-1"))
    got_groups, got = optimizer_by_module_name(ckpt)
    assert got_groups == groups
    assert got.keys() == state.keys() and all(torch.equal(got[n], state[n]) for n in state)


def test_our_trainer_records_the_groups_trainer_made(tmp_path):
    """The Hugging Face trainer on GPT-OSS (--init-from): its manifest names the parameters of Trainer's own two
    groups, so the checkpoint reads by the recorded names exactly as the same files without our manifest read."""
    import shutil

    saved_model(tmp_path, "gpt_oss")
    hf_run("--init-from", str(tmp_path / "gpt_oss" / "hf"), "--steps", "2", "--save-every", "2", "--output-dir", str(tmp_path / "run"))
    ckpt = tmp_path / "run" / "checkpoint-2"
    bare = shutil.copytree(ckpt, tmp_path / "bare", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    (ours_groups, ours), (bare_groups, theirs) = (optimizer_by_module_name(read(str(p))[1]) for p in (ckpt, bare))
    assert ours_groups == bare_groups and [len(g) for g in ours_groups] == [18, 19]
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[n], theirs[n]) for n in ours)


def test_to_hf_trainer_regroups_a_run_as_trainer_resumes_it(tmp_path):
    """A run that decayed every matrix (the base trainer on GPT-OSS) --to hf-trainer: optimizer.pt holds Trainer's
    own groups, so Trainer's resume loads it (with scheduler.pt beside it, it loads optimizer.pt and refuses groups
    of other sizes) and each parameter's state is the run's; a note names the parameters whose weight decay moves.
    A model without optimizer state gets Trainer's groups too, and reads back."""
    import transformers

    from converters import registry
    from interop.manifest import read_manifest

    saved_model(tmp_path, "gpt_oss")
    hf = tmp_path / "gpt_oss" / "hf"
    BaseTrainer(TrainerConfig(steps=2, batch_size=2, seq_len=8, save_every=2, init_from=str(hf), output_dir=str(tmp_path / "base"))).train()
    _, source = read(str(tmp_path / "base" / "checkpoint-2"))
    out = tmp_path / "out"
    registry.writer("hf-trainer").write(source, str(out), registry.Options())
    notes = read_manifest(str(out)).notes
    assert any(n.startswith("optimizer groups: regrouped as transformers' Trainer makes them (18 decay, 19 no decay)")
               and "; weight decay changes for 6 parameter(s): model.layers.0.self_attn.sinks 0.0 -> 0.1, "
               "model.layers.0.mlp.experts.gate_up_proj_bias 0.1 -> 0.0" in n for n in notes), notes
    model = transformers.GptOssForCausalLM.from_pretrained(out)
    trainer = trainer_on(model, tmp_path / "scratch", steps=3)
    trainer.create_optimizer_and_scheduler(num_training_steps=3)
    trainer._load_optimizer_and_scheduler(str(out))  # what train(resume_from_checkpoint=out) runs first
    groups, state = trainer_optimizer(trainer)
    want_groups, want = optimizer_by_module_name(source)
    assert sorted(sum(groups, [])) == sorted(sum(want_groups, [])) and groups != want_groups
    assert state.keys() == want.keys() and all(torch.equal(state[n], want[n]) for n in want)
    trainer_on(transformers.GptOssForCausalLM.from_pretrained(out), tmp_path / "resumed", steps=3).train(resume_from_checkpoint=str(out))

    registry.writer("hf-trainer").write(registry.read(str(hf))[1], str(tmp_path / "fresh"), registry.Options())
    assert [len(g["params"]) for g in registry.read(str(tmp_path / "fresh"))[1].optimizer.param_groups] == [18, 19]


DAMAGED_OPTIMIZER = {  # what is done to optimizer.pt's state dict -> the one line naming the problem
    "a group's ids are not integers": (lambda o: o["param_groups"][0].update(params=5), "param_groups[0].params is an int, not a list of (an int)"),
    "the groups are no list": (lambda o: o.update(param_groups={"a": 1}), "param_groups is a dict, not a list of (a map)"),
    "an id in two groups": (lambda o: o["param_groups"][1].update(params=o["param_groups"][0]["params"][:5]),
                            "parameter id 0 is listed twice in the param groups"),
    "a state entry is no map": (lambda o: o["state"].update({0: 7}), "state[0] is an int, not a map of ("),
}


@pytest.mark.parametrize("damage", list(DAMAGED_OPTIMIZER))
def test_a_damaged_optimizer_state_dict_is_named(runs, tmp_path, damage):
    """A Trainer checkpoint (no manifest: nothing records the names) whose optimizer.pt holds a state dict of the
    wrong shape: one error naming the file and what is wrong, not a TypeError from deep inside the reader."""
    import shutil

    out, _, _ = runs
    ckpt = shutil.copytree(out / "hf" / "checkpoint-2", tmp_path / "bare", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    change, message = DAMAGED_OPTIMIZER[damage]
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    change(state)
    torch.save(state, ckpt / "optimizer.pt")
    with pytest.raises(CorruptCheckpointError, match=re.escape(f"{ckpt / 'optimizer.pt'}: {message}")):
        read(str(ckpt))


# transformers' Trainer's own optimizers (its optim=, optim_args=) -> the class their checkpoint reads as
TRAINER_OPTIMIZERS = {"adafactor": ({}, "transformers.Adafactor"), "sgd": ({"optim_args": "momentum=0.9"}, "SGD")}


def _trainer_state(trainer) -> dict[str, dict]:
    names = {id(p): n for n, p in trainer.model.named_parameters()}
    return {names[id(p)]: s for p, s in trainer.optimizer.state.items()}


def _same_state(got: dict, want: dict) -> bool:
    return got.keys() == want.keys() and all(
        got[n].keys() == want[n].keys() and all(torch.equal(v, want[n][k]) if torch.is_tensor(v) else v == want[n][k] for k, v in got[n].items())
        for n in want)


@pytest.mark.parametrize("optim", sorted(TRAINER_OPTIMIZERS))
def test_a_trainer_checkpoint_of_another_optimizer_converts_and_trainer_resumes_it(tmp_path, capsys, optim):
    """Trainer with its Adafactor or SGD with momentum (no manifest: Trainer's files only). Its optimizer.pt reads
    as that optimizer's, the class told by the keys its groups hold, as torch's and transformers' optimizers put
    them there; through universal and back to hf-trainer, Trainer loads every state entry exactly and resumes.
    Before, Adafactor's row and column variances were refused on reading (not the parameter's shape) and SGD's
    state read as AdamW's, its momentum never held against its parameter. A target that lays state out as the
    parameter refuses the factored state in one line."""
    from .test_adversarial import assert_one_line_error, run_cli

    kwargs, label = TRAINER_OPTIMIZERS[optim]
    cls, hf = saved_model(tmp_path, "llama")
    trainer = trainer_on(cls.from_pretrained(hf), tmp_path / "run", optim=optim, **kwargs)
    trainer.train()
    ckpt = tmp_path / "run" / "checkpoint-1"
    assert read(str(ckpt))[1].optimizer.cls == label
    assert run_cli(capsys, "convert", ckpt, tmp_path / "uni", "--to", "universal")[0] == 0
    assert run_cli(capsys, "convert", tmp_path / "uni", tmp_path / "out", "--to", "hf-trainer")[0] == 0
    again = trainer_on(cls.from_pretrained(tmp_path / "out"), tmp_path / "scratch", steps=3, optim=optim, **kwargs)
    again.create_optimizer_and_scheduler(num_training_steps=3)
    again._load_optimizer_and_scheduler(str(tmp_path / "out"))  # what train(resume_from_checkpoint=out) runs first
    assert _same_state(_trainer_state(again), _trainer_state(trainer))
    trainer_on(cls.from_pretrained(tmp_path / "out"), tmp_path / "resumed", steps=3, optim=optim, **kwargs).train(
        resume_from_checkpoint=str(tmp_path / "out"))
    if optim == "adafactor":
        capsys.readouterr()  # Trainer's progress bars
        code, _, err = run_cli(capsys, "convert", ckpt, tmp_path / "ds", "--to", "deepspeed")
        assert_one_line_error(code, err, "deepspeed lays each parameter's optimizer state out as the parameter; transformers.Adafactor's exp_avg_sq_",
                              words=("not written",))
        assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize(("optim", "key", "hyper", "kept"), [
    ("adamw_torch", "exp_avg", {}, "the parameter is"), ("sgd", "momentum_buffer", {}, "the parameter is"),
    ("adafactor", "exp_avg_sq_row", {}, "transformers.Adafactor keeps [131] for a parameter of"),
    # values the probe step refuses (a review's case: the check was skipped and the cut moment written)
    ("adamw_torch", "exp_avg", {"betas": (0.9, 0.999, 0.0)}, "the parameter is"),
])
def test_a_trainer_checkpoints_state_of_another_shape_is_refused_naming_the_file(tmp_path, capsys, optim, key, hyper, kept):
    """optimizer.pt (no manifest) with one parameter's state cut short: every target that keeps optimizer state
    refuses it in one line naming the file (which shape each state key has is the optimizer's own answer, asked
    with the group's hyperparameters: SGD's momentum, Adafactor's row variance, not only Adam's moments), and the
    model alone still converts. Before, Adafactor's cut row went through and Trainer's resume crashed on it."""
    import shutil

    from .test_adversarial import assert_one_line_error, run_cli

    kwargs = TRAINER_OPTIMIZERS.get(optim, ({}, ""))[0]
    cls, hf = saved_model(tmp_path, "llama")
    trainer_on(cls.from_pretrained(hf), tmp_path / "run", optim=optim, **kwargs).train()
    ckpt = shutil.copytree(tmp_path / "run" / "checkpoint-1", tmp_path / "bare")
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    cut = state["state"][0][key][:3]
    state["state"][0][key] = cut
    for group in state["param_groups"]:
        group.update(hyper)
    torch.save(state, ckpt / "optimizer.pt")
    capsys.readouterr()  # Trainer's progress bars
    for target in ("universal", "accelerate") + (("deepspeed",) if optim != "adafactor" else ()):
        code, _, err = run_cli(capsys, "convert", ckpt, tmp_path / target, "--to", target)
        assert_one_line_error(code, err, f"optimizer state {key} of model.embed_tokens.weight is float32{list(cut.shape)} "
                              f"({ckpt / 'optimizer.pt'}[model.embed_tokens.weight.{key}]), but {kept} float32[131, 36]", words=("not written",))
        assert not (tmp_path / target).exists()
    assert run_cli(capsys, "convert", ckpt, tmp_path / "hf", "--to", "hf")[0] == 0
