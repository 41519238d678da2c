"""A conversion's start-up: the source's digests are computed beside the import of torch (which takes a core
for a second), never trusted early: a file changed after its early digest is hashed again, and a corrupted
source is refused exactly as before."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from interop import digests
from tests.architectures import ROOT, saved


def test_an_early_digest_is_used_only_for_the_file_it_was_taken_of(tmp_path, monkeypatch):
    """An early digest is taken (no second hash) for a file unchanged since; a file rewritten at the same size with
    its times put back (its change time moves regardless), replaced, or changed too recently for its times to
    show a later change is hashed again."""
    names = ("same", "rewritten", "replaced", "recent")
    paths = {n: tmp_path / f"{n}.bin" for n in names}
    old = 1_600_000_000
    for n, p in paths.items():
        p.write_bytes(os.urandom(1 << 20))
        if n != "recent":
            os.utime(p, (old, old))
    expected_same = digests._of_file(str(paths["same"]), digests.ALGO)
    # (utime moves each file's change time to now: the files are "recent" unless the window is shut)
    for names_, window in ((("same", "rewritten", "replaced"), 0.0), (("recent",), 3600.0)):
        monkeypatch.setattr(digests, "RACY_SECONDS", window)
        digests.hash_ahead([(str(paths[n]), digests.ALGO) for n in names_], threads=1)
        for n in names_:
            digests._AHEAD[str(paths[n])][1].exception(timeout=60)  # done, whatever its outcome
    paths["rewritten"].write_bytes(b"x" * (1 << 20))
    os.utime(paths["rewritten"], (old, old))
    paths["replaced"].unlink()
    paths["replaced"].write_bytes(b"y")
    hashed_again = []
    real = digests._of_file
    monkeypatch.setattr(digests, "_of_file", lambda path, algo: hashed_again.append(os.path.basename(path)) or real(path, algo))
    assert digests.of_file(str(paths["same"])) == expected_same
    assert digests.of_file(str(paths["rewritten"])) == digests.of_bytes(b"x" * (1 << 20))
    assert digests.of_file(str(paths["replaced"])) == digests.of_bytes(b"y")
    assert digests.of_file(str(paths["recent"])) == real(str(paths["recent"]), digests.ALGO)
    assert hashed_again == ["rewritten.bin", "replaced.bin", "recent.bin"]  # not same.bin: its early digest was taken
    assert not digests._AHEAD  # each taken once


def test_the_source_is_digested_before_torch_is_imported_and_a_flip_is_still_refused(tmp_path):
    _, src = saved(tmp_path, "llama")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    uni = tmp_path / "uni"
    subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(uni), "--to", "universal"],
                   env=env, check=True, capture_output=True, timeout=300)
    probe = ("import sys, json; from converters.console import check_ahead; check_ahead(sys.argv[1:]); "
             "from interop import digests; print(json.dumps([sorted(digests._AHEAD), 'torch' in sys.modules]))")
    done = subprocess.run([sys.executable, "-c", probe, "convert", str(uni), str(tmp_path / "out"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=120, check=True)
    started, torch_imported = json.loads(done.stdout.strip().splitlines()[-1])
    manifest = json.loads((uni / "manifest.json").read_text())
    plain = sorted(str(uni / rel) for rel, rec in manifest["files"].items() if ":" in rec["digest"]
                   and not rec["digest"].split(":")[0].endswith("-st"))
    assert started == plain and plain and not torch_imported
    config = uni / "model" / "config.json"
    text = config.read_text()
    config.write_text(text.replace('"vocab_size": 131', '"vocab_size": 132'))  # one byte, still a valid config
    done = subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(uni), str(tmp_path / "out"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1] == (f"interop convert: error: {config}: content digest differs from the manifest "
                                                    "(the file was altered or corrupted)")
    assert not (tmp_path / "out").exists()


# `import torch` fails, and `import numpy` (a tenth of a second: nothing that moves bytes needs it either)
NO_TORCH = "import sys; sys.modules['torch'] = sys.modules['numpy'] = None; from converters.console import run; run()"


def test_a_conversion_that_moves_bytes_never_imports_torch(tmp_path):
    """Safetensors to safetensors (HF -> universal -> HF, of a tied model: the tie is checked on the bytes) copies
    each tensor's bytes as they lie and never needs torch (a second and more of every such conversion): run with
    torch made unimportable, each writes what the ordinary run writes, byte for byte, and transformers loads it."""
    import torch
    import transformers

    env = dict(os.environ, PYTHONPATH=str(ROOT))
    for name in ("llama-tied",):
        model, src = saved(tmp_path, name)
        ordinary, uni, out = tmp_path / name / "ordinary", tmp_path / name / "uni", tmp_path / name / "out"
        # the first conversion of a model asks transformers about it (torch and all), and keeps the answers
        subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(ordinary), "--to", "universal"],
                       env=env, check=True, capture_output=True, timeout=300)
        for cmd in (["convert", str(src), str(uni), "--to", "universal"], ["verify", str(uni)],
                    ["convert", str(uni), str(out), "--to", "hf"]):
            done = subprocess.run([sys.executable, "-c", NO_TORCH, *cmd], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, (cmd, done.stderr)
        for rel in sorted(p.relative_to(ordinary) for p in ordinary.rglob("*.safetensors")):
            assert (uni / rel).read_bytes() == (ordinary / rel).read_bytes(), rel
        records = [json.loads((d / "manifest.json").read_text())["tensors"] for d in (ordinary, uni)]
        assert records[0] == records[1]
        loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
        assert loaded.state_dict().keys() == model.state_dict().keys()
        assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items()), name


def test_a_universal_checkpoint_with_optimizer_state_goes_to_hf_without_torch(tmp_path):
    """A training run's universal checkpoint (AdamW's moments and its 0-dim step in state.json) to a Hugging Face
    directory moves the model's bytes only: its optimizer state is checked as it is read (a step that is not a
    number is still refused), without torch."""
    import dataclasses

    import torch
    import transformers

    from converters import registry
    from interop.logical import OptimizerState
    from interop.tensors import LazyTensor
    from interop.universal import write_universal

    model, src = saved(tmp_path, "llama")
    _, ckpt = registry.read(str(src))
    names = list(ckpt.model)
    moments = {n: LazyTensor.of(torch.full(t.spec.shape, 0.5)) for n, t in ckpt.model.items()}
    steps = {n: {"value": 3.0, "dtype": "float32"} for n in names}
    ckpt = dataclasses.replace(ckpt, optimizer=OptimizerState("AdamW", [{"params": names, "lr": 1e-3}], {"exp_avg": moments}, {"step": steps}))
    uni = tmp_path / "uni"
    write_universal(ckpt, str(uni))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", NO_TORCH, "convert", str(uni), str(tmp_path / "out"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in model.state_dict().items())
    state = uni / "optimizer" / "state.json"
    text = state.read_text()
    assert '"value": 3.0' in text
    state.write_text(text.replace('"value": 3.0', '"value": "3"', 1))
    from tests.conftest import reseal

    reseal(uni, "optimizer/state.json")  # its digest agrees: the reader's own check has to refuse it
    done = subprocess.run([sys.executable, "-c", NO_TORCH, "convert", str(uni), str(tmp_path / "out2"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and not (tmp_path / "out2").exists()
    assert done.stderr.strip().splitlines()[-1] == (f"interop convert: error: {state}: not a valid optimizer state: "
                                                    "scalar value '3' is not a number")


def test_an_interrupt_during_torchs_import_arrives_once_torch_is_imported():
    """The console script holds Ctrl-C while torch is imported wherever a conversion first needs it (torch's C
    initialisation swallows an interrupt raised inside it or aborts on it), then delivers it: the KeyboardInterrupt
    comes after the import, with torch whole in sys.modules."""
    probe = """
