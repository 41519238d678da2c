"""Adversarial checkpoints: what a hostile or damaged checkpoint must never achieve.

Each section pins one property, checked through the CLI (``converters.cli.main`` in-process) and the trainers'
command lines, never through internal functions:

1. Planted pickles never run. A payload merged into a real engine file, with the manifest updated so `verify`
   says OK, is refused (exit non-zero, the file named) by `convert` and by every trainer's resume; its marker
   file is never created. `--trust-pickle` on `convert` does run it (the payload is real).
2. Nothing outside the checkpoint is read or written: manifest `files` / `tensors[].file` / component pieces
   naming "../x" or "/abs", an HF index pointing outside, symlinks leaving the checkpoint, DeepSpeed's and our
   `latest` naming a directory outside: exit 2, one line containing "outside".
3. `convert SRC DST` with DST = SRC, SRC's parent, inside SRC or an alias of SRC: exit 2 ("source"), SRC untouched.
4. Corruption: every single-byte flip in every region of every file is caught by `verify` or changes nothing;
   `convert` then fails cleanly or writes the unflipped output; a resume raises an InteropError or continues
   exactly. Swapped files from another step, extra files, and crafted safetensors headers are caught.
5. Bad input gives one line, exit 2, no traceback (JSON that is not JSON, NaN, deep nesting, wrong types).
6. Concurrency: two converts into one DST, two trainers on one output dir: one wins, the other says "another".
7. A stale ``latest.tmp<pid>`` from a killed save is cleaned by the next save.

Conventions: bad input -> exit 2 and exactly one stderr line naming the file, no traceback; `verify` problems
-> exit 1. Checkpoints are built once per module and copied per case; nothing is written outside tmp dirs.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import os
import random
import re
import shutil
import signal
import struct
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from converters.cli import main
from interop.errors import InteropError
from trainers.base import BaseTrainer, TrainerConfig

from .conftest import ROOT, by_blocks, reseal, worker_env

SIZES = ["--batch-size", "4", "--seq-len", "16"]


# =====================================================================================================
# helpers
# =====================================================================================================
def run_cli(capsys, *argv):
    """``interop ARGV`` in-process: (exit code, stdout, stderr). An escaping exception is reported as the
    traceback a user would see, with code None, so the assertions below name it."""
    try:
        code = main([str(a) for a in argv])
    except SystemExit as exc:  # argparse
        code = exc.code
    except Exception:  # noqa: BLE001 - a traceback is exactly what the tests must rule out
        out, err = capsys.readouterr()
        return None, out, err + traceback.format_exc()
    out, err = capsys.readouterr()
    return code, out, err


def prose(text: str) -> str:
    """``text`` without its paths (any token holding a slash): what the message itself says, so a word looked for
    cannot be matched by a directory name (pytest names tmp dirs after the test)."""
    return re.sub(r"\S*/\S*", " ", text)


def one_line_error(code, err, *names, words=()) -> str | None:
    """None when (code, err) is a clean one-line exit-2 error whose line contains every one of ``names`` (file
    names, paths) and, outside its paths, every one of ``words``; else what is wrong."""
    lines = err.strip().splitlines()
    if code is None:
        return f"raised: {lines[-1] if lines else ''}"
    if code != 2:
        return f"exit {code}, not 2: {err.strip()[-600:]!r}"
    if len(lines) != 1 or "Traceback" in err:
        return f"not one line: {err.strip()[-600:]!r}"
    missing = [n for n in names if n not in lines[0]] + [w for w in words if w not in prose(lines[0])]
    return f"{missing} not in {lines[0]!r}" if missing else None


def assert_one_line_error(code, err, *names, words=()):
    problem = one_line_error(code, err, *names, words=words)
    assert problem is None, problem


def assert_convert_refused(capsys, src, dst, watch, *names, words=()) -> str:
    """`convert SRC DST --to universal` is refused with one line (exit 2) and nothing under ``watch`` changes: no
    output, no staging directory left, nothing written beside or outside DST. Returns what it printed."""
    before = snapshot(watch)
    code, out, err = run_cli(capsys, "convert", src, dst, "--to", "universal")
    after = snapshot(watch)
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, f"convert (exit {code}) changed {changed[:8]}"
    assert_one_line_error(code, err, *names, words=words)
    return out + err


def trainer_error_lines(stderr: str) -> list[str]:
    """The lines of a trainer's stderr that are not its progress log."""
    return [line for line in stderr.strip().splitlines() if not line.startswith(("INFO ", "WARNING "))]


def copy(src, dst) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return Path(dst)


def snapshot(root) -> dict[str, object]:
    """Every entry under ``root``: file bytes, symlink targets, directories."""
    root = Path(root)
    found: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            rel = str(p.relative_to(root))
            if p.is_symlink():
                found[rel] = ("link", os.readlink(p))
            elif p.is_dir():
                found[rel] = "dir"
            else:
                found[rel] = p.read_bytes()
    return found


def flip(path, pos: int, mask: int) -> bytes:
    """XOR one byte in place; returns the file's original bytes (to put back)."""
    raw = Path(path).read_bytes()
    changed = bytearray(raw)
    changed[pos] ^= mask
    Path(path).write_bytes(bytes(changed))
    return raw


def edit_manifest(ckpt, *changes) -> None:
    """Read the manifest, let each ``change(manifest)`` mutate it, write it back as the library's JSON (so its
    self-digest, where the format has one, stays valid), as a hostile hand would: not through ``write_manifest``,
    which refuses a manifest its reader would refuse. One round trip for all changes: a manifest holding a path
    outside the checkpoint cannot be read back to edit it further."""
    from interop.commit import atomic_write_text
    from interop.manifest import MANIFEST, read_manifest

    manifest = read_manifest(str(ckpt))
    for change in changes:
        change(manifest)
    atomic_write_text(os.path.join(str(ckpt), MANIFEST), manifest.to_json())


def edit_manifest_json(ckpt, change) -> None:
    """Edit manifest.json as raw JSON (for values the library would never write)."""
    path = Path(ckpt) / "manifest.json"
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data, indent=1))


def digest_of(path, like: str) -> str:
    """``path``'s digest by the algorithm of the recorded digest ``like``; "" when it cannot be computed."""
    from interop.verify import digest_as

    try:
        return digest_as(str(path), like) or ""
    except Exception:  # noqa: BLE001 - an unreadable file has no digest to record
        return ""


def file_record(rel: str, target, like_rel: str, size: int | None = None, digest: str | None = None):
    """A manifest change listing ``rel`` with the size and digest of the file ``target`` (default: correct ones,
    by the algorithm ``like_rel``'s record uses)."""
    def change(manifest):
        like = manifest.files[like_rel]
        manifest.files[rel] = dataclasses.replace(
            like,
            bytes=os.path.getsize(target) if size is None else size,
            digest=digest_of(target, like.digest) if digest is None else digest,
        )

    return change


def read_header(path) -> tuple[dict, bytes]:
    raw = Path(path).read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(path, header: dict, data: bytes) -> None:
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    Path(path).write_bytes(struct.pack("<Q", len(text)) + text + data)


def rewrite_header(path, change) -> None:
    header, data = read_header(path)
    change(header)
    write_header(path, header, data)


def file_regions(path) -> dict[str, tuple[int, int]]:
    """The byte ranges of a file by kind: a safetensors file's length prefix, header JSON and data; a JSON file."""
    path = Path(path)
    size = path.stat().st_size
    if path.suffix == ".safetensors":
        n = struct.unpack("<Q", path.read_bytes()[:8])[0]
        return {"safetensors-length": (0, 8), "safetensors-header": (8, 8 + n), "safetensors-data": (8 + n, size)}
    if path.name == "manifest.json":
        return {"manifest": (0, size)}
    return {"json": (0, size)}


def checkpoint_files(ckpt) -> list[str]:
    ckpt = Path(ckpt)
    return sorted(str(p.relative_to(ckpt)) for p in ckpt.rglob("*") if p.is_file())


def output_view(out, src) -> dict[str, object]:
    """A conversion's output for comparison: every file's bytes; the manifest without its commit time, any
    self-digest, and the source's path."""
    view = {}
    for rel in checkpoint_files(out):
        data = (Path(out) / rel).read_bytes()
        if rel == "manifest.json":
            manifest = json.loads(data.decode().replace(str(src), "<SRC>"))
            manifest = {k: v for k, v in manifest.items() if k != "committed_at" and "digest" not in k}
            data = json.dumps(manifest, sort_keys=True)
        view[rel] = data
    return view


def state_digest(obj) -> str:
    """A digest of nested state (tensors by dtype, shape and bytes), to compare two runs' state exactly."""
    h = hashlib.sha256()

    def walk(x):
        if isinstance(x, torch.Tensor):
            t = x.detach().cpu().contiguous()
            h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
        elif isinstance(x, dict):
            h.update(b"{")
            for k in sorted(x, key=repr):
                h.update(repr(k).encode())
                walk(x[k])
            h.update(b"}")
        elif isinstance(x, (list, tuple)):
            h.update(b"[")
            for v in x:
                walk(v)
            h.update(b"]")
        else:
            h.update(repr(x).encode())

    walk(obj)
    return h.hexdigest()


def resume_outcome(ckpt, out) -> dict[str, str]:
    """Resume the base trainer from ``ckpt`` in-process and train 2 steps: digests of the state right after the
    load and of the losses, weights and optimizer state after training."""
    trainer = BaseTrainer(TrainerConfig(steps=4, output_dir=str(out), tied=True))
    trainer.resume(str(ckpt))
    loaded = state_digest([trainer.model.state_dict(), trainer.optimizer.state_dict(), trainer.scheduler.state_dict(),
                           trainer.data.state_dict(), trainer.state.step, trainer.state.losses, torch.get_rng_state()])
    losses = trainer.train()
    return {"loaded": loaded, "losses": repr(losses),
            "after": state_digest([trainer.model.state_dict(), trainer.optimizer.state_dict()])}


