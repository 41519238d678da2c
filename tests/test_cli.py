"""The `interop` CLI: the happy paths, and bad input giving one clear line, a non-zero exit, nothing written."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch

from converters.cli import main
from trainers.base import BaseTrainer, TrainerConfig

from .conftest import ROOT, worker_env


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """A trained checkpoint, its universal conversion and an HF export, made once for the module."""
    root = tmp_path_factory.mktemp("cli")
    trainer = BaseTrainer(TrainerConfig(steps=2, output_dir=str(root / "run"), tied=True))
    trainer.train()
    trainer.save()
    assert main(["convert", str(root / "run"), str(root / "uni"), "--to", "universal", "--max-shard-size", "100KB"]) == 0
    assert main(["convert", str(root / "uni"), str(root / "hf"), "--to", "hf"]) == 0
    return root


def copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def run_cli(capsys, *argv):
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_inspect_shows_format_topology_components_and_tensors(sources, capsys):
    code, out, _ = run_cli(capsys, "inspect", sources / "uni", "--limit", "0")
    assert code == 0
    assert "format:    universal" in out and "step:      2" in out and "world size 1, 1 node(s)" in out
    assert "rng                  PER_RANK    reseed" in out
    assert "model.embed_tokens.weight" in out and "optimizer/exp_avg/model.norm.weight" in out
    assert "tied:      lm_head.weight <- model.embed_tokens.weight" in out
    assert "total:     60 tensors" in out  # 20 weights + 2 x 20 moments: the tied head is one parameter


def test_sharded_universal_verifies_and_diffs_exactly(sources, capsys):
    assert (sources / "uni" / "model" / "model.safetensors.index.json").exists()
    code, out, _ = run_cli(capsys, "verify", sources / "uni", "-q")
    assert code == 0 and "OK (interop-universal" in out
    code, out, _ = run_cli(capsys, "diff", sources / "run", sources / "uni")
    assert code == 0 and "0 different" in out
    code, out, _ = run_cli(capsys, "diff", sources / "uni", sources / "hf", "--model-only")
    assert code == 0 and "20 compared, 20 exact" in out


def test_diff_reports_a_changed_tensor_and_honours_atol(sources, tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    other = copy(sources / "hf", tmp_path / "hf2")
    weights = load_file(str(other / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] + 1e-4
    save_file(weights, str(other / "model.safetensors"), metadata={"format": "pt"})
    code, out, _ = run_cli(capsys, "diff", sources / "hf", other)
    assert code == 1 and "! model.norm.weight: max |a-b| 0.0001" in out
    code, out, _ = run_cli(capsys, "diff", sources / "hf", other, "--atol", "1e-3")
    assert code == 0 and "1 within atol" in out


def test_non_empty_destination_needs_overwrite(sources, tmp_path, capsys):
    dst = tmp_path / "taken"
    dst.mkdir()
    (dst / "keep.txt").write_text("mine")
    code, _, err = run_cli(capsys, "convert", sources / "uni", dst, "--to", "hf")
    assert_one_line_error(code, err, str(dst), "--overwrite")
    assert os.listdir(dst) == ["keep.txt"]
    assert run_cli(capsys, "convert", sources / "uni", dst, "--to", "hf", "--overwrite")[0] == 0
    assert "keep.txt" not in os.listdir(dst) and (dst / "model.safetensors").exists()


def _assert_nothing_written(tmp_path):
    assert not (tmp_path / "out").exists()
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".staging")]


@pytest.mark.parametrize(
    "source,victim,target,needle",
    [
        ("hf", "model.safetensors", "universal", "truncated"),  # no manifest: the safetensors header check
        ("uni", "optimizer/state.json", "hf", "manifest says"),  # universal: the manifest's size check
    ],
    ids=["hf-safetensors", "universal-file"],
)
def test_truncated_file(sources, tmp_path, capsys, source, victim, target, needle):
    src = copy(sources / source, tmp_path / "src")
    f = src / victim
    f.write_bytes(f.read_bytes()[:-100])
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", target)
    assert_one_line_error(code, err, str(f), needle)
    _assert_nothing_written(tmp_path)


def test_flipped_byte_in_tensor_data(sources, tmp_path, capsys):
    src = copy(sources / "uni", tmp_path / "src")
    shard = sorted((src / "model").glob("model-*.safetensors"))[0]
    raw = bytearray(shard.read_bytes())
    raw[-3] ^= 0x01
    shard.write_bytes(bytes(raw))
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and str(shard) in out and "digest differs" in out
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")
    assert_one_line_error(code, err, shard.name, "differ from the digest")
    _assert_nothing_written(tmp_path)


def test_missing_manifest(sources, tmp_path, capsys):
    src = copy(sources / "uni", tmp_path / "src")
    os.remove(src / "manifest.json")
    for argv in (("convert", src, tmp_path / "out", "--to", "hf"), ("inspect", src)):
        code, _, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, str(src), "no manifest.json")
    code, out, _ = run_cli(capsys, "verify", src)
    assert code == 1 and "no manifest.json" in out
    _assert_nothing_written(tmp_path)


def test_manifest_naming_a_missing_file(sources, tmp_path, capsys):
    src = copy(sources / "uni", tmp_path / "src")
    gone = sorted((src / "optimizer").glob("exp_avg_sq*.safetensors"))[0]
    os.remove(gone)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, str(gone), "missing")
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and f"{gone}: listed in the manifest but missing" in out
    _assert_nothing_written(tmp_path)


def test_unknown_directory(tmp_path, capsys):
    (tmp_path / "stuff").mkdir()
    (tmp_path / "stuff" / "notes.txt").write_text("hello")
    code, _, err = run_cli(capsys, "convert", tmp_path / "stuff", tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, str(tmp_path / "stuff"), "not a checkpoint this tool recognises")
    code, _, err = run_cli(capsys, "inspect", tmp_path / "nowhere")
    assert_one_line_error(code, err, "nowhere", "no such file or directory")
    _assert_nothing_written(tmp_path)


class _Exploit:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_pickle_crafted_to_run_code_is_refused_and_never_executed(sources, tmp_path, capsys):
    src = tmp_path / "evil"
    src.mkdir()
    shutil.copy(sources / "hf" / "config.json", src / "config.json")
    marker = tmp_path / "pwned"
    torch.save({"model.norm.weight": torch.zeros(48), "payload": _Exploit(marker)}, src / "pytorch_model.bin")
    for argv in (("convert", src, tmp_path / "out", "--to", "universal"), ("inspect", src)):
        code, _, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, str(src / "pytorch_model.bin"), "--trust-pickle", "posix.system")
    assert not marker.exists(), "the pickle's payload ran"
    _assert_nothing_written(tmp_path)


def test_plain_pickled_weights_load_without_trust(sources, tmp_path, capsys):
    from safetensors.torch import load_file

    src = tmp_path / "bin"
    src.mkdir()
    shutil.copy(sources / "hf" / "config.json", src / "config.json")
    torch.save(load_file(str(sources / "hf" / "model.safetensors")), src / "pytorch_model.bin")
    assert run_cli(capsys, "convert", src, tmp_path / "out", "--to", "hf")[0] == 0
    code, out, _ = run_cli(capsys, "diff", sources / "hf", tmp_path / "out")
    assert code == 0 and "0 different" in out


def test_console_script_help_and_demo(tmp_path):
    """`interop demo` as a new user runs it: ZeRO-2 on 2 processes -> universal (bit-identical to the shards) ->
    FSDP2 and TP2 resumes continuing ZeRO-2's losses -> Hugging Face export that generates."""
    env = worker_env()
    exe = shutil.which("interop") or pytest.fail("console script 'interop' is not installed")
    for cmd in ("inspect", "verify", "convert", "diff", "demo"):
        proc = subprocess.run([exe, cmd, "--help"], capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0 and "usage: interop" in proc.stdout, (cmd, proc.stderr)
    proc = subprocess.run([exe, "demo", "--out", str(tmp_path / "demo")], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "demo OK" in out and "verify: OK" in out
    assert re.search(r"(\d+)/\1 tensors bit-identical to the ZeRO-2 shards \(weights, exp_avg, exp_avg_sq, step\)", out), out
    rows = [line.split() for line in out.splitlines() if re.match(r"\s+[456]\s+\d", line)]
    assert [r[0] for r in rows] == ["4", "5", "6"]
    for _, zero, fsdp, tp in rows:  # the resumed runs continue ZeRO-2's uninterrupted losses
        assert float(fsdp) == pytest.approx(float(zero), rel=1e-5) and float(tp) == pytest.approx(float(zero), rel=1e-5)
    assert "weights equal the TP2 checkpoint's" in out and "generate('The checkpoint ')" in out
    # read from the resumed runs' manifests (2 ranks resumed 2 ranks' streams): nothing records a stream not restored
    assert "RNG streams: each rank's restored as saved (no checkpoint's manifest records otherwise)" in out, out
    manifest = json.loads((tmp_path / "demo" / "universal" / "manifest.json").read_text())
    assert manifest["format"] == "interop-universal" and manifest["step"] == 3


def test_trust_pickle_is_the_explicit_opt_in(tmp_path):
    # (a type no library allowlists for the whole process: importing megatron.core adds argparse.Namespace to
    # torch's safe globals, so a test on Namespace would depend on which tests ran before it)
    import fractions

    from converters.pickle_safety import load_torch_file
    from interop.errors import UnsafePickleError

    path = tmp_path / "args.pt"
    torch.save({"ratio": fractions.Fraction(1, 3), "w": torch.ones(2)}, path)
    with pytest.raises(UnsafePickleError, match=r"it references fractions.Fraction"):
        load_torch_file(str(path))
    loaded = load_torch_file(str(path), trust_pickle=True)
    assert loaded["ratio"] == fractions.Fraction(1, 3) and torch.equal(loaded["w"], torch.ones(2))


def test_committed_checkpoint_without_a_reader_says_so(sources, tmp_path, capsys):
    from interop.commit import write_manifest
    from interop.manifest import read_manifest

    src = copy(sources / "run", tmp_path / "run")
    ckpt = sorted(p for p in src.iterdir() if p.name.startswith("checkpoint-"))[-1]
    manifest = read_manifest(ckpt)
    manifest.sharding["strategy"] = "pipeline_parallel"
    write_manifest(str(ckpt), manifest)
    code, _, err = run_cli(capsys, "inspect", src)
    assert_one_line_error(code, err, str(ckpt), "interop-checkpoint checkpoint of strategy 'pipeline_parallel' has no registered reader")


def test_dtype_is_honoured_or_refused(sources, tmp_path, capsys):
    """`--dtype bfloat16 --to hf` stores bf16 weights (it used to write fp32 silently); a target with no
    precision to set refuses the flag with one line and writes nothing."""
    from safetensors import safe_open

    code, out, err = run_cli(capsys, "convert", sources / "uni", tmp_path / "bf16", "--to", "hf", "--dtype", "bfloat16")
    assert code == 0, err
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"BF16"}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    code, out, _ = run_cli(capsys, "diff", sources / "hf", tmp_path / "bf16")
    assert code == 1 and "dtype float32 vs bfloat16" in out
    code, _, err = run_cli(capsys, "convert", sources / "uni", tmp_path / "u2", "--to", "universal", "--dtype", "bfloat16")
    assert_one_line_error(code, err, "--dtype: universal", "deepspeed")
    assert not (tmp_path / "u2").exists()


def test_diff_reports_one_sided_tensors_apart_and_suggests_model_only(sources, capsys):
    """A checkpoint with optimizer state against a model without: the moments and steps are "only in A", not
    "different", and the report says --model-only compares the weights alone."""
    code, out, _ = run_cli(capsys, "diff", sources / "uni", sources / "hf")
    assert code == 1
    assert "20 compared, 20 exact, 0 within atol, 0 different; 60 only in A, 0 only in B" in out
    assert "hint: B holds no optimizer state; compare the weights alone with --model-only" in out


def test_convert_prints_the_line_that_loads_the_output(sources, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", sources / "uni", tmp_path / "hf2", "--to", "hf")
    assert code == 0, err
    assert f"load it with: transformers.AutoModelForCausalLM.from_pretrained('{tmp_path / 'hf2'}')" in out


def test_config_of_another_model_is_refused_naming_the_tensor(sources, tmp_path, capsys):
    """--config is checked against the checkpoint's tensors: another model's config names the first tensor
    that differs and both shapes, exit 2, nothing written."""
    config = json.loads((sources / "hf" / "config.json").read_text())
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**config, "intermediate_size": config["intermediate_size"] + 8}))
    code, _, err = run_cli(capsys, "convert", sources / "uni", tmp_path / "out", "--to", "hf", "--config", other)
    assert_one_line_error(code, err, "model.layers.0.mlp.gate_proj.weight",
                          f"[{config['intermediate_size']}, {config['hidden_size']}] in the checkpoint",
                          f"[{config['intermediate_size'] + 8}, {config['hidden_size']}] in the --config model")
    assert not (tmp_path / "out").exists()
    code, out, err = run_cli(capsys, "convert", sources / "uni", tmp_path / "same", "--to", "hf", "--config", sources / "hf")
    assert code == 0, err