import os, signal, sys, threading, time
from converters.console import hold_interrupts_in_torch_import
hold_interrupts_in_torch_import()
during = []  # whether torch was being imported when the signal was sent

def interrupt():
    during.append(getattr(getattr(sys.modules.get("torch"), "__spec__", None), "_initializing", False))
    os.kill(os.getpid(), signal.SIGINT)

threading.Timer(0.2, interrupt).start()
try:
    import torch
    time.sleep(10)
    print("not interrupted")
except KeyboardInterrupt:
    print("interrupted", during == [True], "torch" in sys.modules, float(sys.modules["torch"].ones(2).sum()))
"""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert done.stdout.split() == ["interrupted", "True", "True", "2.0"]


def test_a_conversion_lets_openmp_threads_sleep_unless_told_otherwise(tmp_path):
    """A conversion command sets OpenMP's wait policy to PASSIVE before torch loads (its idle threads spun on the
    cores the readers, hashers and writers need), and leaves a user's own setting alone."""
    probe = ("import os; from converters import cli; cli.main(['verify', os.devnull + '.missing']); import torch; "
             "print(os.environ.get('OMP_WAIT_POLICY'))")
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", probe], env=env, cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["PASSIVE"]
    out = subprocess.run([sys.executable, "-c", probe], env={**env, "OMP_WAIT_POLICY": "ACTIVE"}, cwd=ROOT,
                         capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["ACTIVE"]


def test_installed_versions_are_importlib_metadatas(tmp_path, monkeypatch):
    """The versions read beside each package (a manifest's producer versions, the key of transformers' kept
    answers) are the ones importlib.metadata gives; where the dist-info beside a package is not plain (two of
    them) it is importlib.metadata that answers; a package that is not installed has none."""
    import importlib
    from importlib.metadata import version as metadata_version

    from interop.installed import _beside_package, version

    for name in ("torch", "transformers", "deepspeed", "accelerate", "safetensors", "tqdm"):
        assert _beside_package(name) == metadata_version(name), name  # read beside it, not by the fallback
    assert version("blake3") == metadata_version("blake3")  # a one-file extension module: the fallback's
    site = tmp_path / "site"
    (site / "fakepkg_interop").mkdir(parents=True)
    (site / "fakepkg_interop" / "__init__.py").write_text("")
    for v in ("1.0", "2.0"):
        info = site / f"fakepkg_interop-{v}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: fakepkg_interop\nVersion: {v}\n\nVersion: 9\n")
    monkeypatch.syspath_prepend(str(site))
    importlib.invalidate_caches()
    assert _beside_package("fakepkg_interop") is None
    assert version("fakepkg_interop") == metadata_version("fakepkg_interop")
    import shutil

    shutil.rmtree(site / "fakepkg_interop-2.0.dist-info")
    importlib.invalidate_caches()
    assert _beside_package("fakepkg_interop") == "1.0"  # the headers' Version, not the body's
    assert version("no_such_package_here") is None