def pid_that_is_not_running() -> int:
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())  # pids are below pid_max
    except OSError:
        return 2**22 + 1


# --- the pickle payload ------------------------------------------------------------------------------
class Payload:
    """Unpickling this runs ``open(marker, 'a').write('x')``: the marker's existence proves the pickle ran."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (builtins.exec, (f"open({self.marker!r}, 'a').write('x')",))


def plant_pickle(ckpt, rel: str, marker) -> Path:
    """Merge a Payload into the real torch file ``ckpt/rel`` (the rest still loads as before) and update its
    manifest entry, so `verify` passes and only refusing the pickle can stop it."""
    path = Path(ckpt) / rel
    obj = torch.load(path, map_location="cpu", weights_only=False)
    if isinstance(obj, dict):
        obj = dict(obj)
        obj["evil"] = Payload(marker)
    else:
        obj = {"state": obj, "evil": Payload(marker)}
    torch.save(obj, path)
    assert not Path(marker).exists()
    if (Path(ckpt) / "manifest.json").exists():
        reseal(ckpt, rel)
        from interop.manifest import read_manifest

        record = read_manifest(str(ckpt)).files[rel]  # the manifest agrees: only refusing the pickle can stop it
        assert record.bytes == path.stat().st_size and digest_of(path, record.digest) == record.digest
    return path


def committed(out) -> list[str]:
    out = Path(out)
    return sorted(p.parent.name for p in out.glob("*/manifest.json")) if out.exists() else []


# =====================================================================================================
# checkpoints, built once per module
# =====================================================================================================
@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A base-trainer run (step 2, tied), its universal conversion sharded (with indexes) and unsharded, and
    a sharded and an unsharded Hugging Face export."""
    root = tmp_path_factory.mktemp("base")
    trainer = BaseTrainer(TrainerConfig(steps=2, output_dir=str(root / "run"), tied=True))
    trainer.train()
    trainer.save()
    for argv in (["convert", root / "run", root / "uni", "--to", "universal", "--max-shard-size", "100KB"],
                 ["convert", root / "run", root / "uni1", "--to", "universal"],
                 ["convert", root / "uni", root / "hf", "--to", "hf"],
                 ["convert", root / "uni", root / "hfs", "--to", "hf", "--max-shard-size", "100KB"]):
        assert main([str(a) for a in argv]) == 0, argv
    assert (root / "uni" / "model" / "model.safetensors.index.json").exists()
    assert (root / "uni1" / "model" / "model.safetensors").exists()
    assert (root / "hfs" / "model.safetensors.index.json").exists()
    return root


@pytest.fixture(scope="module")
def run8(tmp_path_factory):
    """Base trainer, 8 steps, checkpoints at 4 and 8 (both kept)."""
    root = tmp_path_factory.mktemp("run8")
    BaseTrainer(TrainerConfig(steps=8, save_every=4, keep_last=None, output_dir=str(root / "run"), tied=True)).train()
    assert (root / "run" / "checkpoint-4").is_dir() and (root / "run" / "checkpoint-8").is_dir()
    return root / "run"


def trainer_cmd(module: str, nproc: int, *args: str) -> list[str]:
    if nproc == 1:
        return [sys.executable, "-m", module, *args]
    from trainers.launch import run_command

    return run_command(module, nproc, list(args))


def engine_env() -> dict[str, str]:
    env = worker_env()
    env["DS_ACCELERATOR"] = "cpu"
    return env


def train_engine(module: str, nproc: int, out, *args: str) -> Path:
    from trainers.launch import run_processes

    run_processes(trainer_cmd(module, nproc, "--steps", "2", *SIZES, "--output-dir", str(out), *args), engine_env(), 600)
    return Path(out) / "checkpoint-2"


@pytest.fixture(scope="module")
def deepspeed_ready():
    """DeepSpeed imported once, outside any test's output capture, on its CPU accelerator (no warning)."""
    old = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    pytest.importorskip("deepspeed", reason="needs deepspeed")
    yield
    if old is None:
        os.environ.pop("DS_ACCELERATOR", None)
    else:
        os.environ["DS_ACCELERATOR"] = old


@pytest.fixture(scope="module")
def ds_ckpts(tmp_path_factory, deepspeed_ready):
    """Our DeepSpeed trainer's checkpoints on 2 ranks, ZeRO-2 and ZeRO-3, each made on first use."""
    made = {}

    def get(stage: int) -> Path:
        if stage not in made:
            out = tmp_path_factory.mktemp(f"zero{stage}")
            made[stage] = train_engine("trainers.deepspeed", 2, out / "run", "--zero-stage", str(stage))
        return made[stage]

    return get


@pytest.fixture(scope="module")
def acc_ckpt(tmp_path_factory):
    pytest.importorskip("accelerate", reason="needs accelerate")
    out = tmp_path_factory.mktemp("acc")
    return train_engine("trainers.accelerate", 2, out / "run", "--save-every", "2")


@pytest.fixture(scope="module")
def hft_ckpt(tmp_path_factory):
    out = tmp_path_factory.mktemp("hft")
    return train_engine("trainers.hf_trainer", 1, out / "run", "--save-every", "2")


# =====================================================================================================
# 0. the untouched checkpoints are clean (what every test below damages)
# =====================================================================================================
@pytest.mark.parametrize("which", ["uni", "uni1", "run", "run/checkpoint-2"])
def test_untouched_checkpoint_verifies(base, capsys, which):
    code, out, err = run_cli(capsys, "verify", base / which, "-q")
    assert code == 0, out + err


def test_malformed_manifest_self_digest_names_the_manifest(base, tmp_path, capsys):
    """A flipped byte can land in the manifest's digest of itself, leaving it malformed (what the random flips
    found once in a while): verify names manifest.json, exit 1."""
    copy = tmp_path / "uni1"
    shutil.copytree(base / "uni1", copy)
    data = json.loads((copy / "manifest.json").read_text())
    data["digest"] = data["digest"][:20] + "`" + data["digest"][21:]
    (copy / "manifest.json").write_text(json.dumps(data))
    code, out, err = run_cli(capsys, "verify", copy)
    assert code == 1 and f"{copy / 'manifest.json'}" in out + err and "malformed digest" in out + err, out + err


@pytest.mark.dist
@pytest.mark.parametrize("engine,stage", [("deepspeed", 2), ("accelerate", None), ("hf_trainer", None)])
def test_untouched_engine_checkpoint_verifies(engine_ckpt, capsys, engine, stage):
    code, out, err = run_cli(capsys, "verify", engine_ckpt(engine, stage), "-q")
    assert code == 0, out + err