def test_verify_refuses_what_records_nothing_to_check_against(sources, tmp_path, capsys):
    """A Hugging Face directory (even one interop wrote) has no manifest: verify says so and exits 2, as for any input
    it cannot use; so does a directory that is no checkpoint, or no directory."""
    code, out, err = run_cli(capsys, "verify", sources / "hf")
    assert_one_line_error(code, err, "is a hf checkpoint with no interop manifest.json: nothing records what it should hold")
    assert out == ""
    (tmp_path / "empty").mkdir()
    code, _, err = run_cli(capsys, "verify", tmp_path / "empty")
    assert_one_line_error(code, err, "not a checkpoint this tool recognises")
    code, _, err = run_cli(capsys, "verify", tmp_path / "absent")
    assert_one_line_error(code, err, "no such file or directory")


@pytest.mark.parametrize("flag", ["--world-size", "--tp", "--pp"])
@pytest.mark.parametrize("value", ["0", "-2"])
def test_sizes_below_one_are_refused(sources, tmp_path, capsys, flag, value):
    with pytest.raises(SystemExit) as exc:
        main(["convert", str(sources / "uni"), str(tmp_path / "out"), "--to", "megatron", flag, value])
    _, err = capsys.readouterr()
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"argument {flag}" in err and "a size is at least 1" in err and "(see interop convert --help)" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("target,flags,option,takers", [
    ("hf", ["--tp", "2"], "--tp", "megatron-dist, megatron"),
    ("universal", ["--num-virtual-stages-per-pipeline-rank", "2"], "--num-virtual-stages-per-pipeline-rank", "megatron-dist, megatron"),
    ("accelerate", ["--zero-stage", "3"], "--zero-stage", "deepspeed"),
    ("deepspeed", ["--expert-tensor-parallel-size", "1"], "--expert-tensor-parallel-size", "megatron-dist, megatron"),
    ("megatron-dist", ["--world-size", "4"], "--world-size", "deepspeed, accelerate"),
])
def test_a_layout_flag_the_target_does_not_read_is_refused(sources, tmp_path, capsys, target, flags, option, takers):
    """A flag describing a loading run the target is not written for (it had been ignored, exit 0: a user who
    asked for TP2 got a Hugging Face directory and no word) is one line naming the flag and the targets that read
    it, nothing written."""
    code, _, err = run_cli(capsys, "convert", sources / "uni", tmp_path / "out", "--to", target, *flags)
    assert_one_line_error(code, err, f"{option}: --to {target} has no place for it (it describes the loading run of {takers})")
    assert not (tmp_path / "out").exists()


