"""Every command block of README.md runs as written, in order, from the root of a fresh copy of the repository,
exits 0, prints what it promises and leaves nothing outside ``out/``.

Each ```bash block carries a marker on the line above it, ``<!-- readme-block: NAME [slow|skip (why)] [after
NAME,...] -->``; a block without one fails here, so a new block is classified when it is written. ``after``
names the earlier blocks whose output it starts from (as a reader's shell has it): a block whose prerequisites
were not selected runs them first. The default run takes the base trainer's block (a run stopped, resumed,
exported to Hugging Face and started from it again); ``-m slow`` the others, in README order, in one copy."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from .conftest import ROOT

pytestmark = pytest.mark.dist

MARKER = re.compile(r"<!-- readme-block: (?P<name>[\w-]+)(?: (?P<kind>slow|skip)(?: \((?P<why>[^)]*)\))?)?"
                    r"(?: after (?P<after>[\w,-]+))? -->")
# what a block may leave besides out/: the install line's environment and Python's caches (all in .gitignore)
LEFT_BY_INSTALLS = re.compile(r"^!! (\.venv/|[\w./-]*__pycache__/|[\w.-]+\.egg-info/|\.pytest_cache/)")


@dataclass
class Block:
    name: str
    kind: str  # "default", "slow" or "skip"
    line: int
    script: str
    after: tuple[str, ...] = ()


def readme_blocks(text: str) -> list[Block]:
    """The README's bash blocks with their markers; a bash block without a marker is an error."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != "```bash":
            continue
        marker = MARKER.fullmatch(lines[i - 1].strip()) if i else None
        if marker is None:
            raise AssertionError(f"README.md:{i + 1}: a bash block without a '<!-- readme-block: NAME [slow|skip (why)] -->' line above it")
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
        after = tuple(filter(None, (marker["after"] or "").split(",")))
        blocks.append(Block(marker["name"], marker["kind"] or "default", i + 1, "\n".join(lines[i + 1 : end]) + "\n", after))
    return blocks


BLOCKS = readme_blocks((ROOT / "README.md").read_text(encoding="utf-8"))
RAN: dict[Path, set[str]] = {}  # the blocks run so far in each copy


def summaries(stdout: str) -> dict[str, dict]:
    """Each trainer's closing JSON line, by its output directory."""
    found = {}
    for line in stdout.splitlines():
        if line.startswith('{"step"'):
            summary = json.loads(line)
            found[summary["config"]["output_dir"]] = summary
    return found


def continues(resumed: dict, source: dict) -> None:
    """The resumed run's losses are the source run's over the same steps (float rounding between engines)."""
    first = resumed["step"] - len(resumed["losses"]) + 1
    expected = source["losses"][first - 1 : resumed["step"]]
    assert resumed["losses"] and len(expected) == len(resumed["losses"]), (source, resumed)
    for a, b in zip(expected, resumed["losses"]):
        assert abs(a - b) <= 1e-5 * abs(a), (expected, resumed["losses"])


def check_demo(out: str, copy: Path) -> None:
    assert "demo OK" in out


def check_moving_a_run(out: str, copy: Path) -> None:
    runs = summaries(out)
    for resumed in ("out/fsdp2-from-zero2", "out/tp2-from-zero2", "out/hf-from-zero2"):
        continues(runs[resumed], runs["out/zero2"])
    for loads_with in ("accelerator.load_state('out/zero2-as-fsdp2')", "python -m trainers.megatron --resume out/zero2-as-tp2",
                       "transformers.AutoModelForCausalLM.from_pretrained('out/zero2-model')",
                       "engine.load_checkpoint('out/finetune-zero1')"):
        assert f"load it with: {loads_with}\n" in out, loads_with
    assert "OK: largest relative difference" in out


def check_spread_convert(out: str, copy: Path) -> None:
    for dst in ("out/spread-universal", "out/spread-hf"):
        assert out.count(f"-> {dst} (") == 1, out  # one process speaks for the four
    from interop.verify import verify_checkpoint

    assert verify_checkpoint(str(copy / "out/spread-universal"))[1] == []
    assert (copy / "out/spread-hf/model.safetensors").is_file()


def check_base_trainer(out: str, copy: Path) -> None:
    runs = summaries(out)
    assert runs["out/base"]["step"] == 8 and len(runs["out/base"]["losses"]) == 4
    assert runs["out/base-finetune"]["config"]["init_from"] == "out/base-model"
    assert (copy / "out/base-model/model.safetensors").is_file()


def check_deepspeed(out: str, copy: Path) -> None:
    runs = summaries(out)
    assert runs["out/deepspeed"]["step"] == 8 and runs["out/zero3"]["step"] == 4
    assert runs["out/zero1"]["step"] == 8 and len(runs["out/zero1"]["losses"]) == 4
    assert any(name.endswith((".bin", ".safetensors")) for name in os.listdir(copy / "out/deepspeed-fp32"))