# =====================================================================================================
# 1. planted pickles never run
# =====================================================================================================
DS2_FILES = ["mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt",
             "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
DS3_FILES = [f"zero_pp_rank_{r}_mp_rank_00_{kind}_states.pt" for r in (0, 1) for kind in ("model", "optim")]
ACC_FILES = ["optimizer.bin", "scheduler.bin", "random_states_0.pkl", "random_states_1.pkl"]
HFT_FILES = ["optimizer.pt", "scheduler.pt", "rng_state.pth"]

# (engine, stage, file): the default run converts every ZeRO-2 file (a ZeRO-3 rank's model states go through the
# same loader) and one file of each other engine; the rest is slow
CONVERT_ROWS = (
    [pytest.param("deepspeed", 2, f, id=f"zero2-{f}") for f in DS2_FILES]
    + [pytest.param("deepspeed", 3, f, id=f"zero3-{f}", marks=[pytest.mark.slow]) for f in DS3_FILES]
    + [pytest.param("accelerate", None, f, id=f"accelerate-{f}", marks=[] if f == "optimizer.bin" else [pytest.mark.slow])
       for f in ACC_FILES]
    + [pytest.param("hf_trainer", None, f, id=f"hf_trainer-{f}", marks=[] if f == "optimizer.pt" else [pytest.mark.slow])
       for f in HFT_FILES]
)
DEFAULT_RESUMES = {("deepspeed", 2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),  # today: never screened, runs
                   ("accelerate", None, "random_states_1.pkl"),  # today: silently accepted
                   ("hf_trainer", None, "rng_state.pth")}
RESUME_ROWS = [
    pytest.param(engine, stage, f, id=f"{engine}{stage or ''}-{f}",
                 marks=[] if (engine, stage, f) in DEFAULT_RESUMES else [pytest.mark.slow])
    for engine, stage, files in (("deepspeed", 2, DS2_FILES), ("deepspeed", 3, DS3_FILES),
                                 ("accelerate", None, ACC_FILES), ("hf_trainer", None, HFT_FILES))
    for f in files
]


@pytest.fixture
def engine_ckpt(request):
    """The engine checkpoint a row names (made once per module)."""
    def get(engine: str, stage: int | None) -> Path:
        if engine == "deepspeed":
            return request.getfixturevalue("ds_ckpts")(stage)
        return request.getfixturevalue({"accelerate": "acc_ckpt", "hf_trainer": "hft_ckpt"}[engine])

    return get


def planted_copy(engine_ckpt, tmp_path, engine, stage, name) -> tuple[Path, str, Path]:
    src = copy(engine_ckpt(engine, stage), tmp_path / "ckpt")
    rel = name  # the engine's files lie beside our manifest
    marker = tmp_path / "marker"
    plant_pickle(src, rel, marker)
    return src, rel, marker


@pytest.mark.dist
@pytest.mark.parametrize("engine,stage,name", CONVERT_ROWS)
def test_planted_pickle_is_refused_by_convert(engine_ckpt, tmp_path, capsys, engine, stage, name):
    src, rel, marker = planted_copy(engine_ckpt, tmp_path, engine, stage, name)
    code, out, err = run_cli(capsys, "verify", src, "-q")
    assert code is not None and "Traceback" not in out + err and not marker.exists(), out + err
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert not marker.exists(), f"the pickle planted in {rel} ran during convert"
    if name.startswith("random_states") and code == 0:
        return  # not read by this conversion (the universal output is pickle-free): nothing to refuse
    assert_one_line_error(code, err, name)
    assert not (tmp_path / "out").exists()


@pytest.mark.dist
@pytest.mark.parametrize("engine,stage,name", RESUME_ROWS)
def test_planted_pickle_is_refused_by_resume(engine_ckpt, tmp_path, engine, stage, name):
    src, rel, marker = planted_copy(engine_ckpt, tmp_path, engine, stage, name)
    nproc = 1 if engine == "hf_trainer" else 2
    args = ["--steps", "3", *SIZES, "--resume", str(src), "--output-dir", str(tmp_path / "resumed")]
    if engine == "deepspeed":
        args += ["--zero-stage", str(stage)]
    proc = subprocess.run(trainer_cmd(f"trainers.{engine}", nproc, *args), env=engine_env(), capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert not marker.exists(), f"the pickle planted in {rel} ran during resume"
    assert proc.returncode != 0, f"resume accepted the planted {rel}"
    assert name in proc.stderr, proc.stderr[-3000:]
    assert committed(tmp_path / "resumed") == []


@pytest.mark.dist
def test_trust_pickle_runs_the_payload(ds_ckpts, tmp_path, capsys):
    """The opt-in does what it says: the same planted file, converted with --trust-pickle, runs the payload."""
    src, _, marker = planted_copy(lambda e, s: ds_ckpts(s), tmp_path, "deepspeed", 2,
                                  "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal", "--trust-pickle")
    assert marker.exists(), "the test payload does not work: the refusals above prove nothing"


def test_planted_pickle_in_bare_hf_model_dir(base, tmp_path, capsys):
    from safetensors.torch import load_file

    src = tmp_path / "hf"
    src.mkdir()
    shutil.copy(base / "hf" / "config.json", src / "config.json")
    marker = tmp_path / "marker"
    weights = load_file(str(base / "hf" / "model.safetensors"))
    torch.save({**weights, "evil": Payload(marker)}, src / "pytorch_model.bin")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert not marker.exists()
    assert_one_line_error(code, err, "pytorch_model.bin")
    assert not (tmp_path / "out").exists()
    with pytest.raises(InteropError, match="pytorch_model.bin"):  # a trainer started from it: the same refusal
        BaseTrainer(TrainerConfig(init_from=str(src), steps=1, output_dir=str(tmp_path / "run")))
    assert not marker.exists()
    run_cli(capsys, "convert", src, tmp_path / "trusted", "--to", "universal", "--trust-pickle")
    assert marker.exists(), "the test payload does not work"


# =====================================================================================================
# 2. nothing outside the checkpoint is read or written
# =====================================================================================================
def test_component_piece_outside_is_not_written_outside_dst(base, tmp_path, capsys):
    """A piece "../in/evil" (listed with a correct record): converting must not create DST/../in/evil.json."""
    src = copy(base / "uni", tmp_path / "a" / "src")
    (tmp_path / "a" / "in").mkdir()
    shutil.copy(src / "components" / "data.json", tmp_path / "a" / "in" / "evil.json")
    edit_manifest(src, file_record("../in/evil.json", tmp_path / "a" / "in" / "evil.json", "components/data.json"),
                  lambda m: m.components["data"].pieces.update({"global": "../in/evil"}))
    (tmp_path / "b").mkdir()
    assert_convert_refused(capsys, src, tmp_path / "b" / "out", tmp_path, words=["outside"])
    assert not (tmp_path / "b" / "in").exists(), "convert wrote outside its destination"
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and "outside" in prose(out), out


SECRET = "TOPSECRET-7f3a9c"


@pytest.mark.parametrize("record", ["matching", "wrong-size"])
def test_manifest_file_outside_is_never_read(base, tmp_path, capsys, record):
    """A `files` entry "../outside/secret.txt": verify must neither confirm it (a matching record) nor leak its
    size or content (a wrong one); convert refuses the checkpoint."""
    src = copy(base / "uni", tmp_path / "ck" / "src")
    secret = tmp_path / "ck" / "outside" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text(SECRET * 7)
    size = len(SECRET * 7)
    if record == "matching":
        edit_manifest(src, file_record("../outside/secret.txt", secret, "components/data.json"))
    else:
        edit_manifest(src, file_record("../outside/secret.txt", secret, "components/data.json", 1, "sha256:" + "0" * 64))
    code, out, err = run_cli(capsys, "verify", src)
    assert code not in (0, None), out + err
    assert SECRET not in out + err and not re.search(rf"\b{size}\b", prose(out + err)), out + err
    assert "outside" in prose(out + err), out + err
    printed = assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])
    assert SECRET not in printed


def test_manifest_absolute_path_is_never_read(base, tmp_path, capsys):
    passwd = Path("/etc/passwd")
    if not passwd.is_file():
        pytest.skip("no /etc/passwd to aim at")
    size = passwd.stat().st_size
    src = copy(base / "uni", tmp_path / "src")
    edit_manifest(src, file_record("/etc/passwd", passwd, "components/data.json", 1, "sha256:" + "0" * 64))
    code, out, err = run_cli(capsys, "verify", src)
    assert code not in (0, None), out + err
    assert not re.search(rf"\b{size}\b", prose(out + err)), f"verify reported /etc/passwd's size: {out + err}"
    assert "outside" in prose(out + err), out + err
    printed = assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])
    assert not re.search(rf"\b{size}\b", prose(printed)), printed


@pytest.mark.parametrize("target", ["../outside/x.safetensors", "/etc/passwd"])
def test_tensor_file_outside(base, tmp_path, capsys, target):
    src = copy(base / "uni1", tmp_path / "ck" / "src")
    (tmp_path / "ck" / "outside").mkdir()
    shutil.copy(src / "model" / "model.safetensors", tmp_path / "ck" / "outside" / "x.safetensors")

    def change(manifest):
        name = next(iter(manifest.tensors))
        manifest.tensors[name] = dataclasses.replace(manifest.tensors[name], file=target)

    edit_manifest(src, change)
    code, out, err = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and "outside" in prose(out), out + err
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])


def test_hf_index_naming_a_shard_outside(base, tmp_path, capsys):
    src = copy(base / "hfs", tmp_path / "ck" / "hf")
    index_path = src / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    shard = sorted(set(index["weight_map"].values()))[-1]
    (tmp_path / "ck" / "outside").mkdir()
    shutil.move(src / shard, tmp_path / "ck" / "outside" / "w.safetensors")
    index["weight_map"] = {k: ("../outside/w.safetensors" if v == shard else v) for k, v in index["weight_map"].items()}
    index_path.write_text(json.dumps(index))
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])


def test_hugging_face_cache_snapshot_links_into_its_own_blobs(base, tmp_path, capsys):
    """The one place links are expected: a hub cache snapshot, whose files link into the repository's blobs/.
    It converts; a link from the same snapshot to a file outside the repository is still refused."""
    repo = tmp_path / "hub" / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abcd"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        blob = repo / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        shutil.copy(base / "hf" / name, blob)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    code, out, err = run_cli(capsys, "convert", snapshot, tmp_path / "out", "--to", "universal")
    assert code == 0, err
    code, out, err = run_cli(capsys, "diff", base / "hf", tmp_path / "out", "--model-only")
    assert code == 0 and "0 different" in out, out
    (snapshot / "extra.json").symlink_to(base / "hf" / "config.json")
    assert_convert_refused(capsys, snapshot, tmp_path / "out2", tmp_path / "hub", "extra.json", words=["outside"])


@pytest.mark.parametrize("target", ["etc-passwd", "identical-copy"])
def test_symlink_in_universal_checkpoint_pointing_outside(base, tmp_path, capsys, target):
    """components/data.json -> a file outside: /etc/passwd, or a byte-identical copy (digest and size match)."""
    src = copy(base / "uni", tmp_path / "ck" / "src")
    link = src / "components" / "data.json"
    if target == "etc-passwd":
        if not Path("/etc/passwd").is_file():
            pytest.skip("no /etc/passwd")
        aim = Path("/etc/passwd")
    else:
        aim = tmp_path / "ck" / "outside" / "data.json"
        aim.parent.mkdir()
        shutil.copy(link, aim)
    link.unlink()
    link.symlink_to(aim)
    code, out, err = run_cli(capsys, "verify", src, "-q")
    assert code not in (0, None), out + err
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])


@pytest.mark.parametrize("what", ["components/optimizer.safetensors", "ranks/00000"])
def test_symlink_in_trainer_checkpoint_pointing_outside(base, tmp_path, capsys, what):
    """A file (or directory) of a trainer checkpoint moved outside it and replaced by a symlink to it."""
    src = copy(base / "run" / "checkpoint-2", tmp_path / "ck" / "src")
    away = tmp_path / "ck" / "outside" / Path(what).name
    away.parent.mkdir()
    shutil.move(src / what, away)
    (src / what).symlink_to(away)
    code, out, err = run_cli(capsys, "verify", src, "-q")
    assert code not in (0, None), f"verify accepted a checkpoint reaching outside itself: {out}{err}"
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])
    with pytest.raises(InteropError) as raised:
        BaseTrainer(TrainerConfig(steps=3, output_dir=str(tmp_path / "resumed"), tied=True)).resume(str(src))
    assert "outside" in prose(str(raised.value)), raised.value