def test_a_conversion_starts_without_importlib_metadata_or_tqdm_when_no_bar_is_drawn(tmp_path):
    """A built-in command loads no command plugins (looking them up imports importlib.metadata), versions are read
    without it, and with stderr not a terminal (tqdm would draw nothing) tqdm is not imported: 50-70 ms of a
    conversion's start-up; nor socket and hashlib (6 ms: a host name and sha256 digests, needed by few); nor is any
    other format's converter, though detection asks each format before HF's (34 ms when each detector lived in its
    format's module). The plugins' commands are still there when asked for."""
    _, src = saved(tmp_path, "llama")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    # the first conversion of a model asks transformers about it (importing it and torch), and keeps the answers
    subprocess.run([sys.executable, "-m", "converters.cli", "convert", str(src), str(tmp_path / "first"), "--to", "universal"],
                   env=env, check=True, capture_output=True, timeout=300)
    others = ("accelerate", "dcp", "deepspeed", "ds_universal", "hf_trainer", "interop_ckpt", "interop_dcp", "megatron",
              "megatron_dist", "diff")
    probe = ("import sys; from converters import cli; rc = cli.main(sys.argv[1:]); "
             "print(sorted(m for m in ('importlib.metadata', 'tqdm', 'torch', 'socket', 'hashlib') if m in sys.modules)); "
             f"print(sorted(m for m in {others!r} if 'converters.' + m in sys.modules)); sys.exit(rc)")
    done = subprocess.run([sys.executable, "-c", probe, "convert", str(src), str(tmp_path / "uni"), "--to", "universal"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    # an HF source is the last format detection tries: every other format was asked (converters.detection), and
    # none of their converters imported
    assert done.stdout.splitlines()[-2:] == ["[]", "[]"], done.stdout
    back = subprocess.run([sys.executable, "-c", probe, "convert", str(tmp_path / "uni"), str(tmp_path / "back"), "--to", "hf"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert back.returncode == 0, back.stderr
    assert back.stdout.splitlines()[-2:] == ["[]", "[]"], back.stdout
    manifest = json.loads((tmp_path / "uni" / "manifest.json").read_text())
    from importlib.metadata import version as metadata_version

    assert manifest["producer"]["torch"] == metadata_version("torch").split("+")[0]
    listed = subprocess.run([sys.executable, "-m", "converters.cli", "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert "demo" in listed.stdout.split()
    demo = subprocess.run([sys.executable, "-m", "converters.cli", "demo", "--help"], env=env, capture_output=True, text=True, timeout=120)
    assert demo.returncode == 0 and demo.stdout.startswith("usage: interop demo"), demo.stderr


def test_optimizer_scalars_are_checked_as_torch_would_build_them():
    """state.json's scalars are checked without torch as torch.tensor(value, dtype) would take them: an integer
    that does not fit its dtype, a value that is no number, a dtype that is no name are refused as read."""
    import pytest

    from interop.universal import checked_scalar

    assert checked_scalar({"value": 255, "dtype": "uint8"}) == (255, "uint8")
    assert checked_scalar({"value": -(1 << 63), "dtype": "int64"}) == (-(1 << 63), "int64")
    assert checked_scalar({"value": 3.5, "dtype": "bfloat16"}) == (3.5, "bfloat16")
    assert checked_scalar({"value": True, "dtype": "bool"}) == (True, "bool")
    for entry, problem in (({"value": 256, "dtype": "uint8"}, "scalar value 256 does not fit uint8"),
                           ({"value": 1 << 63, "dtype": "int64"}, f"scalar value {1 << 63} does not fit int64"),
                           ({"value": True, "dtype": "float32"}, "scalar value True is not a number"),
                           ({"value": "3", "dtype": "float32"}, "scalar value '3' is not a number"),
                           ({"value": 3, "dtype": ["int64"]}, "unknown dtype name ['int64']")):
        with pytest.raises((TypeError, ValueError)) as caught:
            checked_scalar(entry)
        assert str(caught.value) == problem