def test_convert_prints_what_it_wrote_and_the_defaults_it_chose(sources, tmp_path, capsys):
    """The size printed is the output's bytes on disk; layout sizes neither given nor recorded by the source are
    said in a note (and recorded in the output's manifest)."""
    code, out, _ = run_cli(capsys, "convert", sources / "hf", tmp_path / "ds", "--to", "deepspeed")
    assert code == 0
    files = [os.path.join(r, n) for r, _, names in os.walk(tmp_path / "ds") for n in names]
    size = sum(os.path.getsize(f) for f in files)
    line = next(line for line in out.splitlines() if line.startswith("converted "))
    assert f"wrote {size / 1024:.1f} KiB in {len(files)} file(s)" in line, (line, size)
    assert "note: --world-size 1: neither given nor recorded by the source (pass --world-size to choose)" in out
    assert "note: --zero-stage 2: neither given nor recorded by the source (pass --zero-stage to choose)" in out
    code, out, _ = run_cli(capsys, "convert", sources / "hf", tmp_path / "ds3", "--to", "deepspeed", "--world-size", "2",
                           "--zero-stage", "3")
    assert code == 0 and "neither given" not in out


def test_demo_without_its_engines_says_what_to_install(tmp_path, capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else real(name, *a))
    code, out, err = run_cli(capsys, "demo", "--out", tmp_path / "demo")
    assert_one_line_error(code, err, "interop demo: error: needs deepspeed, not installed here: pip install 'interop[demo]'")
    assert not (tmp_path / "demo").exists()


def test_a_clean_run_shows_no_library_warnings(sources, tmp_path, capfd):
    """convert (to DeepSpeed, whose import announces its accelerator on stdout: a fresh process), then diff, inspect
    and verify print their own lines only: no library warning on stderr or stdout (-v lets them through)."""
    def noise(text: str) -> list[str]:
        return [line for line in text.splitlines() if "Warning" in line or "[WARNING]" in line or "Setting accelerator" in line or "warn(" in line]

    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(sources / "uni"), str(tmp_path / "ds"), "--to",
                           "deepspeed", "--world-size", "2", "--zero-stage", "2"], capture_output=True, text=True,
                          env=worker_env(), cwd=ROOT, timeout=300)
    assert done.returncode == 0 and noise(done.stdout + done.stderr) == [], done.stdout + done.stderr
    for argv in (["diff", sources / "uni", tmp_path / "ds"], ["inspect", tmp_path / "ds"], ["verify", tmp_path / "ds", "-q"]):
        assert main([str(a) for a in argv]) == 0, argv
        out, err = capfd.readouterr()
        assert noise(out + err) == [], (argv[0], noise(out + err))