@pytest.mark.dist
def test_deepspeed_latest_naming_a_tag_outside(ds_ckpts, tmp_path, capsys):
    """A bare DeepSpeed checkpoint whose `latest` says "../../elsewhere", where a complete tag directory waits."""
    src = tmp_path / "x" / "a" / "ds"
    shutil.copytree(ds_ckpts(2), src / "global_step2", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    shutil.copytree(src / "global_step2", tmp_path / "x" / "elsewhere")
    (src / "latest").write_text("../../elsewhere")
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, words=["outside"])


@pytest.mark.dist
def test_deepspeed_latest_outside_in_a_trainer_checkpoint(ds_ckpts, tmp_path, capsys):
    """A DeepSpeed `latest` planted inside our trainer's checkpoint, naming "../../elsewhere" (which holds only
    junk): never followed; the manifest does not list it, so the checkpoint is refused."""
    src = copy(ds_ckpts(2), tmp_path / "x" / "a" / "ckpt")
    (tmp_path / "x" / "elsewhere").mkdir(parents=True)
    for f in src.glob("*.pt"):
        (tmp_path / "x" / "elsewhere" / f.name).write_bytes(b"junk")
    (src / "latest").write_text("../../elsewhere")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, "latest", words=["not listed"])
    assert not (tmp_path / "out").exists()


def test_trainer_root_latest_naming_a_checkpoint_outside(base, tmp_path, capsys):
    """Our own `latest` in a run root naming "../elsewhere/checkpoint-2" (a complete checkpoint outside)."""
    root = copy(base / "run", tmp_path / "x" / "run")
    copy(base / "run" / "checkpoint-2", tmp_path / "x" / "elsewhere" / "checkpoint-2")
    shutil.rmtree(root / "checkpoint-2")
    (root / "latest").write_text("../elsewhere/checkpoint-2\n")
    assert_convert_refused(capsys, root, tmp_path / "out", tmp_path, words=["outside"])


# =====================================================================================================
# 3. the destination is never the source
# =====================================================================================================
@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("relation", ["same", "parent", "inside", "alias"])
@pytest.mark.parametrize("kind", ["universal", "trainer-root", "trainer-checkpoint"])
def test_destination_is_the_source(base, tmp_path, capsys, kind, relation, overwrite):
    box = tmp_path / "box"
    if kind == "universal":
        src = copy(base / "uni", box / "src")
    else:
        run = copy(base / "run", box / "run")
        src = run if kind == "trainer-root" else run / "checkpoint-2"
    if relation == "alias":
        dst = tmp_path / "alias"
        dst.symlink_to(src)
    else:
        dst = {"same": src, "parent": src.parent, "inside": src / "out"}[relation]
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, dst, "--to", "universal", *(["--overwrite"] if overwrite else []))
    after = snapshot(tmp_path)
    assert after == before, f"the source tree changed: {sorted(set(after) ^ set(before))[:10]}"
    assert_one_line_error(code, err, words=["source"])


# =====================================================================================================
# 4. corruption: caught, or harmless
# =====================================================================================================
MASKS = (0x01, 0x80)


@pytest.fixture(scope="module")
def flip_bench(base, tmp_path_factory):
    """Per checkpoint kind: a working copy, the pristine conversion's output view and (trainer) resume outcome."""
    root = tmp_path_factory.mktemp("flips")
    bench = {}
    for kind, src in (("universal", base / "uni"), ("trainer", base / "run" / "checkpoint-2")):
        pristine = copy(src, root / kind / "pristine")
        assert main(["convert", str(pristine), str(root / kind / "baseline"), "--to", "universal"]) == 0
        bench[kind] = {
            "pristine": pristine,
            "work": copy(src, root / kind / "work"),
            "view": output_view(root / kind / "baseline", pristine),
            "resume": resume_outcome(pristine, root / kind / "resumed") if kind == "trainer" else None,
            "root": root / kind,
        }
    return bench


def flip_cases(work, region_kind: str | None, per_region: int, total: int | None, seed: str):
    """(rel, region, pos, mask): ``per_region`` positions x MASKS in each region of kind ``region_kind`` of every
    file; or, with ``total``, that many flips at random files, regions and positions."""
    rng = random.Random(seed)
    files = checkpoint_files(work)
    cases = []
    if total is not None:
        for _ in range(total):
            rel = rng.choice(files)
            region, (lo, hi) = rng.choice(sorted(file_regions(work / rel).items()))
            cases.append((rel, region, rng.randrange(lo, hi), rng.choice((0x01, 0x02, 0x10, 0x20, 0x80, 0xFF))))
        return cases
    for rel in files:
        for region, (lo, hi) in sorted(file_regions(work / rel).items()):
            if region != region_kind or hi <= lo:
                continue
            positions = [lo] + [rng.randrange(lo, hi) for _ in range(per_region - 1)] if per_region > 1 else [rng.randrange(lo, hi)]
            for pos in positions:
                cases.extend((rel, region, pos, mask) for mask in MASKS)
    return cases


def check_flip(bench, kind, rel, region, pos, mask, capsys, n: int) -> list[str]:
    """Flip, run verify / convert (/ resume), restore; the broken promises, one line each."""
    work, where = bench["work"], f"{kind}:{rel}[{region}]@{pos}^{mask:#04x}"
    original = flip(work / rel, pos, mask)
    problems = []
    out_dir = bench["root"] / f"out{n}"
    try:
        name = Path(rel).name  # every report of the damage names the damaged file
        vcode, vout, verr = run_cli(capsys, "verify", work, "-q")
        if vcode is None or "Traceback" in vout + verr:
            problems.append(f"{where}: verify raised: {verr.strip().splitlines()[-1:]}")
        elif vcode not in (0, 1) or (vcode == 1 and name not in vout):
            problems.append(f"{where}: verify exit {vcode}, its report does not name {name}: {vout.strip()[-300:]!r}")
        ccode, cout, cerr = run_cli(capsys, "convert", work, out_dir, "--to", "universal")
        same = ccode == 0 and output_view(out_dir, work) == bench["view"]
        if ccode == 0 and not same:
            problems.append(f"{where}: convert succeeded with output differing from the unflipped one (verify {vcode})")
        elif ccode != 0 and one_line_error(ccode, cerr, name) is not None:
            problems.append(f"{where}: convert failed uncleanly: {one_line_error(ccode, cerr, name)}")
        if vcode == 0 and not same:
            problems.append(f"{where}: verify passed but the flip changed the conversion (convert exit {ccode})")
        if bench["resume"] is not None:
            try:
                outcome = resume_outcome(work, bench["root"] / f"resumed{n}")
            except InteropError as exc:
                if name not in str(exc):
                    problems.append(f"{where}: the resume's error does not name {name}: {str(exc)[:200]}")
            except Exception as exc:  # noqa: BLE001 - the kind of exception is what is checked
                problems.append(f"{where}: resume raised {type(exc).__name__}, not an InteropError: {str(exc)[:150]}")
            else:
                if outcome != bench["resume"]:
                    diff = sorted(k for k in outcome if outcome[k] != bench["resume"][k])
                    problems.append(f"{where}: resume accepted the flip and differs ({', '.join(diff)})")
    finally:
        (work / rel).write_bytes(original)
        shutil.rmtree(out_dir, ignore_errors=True)
    return problems


def run_flips(bench, kind, cases, capsys):
    problems = []
    for n, (rel, region, pos, mask) in enumerate(cases):
        problems += check_flip(bench[kind], kind, rel, region, pos, mask, capsys, n)
    assert not problems, f"{len(problems)} problems in {len(cases)} flips:\n" + "\n".join(problems[:40])


# every region of each kind runs under -m slow; the default run keeps each region once (suite time)
FLIP_DEFAULT = {("universal", "safetensors-length"), ("universal", "manifest"), ("trainer", "safetensors-header"),
                ("trainer", "safetensors-data"), ("trainer", "json")}


@pytest.mark.parametrize("kind,region", [
    pytest.param(k, r, id=f"{k}-{r}", marks=[] if (k, r) in FLIP_DEFAULT else [pytest.mark.slow])
    for k in ("universal", "trainer") for r in ("safetensors-length", "safetensors-header", "safetensors-data", "json", "manifest")])
def test_flipped_byte(flip_bench, capsys, kind, region):
    per_region = 8 if region == "manifest" else 2
    cases = flip_cases(flip_bench[kind]["work"], region, per_region, None, f"{kind}-{region}")
    assert cases
    run_flips(flip_bench, kind, cases, capsys)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["universal", "trainer"])
def test_flipped_byte_grid(flip_bench, capsys, kind):
    run_flips(flip_bench, kind, flip_cases(flip_bench[kind]["work"], None, 0, 200, f"grid-{kind}"), capsys)


ENGINE_FILES = [("deepspeed", 2, "mp_rank_00_model_states.pt"), ("deepspeed", 2, "zero_pp_rank_1_mp_rank_00_optim_states.pt"),
                ("deepspeed", 2, "zero_to_fp32.py"), ("accelerate", None, "optimizer.bin"), ("accelerate", None, "model.safetensors"),
                ("hf_trainer", None, "optimizer.pt"), ("hf_trainer", None, "trainer_state.json")]