def check_accelerate(out: str, copy: Path) -> None:
    runs = summaries(out)
    continues(runs["out/fsdp2-from-ddp"], runs["out/ddp"])
    assert {"out/fsdp2-bf16", "out/powersgd", "out/local-sgd"} <= set(runs)
    assert (copy / "out/fsdp2-bf16-merged/model.safetensors").is_file()


def check_hf_trainer(out: str, copy: Path) -> None:
    runs = summaries(out)
    continues(runs["out/hf-resumed"], runs["out/hf"])
    assert runs["out/hf-from-zero3"]["step"] == 8 and len(runs["out/hf-from-zero3"]["losses"]) == 4


def check_megatron_trainer(out: str, copy: Path) -> None:
    runs = summaries(out)
    continues(runs["out/pp2-from-tp2"], runs["out/tp2"])
    assert {"out/pp2", "out/tp2pp2"} <= set(runs)


def check_megatron_lm(out: str, copy: Path) -> None:
    assert "load it with: Megatron-LM" in out
    assert (copy / "out/meg/iter_0000000/mp_rank_01_001/model_optim_rng.pt").is_file()
    assert (copy / "out/meg-tp2/iter_0000000/mp_rank_01/model_optim_rng.pt").is_file()
    assert re.search(r"\b0 different\b", out), out[-2000:]


def check_benchmarks(out: str, copy: Path) -> None:
    assert re.search(r"^step +wall s +peak RSS +speed-up +RSS ratio$", out, re.M), out[-2000:]
    assert re.search(r" is compared with ", out), out[-2000:]


CHECKS = {
    "demo": check_demo,
    "moving-a-run": check_moving_a_run,
    "base-trainer": check_base_trainer,
    "deepspeed": check_deepspeed,
    "accelerate": check_accelerate,
    "hf-trainer": check_hf_trainer,
    "megatron-trainer": check_megatron_trainer,
    "megatron-lm": check_megatron_lm,
    "benchmarks": check_benchmarks,
    "spread-convert": check_spread_convert,
    "benchmark-hf": check_benchmarks,
    "benchmark-engines": check_benchmarks,
    "benchmark-megatron": check_benchmarks,
}


def test_every_block_is_classified_and_checked():
    names = [b.name for b in BLOCKS]
    assert len(names) == len(set(names)), names
    for i, block in enumerate(BLOCKS):  # a prerequisite is an earlier block, as a reader meets it
        assert set(block.after) <= set(names[:i]), (block.name, block.after)
    assert {b.name for b in BLOCKS if b.kind != "skip"} == set(CHECKS)
    assert all(b.kind != "default" or b.name in CHECKS for b in BLOCKS)


@pytest.fixture(scope="module")
def copy(tmp_path_factory) -> Path:
    """The working tree as a fresh clone would have it (tracked and untracked-but-not-ignored files), as a git
    repository, so that what a block leaves behind shows in ``git status``."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    dest = tmp_path_factory.mktemp("readme") / "interop"
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():  # a tracked file deleted in the working tree is gone from the copy too
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    git = ["git", "-c", "user.name=readme", "-c", "user.email=readme@test", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
    subprocess.run(git + ["add", "-A"], cwd=dest, check=True)
    subprocess.run(git + ["commit", "-qm", "copy"], cwd=dest, check=True)
    RAN[dest] = set()
    return dest


def block_env() -> dict[str, str]:
    """A user's shell with this environment's tools on PATH (the install line has run)."""
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    env.pop("PYTHONPATH", None)
    env["PATH"] = os.pathsep.join([os.path.dirname(sys.executable), env.get("PATH", "")])
    env["PYTHONUNBUFFERED"] = "1"
    return env


def run_block(block: Block, copy: Path) -> str:
    result = subprocess.run(["bash", "-euo", "pipefail", "-c", block.script], cwd=copy, env=block_env(),
                            capture_output=True, text=True, timeout=3600, stdin=subprocess.DEVNULL)
    assert result.returncode == 0, f"README.md:{block.line} ({block.name}) exit {result.returncode}\n" \
                                   f"{result.stdout[-3000:]}\n{result.stderr[-5000:]}"
    status = subprocess.run(["git", "status", "--porcelain", "--ignored", "--untracked-files=normal"], cwd=copy,
                            capture_output=True, text=True, check=True).stdout
    left = [line for line in status.splitlines() if line != "!! out/" and not LEFT_BY_INSTALLS.match(line)]
    assert not left, f"README.md:{block.line} ({block.name}) left files outside out/:\n" + "\n".join(left)
    return result.stdout


def params():
    for block in BLOCKS:
        if block.kind == "skip":
            continue
        marks = [pytest.mark.slow] if block.kind == "slow" else []
        yield pytest.param(block, marks=marks, id=block.name)


@pytest.mark.parametrize("block", list(params()))
def test_readme_block_runs_as_written(block, copy):
    by_name = {b.name: b for b in BLOCKS}
    for name in block.after:  # not selected in this session (-m, -k): run first, as the reader did
        if name not in RAN[copy]:
            run_block(by_name[name], copy)
            RAN[copy].add(name)
    CHECKS[block.name](run_block(block, copy), copy)
    RAN[copy].add(block.name)