@pytest.mark.dist
@pytest.mark.parametrize("engine,stage,rel", ENGINE_FILES, ids=[f"{r[0]}-{r[2]}" for r in ENGINE_FILES])
def test_flipped_byte_in_an_engine_file(engine_ckpt, tmp_path, capsys, engine, stage, rel):
    """The engine's own files inside our checkpoints (pickles, its tag file, its scripts): a flipped byte at the
    start, middle and end is caught by verify and by convert, naming the file, before anything unpickles it."""
    src = copy(engine_ckpt(engine, stage), tmp_path / "ckpt")
    size = (src / rel).stat().st_size
    for pos in (0, size // 2, size - 1):
        original = flip(src / rel, pos, 0x01)
        code, out, _ = run_cli(capsys, "verify", src, "-q")
        assert code == 1 and Path(rel).name in out, out
        code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
        assert_one_line_error(code, err, Path(rel).name, words=["digest"])
        (src / rel).write_bytes(original)


@pytest.mark.dist
def test_a_file_recorded_by_blocks_is_checked_where_it_is_read(ds_ckpts, tmp_path, capsys):
    """A ZeRO optimizer file recorded block by block is read without being hashed whole: an HF export checks only
    the blocks it reads (the zip directory, data.pkl, the fp32 weights), so a flip in an optimizer moment it never
    reads leaves its output exact, while verify and a conversion that reads the moments refuse it, and a flip
    anywhere it reads is one error naming the file, with nothing written. Read without torch, the files give what
    torch.load gives."""
    from converters import torch_zip
    from converters.deepspeed import DEEPSPEED_ALLOWLIST
    from converters.pickle_safety import allowlist
    from tests.test_torch_zip import same

    src = copy(ds_ckpts(2), tmp_path / "ckpt")
    rel = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    assert rel in by_blocks(src, 4096)
    for pt in sorted(src.glob("*.pt")):
        with torch.serialization.safe_globals(allowlist() + DEEPSPEED_ALLOWLIST):  # torch's loader, our stand-ins
            expected = torch.load(pt, map_location="cpu", weights_only=True)
        same(torch_zip.materialize(torch_zip.load(str(pt), DEEPSPEED_ALLOWLIST)), expected, pt.name)
    assert main(["convert", str(src), str(tmp_path / "hf0"), "--to", "hf"]) == 0
    exported = {p.name: p.read_bytes() for p in (tmp_path / "hf0").iterdir()}

    osd = torch_zip.load(str(src / rel), DEEPSPEED_ALLOWLIST)["optimizer_state_dict"]
    fp32 = osd["single_partition_of_fp32_groups"][0].piece().source[1]
    moment = osd["base_optimizer_state"]["state"][0]["exp_avg_sq"]
    lo, hi = moment.piece().source[1], moment.piece().source[1] + moment.numel() * 4
    block = 4096
    unread = next(b * block for b in range(lo // block + 1, hi // block) if abs(b * block - fp32) > 4 * block)
    size = (src / rel).stat().st_size

    original = flip(src / rel, unread + 7, 0x01)  # a moment the export never reads
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "hf1", "--to", "hf")
    assert code == 0, err
    assert {p.name: p.read_bytes() for p in (tmp_path / "hf1").iterdir()} == exported
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and rel in out, out
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "uni", "--to", "universal")
    assert_one_line_error(code, err, rel, words=["differ from the manifest"])
    assert not (tmp_path / "uni").exists()
    (src / rel).write_bytes(original)

    for where, pos in (("data.pkl", 100), ("fp32 weights", fp32 + 5), ("zip directory", size - 30)):
        original = flip(src / rel, pos, 0x01)
        code, _, err = run_cli(capsys, "convert", src, tmp_path / "hf2", "--to", "hf")
        assert_one_line_error(code, err, rel, words=["differ from the manifest"])
        assert not (tmp_path / "hf2").exists(), where
        (src / rel).write_bytes(original)


@pytest.mark.dist
@pytest.mark.slow
def test_flipped_byte_refused_by_the_deepspeed_resume(ds_ckpts, tmp_path):
    """Every rank hashes a share of the files before DeepSpeed loads any: a flip in rank 1's optimizer file
    stops the resume on both ranks, naming it, and nothing is saved."""
    src = copy(ds_ckpts(2), tmp_path / "ckpt")
    rel = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    flip(src / rel, (src / rel).stat().st_size // 2, 0x01)
    args = ["--steps", "3", *SIZES, "--zero-stage", "2", "--resume", str(src), "--output-dir", str(tmp_path / "resumed")]
    proc = subprocess.run(trainer_cmd("trainers.deepspeed", 2, *args), env=engine_env(), capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode != 0 and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in proc.stderr, proc.stderr[-3000:]
    assert "digest differs" in proc.stderr
    assert committed(tmp_path / "resumed") == []


@pytest.mark.parametrize("victim", ["components/model.safetensors", "components/optimizer.safetensors",
                                    "components/data.json"])  # (the RNG files are equal: no dropout, nothing drew)
def test_file_swapped_from_another_step(run8, tmp_path, capsys, victim):
    """checkpoint-8's file replaced by checkpoint-4's (same name and size): caught by verify, convert, resume."""
    ckpt = copy(run8 / "checkpoint-8", tmp_path / "checkpoint-8")
    older = run8 / "checkpoint-4" / victim
    assert older.stat().st_size == (ckpt / victim).stat().st_size  # so only a digest can tell them apart
    shutil.copy(older, ckpt / victim)
    code, out, _ = run_cli(capsys, "verify", ckpt, "-q")
    assert code == 1 and Path(victim).name in out, out
    code, _, err = run_cli(capsys, "convert", ckpt, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, Path(victim).name)
    with pytest.raises(InteropError, match=re.escape(Path(victim).name)):
        BaseTrainer(TrainerConfig(steps=10, output_dir=str(tmp_path / "resumed"), tied=True)).resume(str(ckpt))


@pytest.mark.parametrize("kind,extra", [("universal", "model/model.safetensors.index.json"),
                                        ("universal", "components/extra.json"), ("trainer", "components/extra.json")])
def test_extra_file_is_caught(base, tmp_path, capsys, kind, extra):
    src = copy(base / ("uni1" if kind == "universal" else "run/checkpoint-2"), tmp_path / "src")
    if extra.endswith("index.json"):
        (src / extra).write_text(json.dumps({"metadata": {"total_size": 0}, "weight_map": {}}))
    else:
        shutil.copy(src / "components" / "data.json", src / extra)
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and Path(extra).name in out, out
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, Path(extra).name)


def test_flipped_tensor_digest_in_manifest_is_caught(base, tmp_path, capsys):
    src = copy(base / "uni1", tmp_path / "src")

    def change(manifest):
        name = "model.norm.weight"
        digest = manifest.tensors[name].digest
        last = "1" if digest[-1] != "1" else "2"
        manifest.tensors[name] = dataclasses.replace(manifest.tensors[name], digest=digest[:-1] + last)

    edit_manifest(src, change)
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and "model.norm.weight" in out, out
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err)


def _rename(header):
    header["model.norm.weighs"] = header.pop("model.norm.weight")


def _overlap(header):
    header["model.layers.0.self_attn.o_proj.weight"]["data_offsets"] = list(
        header["model.layers.0.self_attn.q_proj.weight"]["data_offsets"])


def _dtype(header):
    header["model.norm.weight"]["dtype"] = "I32"


def _transpose(header):
    entry = header["model.layers.0.mlp.gate_proj.weight"]
    entry["shape"] = entry["shape"][::-1]


HEADER_EDITS = {"renamed-tensor": _rename, "overlapping-offsets": _overlap, "dtype-f32-to-i32": _dtype,
                "transposed-shape": _transpose}


@pytest.mark.parametrize("edit", sorted(HEADER_EDITS))
def test_crafted_safetensors_header_in_universal(base, tmp_path, capsys, edit):
    """A header edited (and the file's manifest record updated to match): caught by verify and convert."""
    src = copy(base / "uni1", tmp_path / "src")
    rewrite_header(src / "model" / "model.safetensors", HEADER_EDITS[edit])
    reseal(src, "model/model.safetensors")
    code, out, err = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and "model.safetensors" in out, out + err
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, "model.safetensors")


def test_overlapping_offsets_in_plain_hf_dir(base, tmp_path, capsys):
    src = copy(base / "hf", tmp_path / "hf")
    rewrite_header(src / "model.safetensors", _overlap)
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, "model.safetensors")


# =====================================================================================================
# 5. bad input: one line, exit 2, no traceback
# =====================================================================================================
# A value of another type deep inside an engine's pickled file (a bare checkpoint: no manifest, so no digest
# catches it; damaged, hand-edited, or another version's layout): the conversion either succeeds (a value nothing
# reads, or one it reads as it is) or stops with one line naming the file, never an error from deep in a reader
STRUCTURE_VALUES = [None, 7, -1, "x", [], {}, 1.5, [1, 2], {"a": 1}, "tensor"]
STRUCTURE_ROWS = [pytest.param("deepspeed", 2, 12, id="zero2"), pytest.param("accelerate", None, 12, id="accelerate"),
                  pytest.param("hf_trainer", None, 12, id="hf_trainer"), pytest.param("megatron", None, 12, id="megatron"),
                  pytest.param("megatron-dist", None, 12, id="megatron-dist"),
                  pytest.param("megatron-distopt", None, 12, id="megatron-distopt"),
                  pytest.param("deepspeed", 3, 60, id="zero3-slow", marks=[pytest.mark.slow]),
                  *[pytest.param(e, st, 60, id=f"{e}-slow", marks=[pytest.mark.slow])
                    for e, st in (("deepspeed", 2), ("accelerate", None), ("hf_trainer", None), ("megatron", None),
                                  ("megatron-dist", None), ("megatron-distopt", None))]]
# our Megatron writers' files: legacy, torch_dist, and legacy with the distributed optimizer (distrib_optim.pt)
MEGATRON_TARGETS = {"megatron": ["--to", "megatron"], "megatron-dist": ["--to", "megatron-dist"],
                    "megatron-distopt": ["--to", "megatron", "--use-distributed-optimizer", "--transformer-impl", "local"]}


def _value_paths(obj, prefix=()):
    """Every key path inside nested dicts and lists (long lists, a tensor's rows, left whole)."""
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) and len(obj) < 64 else ()
    for key, value in items:
        yield prefix + (key,)
        yield from _value_paths(value, prefix + (key,))


@pytest.mark.dist
@pytest.mark.parametrize("engine,stage,cases", STRUCTURE_ROWS)
def test_a_value_of_another_type_in_an_engine_file_is_one_named_error(engine_ckpt, base, tmp_path, capsys, engine, stage, cases):
    if engine.startswith("megatron"):  # our writer's files, in Megatron-LM's layout (a tied model on 2 stages)
        source = tmp_path / engine
        assert main(["convert", str(base / "run"), str(source), *MEGATRON_TARGETS[engine], "--tp", "2", "--pp", "2"]) == 0
    else:
        source = engine_ckpt(engine, stage)
    config = json.loads(next(Path(source).rglob("manifest.json")).read_text())["model"]["config"]
    bare = shutil.copytree(source, tmp_path / "bare", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    pickled = sorted(p.relative_to(bare) for p in bare.rglob("*") if p.suffix in (".pt", ".bin", ".pkl", ".pth"))
    for d in {p.parent for p in pickled} | {Path(".")}:
        (bare / d / "config.json").write_text(json.dumps(config))
    code, _, err = run_cli(capsys, "convert", bare, tmp_path / "clean", "--to", "universal")
    assert code == 0, err
    rng = random.Random(f"{engine}{stage}")
    refused, unnamed = 0, []
    for case in range(cases):
        ckpt = copy(bare, tmp_path / f"case{case}")
        rel = rng.choice(pickled)
        obj = torch.load(ckpt / rel, weights_only=False)  # the test's own file
        paths = list(_value_paths(obj))
        if not paths:  # training_args.bin: a pickled object, never read
            continue
        at = rng.choice(paths)
        value = rng.choice(STRUCTURE_VALUES)
        value = torch.zeros(2) if value == "tensor" else value
        holder = obj
        for key in at[:-1]:
            holder = holder[key]
        holder[at[-1]] = value
        torch.save(obj, ckpt / rel)
        dst = tmp_path / f"out{case}"
        code, _, err = run_cli(capsys, "convert", ckpt, dst, "--to", "universal")
        what = f"{rel}: {at} := {value!r}"
        if code != 0:  # one line: the file where a reader finds it (a target that cannot hold a value says so)
            assert_one_line_error(code, err)
            assert "unexpected" not in err, (what, err)
            assert not dst.exists(), what
            refused += 1
            if str(ckpt) not in err:
                unnamed.append((what, err.strip()))
        shutil.rmtree(ckpt)
        shutil.rmtree(dst, ignore_errors=True)
    # the changes reach the readers, which name the file; the one refusal that names none is the universal format's
    # own limit (a tensor put into a param group, which the readers carry as the value it is)
    assert refused > 0 and [u for u in unnamed if "optimizer param groups hold tensors" not in u[1]] == [], unnamed


@pytest.mark.parametrize("claim", ["num_layers", "num_experts", "mtp_num_layers", "config.json", "config.json-experts"])
def test_a_count_past_any_model_is_one_line_at_once(base, tmp_path, capsys, claim):
    """A Megatron checkpoint's arguments (num_layers, num_experts, MTP layers) or a config.json (num_hidden_layers)
    claiming a billion layers or experts: each layer and expert is planned before a tensor is read, which took hours
    and all the memory; refused in one line naming the file, at once. (Megatron-LM's own files: no manifest.)"""
    from converters.megatron import load_megatron_file

    assert main(["convert", str(base / "run"), str(tmp_path / "ours"), "--to", "megatron-dist"]) == 0
    capsys.readouterr()
    meg = shutil.copytree(tmp_path / "ours", tmp_path / "meg", ignore=shutil.ignore_patterns("manifest.json", "components", "ranks"))
    if claim.startswith("config.json"):
        src = shutil.copytree(base / "hf", tmp_path / "hf")
        config = json.loads((src / "config.json").read_text())
        key = "num_local_experts" if claim.endswith("experts") else "num_hidden_layers"
        (src / "config.json").write_text(json.dumps({**config, key: 10**9}))
        target, message = "universal", f"{src / 'config.json'}: {key} 1000000000: more than any model this reads"
    else:
        src, common = meg, meg / "iter_0000002" / "common.pt"
        state = load_megatron_file(str(common), trust_pickle=True)
        setattr(state["args"], claim, 10**9)
        torch.save(state, common)
        target, message = "universal", "common.pt: "
    started = time.monotonic()
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", target)
    assert time.monotonic() - started < 30
    # (a dense Llama's arguments claiming experts or MTP layers are refused as no model's first)
    assert_one_line_error(code, err, words=("a damaged or hostile checkpoint",) if claim not in ("num_experts", "mtp_num_layers") else ())
    assert message in err and not (tmp_path / "out").exists(), err
    if claim == "config.json-experts":  # under the config's own bound each, past it together: the model transformers
        # builds has 2 layers of 2**17 + 1 experts, which is asked before a split is traced expert by expert
        from converters.models.facts import unknown_model
        from tests import architectures

        config = {**architectures.build("mixtral").config.to_dict(), "num_local_experts": 2**17 + 1}
        assert unknown_model(config) == ("config.json: 2 layers of 131073 experts each: more than any model this reads (10000 layers, "
                                         "262144 layer-experts at most); a damaged or hostile checkpoint")
    if claim == "num_experts":  # a MoE model's: 2 layers of a million experts each
        from converters.megatron_arch import MegatronArch
        from tests import architectures

        args = MegatronArch.from_hf(architectures.build("mixtral").config.to_dict()).to_args(1, 1)
        with pytest.raises(InteropError, match=r"^common.pt: 2 layers of 1000000 experts each: more than any model this reads"):
            MegatronArch.from_args({**args, "num_experts": 10**6}, "common.pt")


BAD_JSON = {"truncated": b'{"model_type": "llama", ', "not-utf8": b'{"model_type": "\xff\xfe"}',
            "nan": None}


@pytest.mark.parametrize("content", sorted(BAD_JSON))
@pytest.mark.parametrize("rel", ["model/config.json", "optimizer/state.json"])
def test_unparseable_json_with_matching_manifest(base, tmp_path, capsys, rel, content):
    src = copy(base / "uni1", tmp_path / "src")
    path = src / rel
    if content == "nan":  # a number replaced by NaN, which Python's json reads and JSON does not have
        text = path.read_text()
        text, n = re.subn(r'(:\s*)(\d+\.\d+(?:e-?\d+)?)', r"\1NaN", text, count=1)
        assert n == 1
        path.write_text(text)
    else:
        path.write_bytes(BAD_JSON[content])
    reseal(src, rel)
    for argv in (("convert", src, tmp_path / "out", "--to", "universal"), ("convert", src, tmp_path / "out", "--to", "hf")):
        code, _, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, Path(rel).name)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["hf-dir", "universal"])
def test_deeply_nested_safetensors_header(base, tmp_path, capsys, where):
    src = copy(base / ("hf" if where == "hf-dir" else "uni1"), tmp_path / "src")
    rel = "model.safetensors" if where == "hf-dir" else "model/model.safetensors"
    _, data = read_header(src / rel)
    nested = b"[" * 100000
    (src / rel).write_bytes(struct.pack("<Q", len(nested)) + nested + data)
    if where == "universal":
        reseal(src, rel)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, "model.safetensors")
    if where == "universal":
        code, out, err = run_cli(capsys, "verify", src, "-q")
        assert code == 1 and "Traceback" not in out + err, out + err


MANIFEST_BREAKS = {
    "deeply-nested": lambda path: path.write_text("[" * 100000),
    "files-is-a-list": lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "files": [1, 2]})),
    "tensors-is-a-string": lambda path: path.write_text(json.dumps({**json.loads(path.read_text()), "tensors": "x"})),
    # (an unexpected AttributeError in a reader that asked the name what it starts with)
    "optimizer-class-is-a-list": lambda path: path.write_text(json.dumps(
        {**(m := json.loads(path.read_text())), "optimizer": {**m["optimizer"], "class": ["AdamW"]}})),
}


@pytest.mark.parametrize("damage", sorted(MANIFEST_BREAKS))
def test_malformed_manifest(base, tmp_path, capsys, damage):
    src = copy(base / "uni", tmp_path / "src")
    MANIFEST_BREAKS[damage](src / "manifest.json")
    for argv in (("convert", src, tmp_path / "out", "--to", "universal"), ("inspect", src)):
        code, _, err = run_cli(capsys, *argv)
        assert_one_line_error(code, err, "manifest.json")
    code, out, err = run_cli(capsys, "verify", src)
    assert code == 1 and "manifest.json" in out and "Traceback" not in out + err, out + err
    assert not (tmp_path / "out").exists()


def test_manifest_step_nan_into_deepspeed(base, deepspeed_ready, tmp_path, capsys):
    src = copy(base / "uni1", tmp_path / "src")
    edit_manifest_json(src, lambda m: m.update(step=float("nan")))
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "deepspeed", "--world-size", "1",
                           "--zero-stage", "1")
    assert_one_line_error(code, err, "manifest.json")
    assert not (tmp_path / "out").exists()


def test_max_shard_size_that_is_not_a_size(base, tmp_path, capsys):
    code, out, err = run_cli(capsys, "convert", base / "uni", tmp_path / "out", "--to", "universal",
                             "--max-shard-size", "lots")
    assert code == 2 and "Traceback" not in out + err, err
    assert not (tmp_path / "out").exists()


FULL_DISK = """
import resource, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # writes past the limit fail (EFBIG), as they would on a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
from converters.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_a_write_that_fails_midway(base, tmp_path):
    """An output file that cannot be written whole (a full disk; here a file-size limit): one line naming the
    file, exit 2, no destination and no staging directory left."""
    result = subprocess.run([sys.executable, "-c", FULL_DISK, "convert", str(base / "uni"), str(tmp_path / "out"),
                             "--to", "accelerate", "--world-size", "1"], env=worker_env(), capture_output=True, text=True,
                            timeout=300, stdin=subprocess.DEVNULL)
    assert_one_line_error(result.returncode, result.stderr, str(tmp_path), words=["could not be written"])
    assert os.listdir(tmp_path) == []


def test_interrupt_while_starting(base, tmp_path):
    """SIGINT at points through the console script's start and its import of torch, which ``diff`` needs for the
    values and loads only then (torch's C initialisation swallows an interrupt raised inside it or aborts on it):
    one line (or, before Python itself is up, the signal's plain death), never a traceback, an abort or a run that
    goes on."""
    exe = shutil.which("interop") or pytest.fail("console script 'interop' is not installed")
    ends = ((-signal.SIGINT, []), (130, ["interop: interrupted; nothing was written"]),
            (130, ["interop diff: interrupted; nothing was committed"]))
    for delay in (0.15, 0.3, 0.45, 0.7):
        proc = subprocess.Popen([exe, "diff", str(base / "uni"), str(base / "hf")], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
        assert "Traceback" not in err, err
        assert (proc.returncode, err.strip().splitlines()) in ends, (delay, proc.returncode, err)


@pytest.mark.parametrize("weights", ["safetensors", "pytorch_model.bin"])
def test_trust_pickle_on_a_plain_hf_dir(base, tmp_path, capsys, weights):
    """--trust-pickle where nothing needs trusting (safetensors, or a pickle of plain tensors): works, or fails
    cleanly."""
    src = base / "hf"
    if weights == "pytorch_model.bin":
        from safetensors.torch import load_file

        src = tmp_path / "hf"
        src.mkdir()
        shutil.copy(base / "hf" / "config.json", src / "config.json")
        torch.save(load_file(str(base / "hf" / "model.safetensors")), src / "pytorch_model.bin")
    code, out, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal", "--trust-pickle")
    assert "Traceback" not in out + err, err
    assert code == 0 or one_line_error(code, err) is None, err


# =====================================================================================================
# trainers: resume verifies digests by default; --no-verify skips them (sizes still checked)
# =====================================================================================================
def base_trainer(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trainers.base", *args], env=worker_env(), capture_output=True,
                          text=True, timeout=600, cwd=ROOT, stdin=subprocess.DEVNULL)


def flipped_trainer_checkpoint(base, tmp_path) -> tuple[Path, str]:
    src = copy(base / "run" / "checkpoint-2", tmp_path / "src")
    rel = "components/optimizer.safetensors"
    flip(src / rel, (src / rel).stat().st_size - 3, 0x01)
    return src, rel


def test_trainer_resume_verifies_digests_by_default(base, tmp_path):
    src, rel = flipped_trainer_checkpoint(base, tmp_path)
    proc = base_trainer(tmp_path, "--tied", "--steps", "3", "--resume", str(src), "--output-dir", str(tmp_path / "out"))
    lines = trainer_error_lines(proc.stderr)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert len(lines) == 1 and "Traceback" not in proc.stderr and str(src / rel) in lines[0], proc.stderr[-3000:]
    assert committed(tmp_path / "out") == []


def test_trainer_no_verify_skips_digests_but_not_sizes(base, tmp_path):
    src, rel = flipped_trainer_checkpoint(base, tmp_path)
    proc = base_trainer(tmp_path, "--tied", "--steps", "3", "--resume", str(src), "--no-verify", "--output-dir", str(tmp_path / "a"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    truncated = src / "components" / "model.safetensors"
    truncated.write_bytes(truncated.read_bytes()[:-16])
    proc = base_trainer(tmp_path, "--tied", "--steps", "3", "--resume", str(src), "--no-verify", "--output-dir", str(tmp_path / "b"))
    lines = trainer_error_lines(proc.stderr)
    assert proc.returncode == 2 and len(lines) == 1 and "model.safetensors" in lines[0], proc.stderr[-3000:]


@pytest.mark.parametrize("module", [pytest.param("trainers.base", marks=pytest.mark.slow),  # every parser: test_every_trainer_flag_has_help
                                    pytest.param("trainers.hf_trainer", marks=pytest.mark.slow),
                                    pytest.param("trainers.deepspeed", marks=pytest.mark.slow),
                                    pytest.param("trainers.accelerate", marks=pytest.mark.slow)])
def test_trainer_flags_exist(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], env=engine_env(), capture_output=True, text=True,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "--trust-pickle" in proc.stdout and "--no-verify" in proc.stdout


# =====================================================================================================
# 6. concurrency: one writer per destination
# =====================================================================================================
def wait_for(predicate, proc: subprocess.Popen, timeout: float = 120) -> bool:
    """Poll until ``predicate()``; False if ``proc`` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        if proc.poll() is not None:
            return bool(predicate())
        time.sleep(0.002)
    raise AssertionError("timed out waiting for the first process")


def stop_and_run_second(first: subprocess.Popen, second_cmd, timeout: float = 300) -> subprocess.CompletedProcess:
    """With ``first`` stopped (SIGSTOP) mid-write, run the second command to the end; then let the first go on."""
    os.kill(first.pid, signal.SIGSTOP)
    try:
        return subprocess.run(second_cmd, env=worker_env(), capture_output=True, text=True, timeout=timeout,
                              cwd=ROOT, stdin=subprocess.DEVNULL)
    finally:
        os.kill(first.pid, signal.SIGCONT)


@pytest.fixture(scope="module")
def big_hf(tmp_path_factory):
    """A Hugging Face model big enough (about 50 MB) that converting it takes a moment."""
    import transformers

    out = tmp_path_factory.mktemp("big") / "hf"
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=512, intermediate_size=1376, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(out)
    return out


def test_two_converts_into_one_destination(big_hf, tmp_path, capsys):
    for attempt in range(4):
        parent = tmp_path / f"try{attempt}"
        parent.mkdir()
        dst = parent / "dst"
        cmd = [sys.executable, "-m", "converters.cli", "convert", str(big_hf), str(dst), "--to", "universal"]
        first = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT, stdin=subprocess.DEVNULL)
        try:
            staging = lambda: [n for n in os.listdir(parent) if n.startswith(".dst.") and n.endswith(".staging")]  # noqa: E731
            if not wait_for(staging, first) or first.poll() is not None:
                first.communicate()
                continue  # finished before it could be caught writing: try again
            second = stop_and_run_second(first, cmd)
            if not staging():  # it had published before it stopped
                first.communicate()
                continue
            out, err = first.communicate(timeout=300)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        codes = sorted([first.returncode, second.returncode])
        assert codes == [0, 2], f"first {first.returncode}: {err[-1500:]}\nsecond {second.returncode}: {second.stderr[-1500:]}"
        loser = second if second.returncode == 2 else first
        loser_err = loser.stderr if loser is second else err
        assert_one_line_error(2, loser_err, words=["another"])
        code, vout, _ = run_cli(capsys, "verify", dst, "-q")
        assert code == 0, vout
        assert not [n for n in os.listdir(parent) if n.endswith(".staging")]
        return
    pytest.fail("could not catch the first conversion while it was writing")


def test_two_trainers_on_one_output_dir(tmp_path, capsys):
    for steps in ("40", "400"):
        out = tmp_path / f"run{steps}"
        cmd = [sys.executable, "-m", "trainers.base", "--steps", steps, "--save-every", "10", "--output-dir", str(out)]
        first = subprocess.Popen(cmd, env=worker_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                 cwd=ROOT, stdin=subprocess.DEVNULL)
        try:
            wait_for(lambda: (out / "checkpoint-10" / "manifest.json").exists(), first)
            if first.poll() is not None:
                first.communicate()
                continue  # it finished before the second could start: a longer run
            second = stop_and_run_second(first, cmd)
            _, first_err = first.communicate(timeout=600)
        finally:
            if first.poll() is None:
                first.kill()
                first.wait()
        assert second.returncode != 0 and "another" in prose(second.stderr), second.stderr[-3000:]
        assert first.returncode == 0, first_err[-3000:]
        ckpts = committed(out)
        assert f"checkpoint-{steps}" in ckpts, ckpts
        for name in ckpts:
            code, vout, _ = run_cli(capsys, "verify", out / name, "-q")
            assert code == 0, vout
        return
    pytest.fail("the first trainer always finished before the second could start")


# =====================================================================================================
# 7. a killed save's leftovers are cleaned by the next save
# =====================================================================================================
def test_stale_latest_tmp_is_cleaned_by_the_next_save(tmp_path):
    trainer = BaseTrainer(TrainerConfig(steps=2, output_dir=str(tmp_path / "run"), tied=True))
    trainer.train(until=1)
    trainer.save()
    stale = tmp_path / "run" / f"latest.tmp{pid_that_is_not_running()}"
    stale.write_text("checkpoint-0\n")
    trainer.train()
    trainer.save()
    assert not stale.exists(), "a killed save's latest.tmp<pid> survived the next save"
    assert (tmp_path / "run" / "latest").read_text().strip() == "checkpoint-2"


# =====================================================================================================
# 8. a second adversarial review's findings (each refused now)
# =====================================================================================================
def test_files_planted_beside_a_committed_checkpoint_are_never_read(base, tmp_path, capsys):
    """An engine's files dropped at our checkpoint's root must not make it read as that engine's format: the
    checkpoint is checked against its manifest before any format looks at it."""
    src = copy(base / "run" / "checkpoint-2", tmp_path / "ckpt")
    shutil.copy(base / "hf" / "model.safetensors", src / "model.safetensors")
    shutil.copy(base / "hf" / "config.json", src / "config.json")
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, "model.safetensors")


@pytest.mark.parametrize("target", ["ds-universal", "universal"])
def test_names_from_the_source_never_steer_a_write(base, tmp_path, capsys, target):
    """Tensor names become DeepSpeed-universal folder names and optimizer state keys universal file stems: a
    name like '../../x' or '/abs/x' is refused and nothing is written outside DST."""
    from safetensors.torch import load_file, save_file

    src = copy(base / "hf", tmp_path / "box" / "src")
    weights = load_file(str(src / "model.safetensors"))
    if target == "ds-universal":
        weights["../../../escaped"] = torch.zeros(3)
        weights[str(tmp_path / "abs_escaped")] = torch.zeros(2)
        save_file(weights, str(src / "model.safetensors"), metadata={"format": "pt"})
    else:  # an optimizer state key, through a universal checkpoint whose state.json and manifest agree
        src = copy(base / "uni1", tmp_path / "box" / "uni")
        state_path = src / "optimizer" / "state.json"
        state = json.loads(state_path.read_text())
        state["state_keys"].append("../../escaped")
        state_path.write_text(json.dumps(state))
        reseal(src, "optimizer/state.json")
    before = snapshot(tmp_path)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "box" / "out", "--to", target)
    assert snapshot(tmp_path) == before, "convert wrote something"
    assert code == 2 and "Traceback" not in err, err
    assert not list(tmp_path.rglob("*escaped*"))


def test_a_tag_file_linked_outside_is_not_read(base, tmp_path, capsys):
    secret = tmp_path / "secret.txt"
    secret.write_text("secret-token-123")
    run = copy(base / "run", tmp_path / "run")
    (run / "latest").unlink()
    (run / "latest").symlink_to(secret)
    for argv in (("verify", run), ("inspect", run), ("convert", run, tmp_path / "out", "--to", "universal")):
        code, out, err = run_cli(capsys, *argv)
        assert "secret-token" not in out + err and code in (1, 2) and "Traceback" not in err, (argv, out, err)


def test_an_index_leading_outside_through_a_linked_directory_is_not_read(base, tmp_path, capsys):
    src = copy(base / "uni", tmp_path / "ck" / "uni")
    outside = tmp_path / "ck" / "outside"
    shutil.move(src / "model", outside)
    index = json.loads((outside / "model.safetensors.index.json").read_text())
    index["marker"] = "OUTSIDE-CONTENT"
    (outside / "model.safetensors.index.json").write_text(json.dumps(index))
    (src / "model").symlink_to(outside)
    code, out, err = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and "OUTSIDE-CONTENT" not in out + err, out
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path / "ck", words=["outside"])


def test_a_special_file_in_a_checkpoint_never_blocks(base, tmp_path, capsys):
    """A pipe where a file should be: refused at once, never opened (opening a FIFO would wait forever)."""
    uni = copy(base / "uni", tmp_path / "uni")
    (uni / "model" / "model.safetensors.index.json").unlink()
    os.mkfifo(uni / "model" / "model.safetensors.index.json")
    code, out, _ = run_cli(capsys, "verify", uni, "-q")
    assert code == 1 and "not a regular file" in out, out
    dcp = tmp_path / "dcp"
    assert main(["convert", str(base / "uni1"), str(dcp), "--to", "dcp"]) == 0
    capsys.readouterr()
    data = next(p for p in dcp.iterdir() if p.suffix == ".distcp")
    data.unlink()
    os.mkfifo(data)
    code, _, err = run_cli(capsys, "convert", dcp, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, data.name, words=["regular"])


def test_a_checkpoint_without_its_manifest_is_not_read_as_an_engine_directory(base, tmp_path, capsys):
    """Our checkpoint with its manifest removed, or a staging directory: refused, not read as the bare engine
    directory inside it (which would drop the digests and the carried components)."""
    src = copy(base / "run" / "checkpoint-2", tmp_path / "checkpoint-2.staging")
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, words=["staging"])
    (src / "manifest.json").unlink()
    renamed = src.rename(tmp_path / "checkpoint-2")
    code, _, err = run_cli(capsys, "convert", renamed, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, "checkpoint-2", words=["manifest"])


def test_a_flip_in_a_header_s_metadata_is_caught_by_convert(base, tmp_path, capsys):
    src = copy(base / "uni1", tmp_path / "uni")
    header, data = read_header(src / "model" / "model.safetensors")
    header["__metadata__"] = {"format": "pu"}  # same length: only the file digest can tell
    write_header(src / "model" / "model.safetensors", header, data)
    code, _, err = run_cli(capsys, "convert", src, tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, "model.safetensors", words=["digest"])


def test_dcp_metadata_cannot_change_a_class(tmp_path, capsys):
    """BUILD on a class object (not an instance) would set attributes of DCP's own Metadata class for the
    rest of the process, even though the file is then refused."""
    import pickle as _pickle
    import pickletools

    from torch.distributed.checkpoint.metadata import Metadata

    from converters.dcp import _STUB_CLASSES, read_metadata

    body = (_pickle.PROTO + b"\x04" + _pickle.GLOBAL + b"torch.distributed.checkpoint.metadata\nMetadata\n"
            + _pickle.EMPTY_DICT + _pickle.SHORT_BINUNICODE + b"\x08poisoned" + _pickle.BININT1 + b"\x01"
            + _pickle.SETITEM + _pickle.BUILD + _pickle.STOP)
    pickletools.dis(body, out=open(os.devnull, "w"))  # a well-formed pickle
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / ".metadata").write_bytes(body)
    code, _, err = run_cli(capsys, "convert", tmp_path / "dcp", tmp_path / "out", "--to", "universal")
    assert_one_line_error(code, err, ".metadata")
    assert not hasattr(Metadata, "poisoned")
    with pytest.raises(InteropError, match=r"\.metadata"):  # DCP's own types, for its loader (a resume)
        read_metadata(str(tmp_path / "dcp"))
    assert not hasattr(Metadata, "poisoned")
    assert not any(hasattr(stub, "poisoned") for stub in _STUB_CLASSES.values())  # nor the reader's stand-ins


def test_an_extra_empty_directory_is_caught(base, tmp_path, capsys):
    src = copy(base / "uni1", tmp_path / "uni")
    (src / "model" / "model.safetensors.index.json").mkdir()
    code, out, _ = run_cli(capsys, "verify", src, "-q")
    assert code == 1 and "model.safetensors.index.json" in out, out
    assert_convert_refused(capsys, src, tmp_path / "out", tmp_path, "model.safetensors.index.json")


def test_init_from_reads_the_directory_as_transformers_will(base, tmp_path):
    """--init-from a directory that also looks like DCP, whose index leads outside: refused (it is read as
    the Hugging Face directory transformers loads); and a config asking for its own code (auto_map) never
    runs that code."""
    init = copy(base / "hfs", tmp_path / "ck" / "init")
    assert main(["convert", str(base / "uni1"), str(tmp_path / "dcp"), "--to", "dcp"]) == 0
    for p in (tmp_path / "dcp").iterdir():
        if p.is_file() and p.name != "manifest.json":  # DCP's own files (and the config.json beside them)
            shutil.copy(p, init / p.name)
    index = json.loads((init / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "ck" / "outside").mkdir()
    shutil.move(init / shard, tmp_path / "ck" / "outside" / shard)
    index["weight_map"] = {k: (f"../outside/{shard}" if v == shard else v) for k, v in index["weight_map"].items()}
    (init / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(InteropError, match="outside"):
        BaseTrainer(TrainerConfig(init_from=str(init), steps=1, output_dir=str(tmp_path / "run")))
    remote = copy(base / "hf", tmp_path / "remote")
    config = json.loads((remote / "config.json").read_text())
    config.update(model_type="evil", auto_map={"AutoConfig": "configuration_evil.EvilConfig"})
    (remote / "config.json").write_text(json.dumps(config))
    marker = tmp_path / "ran"
    (remote / "configuration_evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\n")
    proc = subprocess.run([sys.executable, "-m", "trainers.base", "--steps", "1", "--init-from", str(remote),
                           "--output-dir", str(tmp_path / "run2")], env=dict(worker_env(), HF_HOME=str(tmp_path / "hf_home")),
                          capture_output=True, text=True, timeout=300, input="y\n", cwd=ROOT)
    assert not marker.exists(), "the checkpoint's own code ran"
    assert proc.returncode == 2 and len(trainer_error_lines(proc.stderr)) == 1, proc.stderr[-2000:]
    assert "auto_map" in proc.stderr


def test_convert_into_a_running_trainer_s_directory_is_refused(base, tmp_path, capsys):
    """A trainer holds its output directory: a conversion with --overwrite into it, or into a directory inside
    it, is refused while the run lives, and the run's checkpoints stay as they were."""
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time\nfrom interop import locking\n"
                               f"locking.claim({str(tmp_path / 'run' / '.interop.lock')!r}, 'run')\nprint('held', flush=True)\ntime.sleep(120)"],
                              env=worker_env(), stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        (tmp_path / "run").mkdir()
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(tmp_path / "run")
        for dst in (tmp_path / "run", tmp_path / "run" / "inner"):
            code, _, err = run_cli(capsys, "convert", base / "uni1", dst, "--to", "universal", "--overwrite")
            assert_one_line_error(code, err, words=["another"])
        assert snapshot(tmp_path / "run") == before
    finally:
        holder.kill()
        holder.wait()
