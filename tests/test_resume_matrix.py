"""The any-to-any resume matrix on real engines and real process groups (see tests/resume_matrix.py): a slice in
CI that has every engine as a source and as a target once, and every pair under ``-m slow``."""

from __future__ import annotations

import pytest

from .resume_matrix import ALL_SOURCES, Result, all_pairs, make_source, run_pair

pytestmark = pytest.mark.dist

# Converted with `interop convert`: Megatron-style TP2xPP2 as a target (2 -> 4 ranks) and FSDP2 as a source; the
# Megatron-style trainer as a source is test_megatron_trainer.py's and test_expert_parallel.py's (EP2 into the
# Trainer), and TP2xPP2 -> Trainer (4 ranks -> 1) runs under -m slow with the grid (the suite's time); ZeRO and
# accelerate as targets of a conversion are test_deepspeed.py's and
# test_accelerate.py's (and the demo's); the slice's ZeRO-3 source goes into DDP directly below. The MoE pairs
# (a Mixtral trained by ZeRO-3 into the Megatron-style trainer with its experts over 2 ranks, and the rest) run
# under -m slow for the suite's time: an EP2 run resumed at EP1 and in the Trainer is test_expert_parallel.py's,
# accelerate's fused experts read and written back test_architectures.py's, megatron-core's MoE run resumed
# through universal test_megatron_moe.py's; the Trainer's strict=False load of a MoE: test_moe.py.
# The whole grid (81 pairs, 16 MoE pairs and 20 LoRA pairs) under -m slow.
# A LoRA run (peft, r=4: frozen base, adapters and their Adam moments) moves ZeRO-3 -> FSDP2 by conversion, and
# ZeRO-3 -> transformers' Trainer by a direct resume (below), each against the source's losses; the 20 LoRA pairs
# (ZeRO-1, ZeRO-3, FSDP2 and DDP into ZeRO-2/3, FSDP2, DDP and the Trainer) under -m slow.
# (ZeRO-3 -> FSDP2 of the LoRA run by conversion runs under -m slow for the suite's time: the LoRA run's resume
# into the Trainer below is the default run's LoRA pair.)
CI_SLICE = [("fsdp2", "tp2pp2")]


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    work = tmp_path_factory.mktemp("matrix")
    made = {}

    def get(key: str):
        if key not in made:
            made[key] = make_source(key, work)
        return made[key]

    get.work = work
    return get


def check(result: Result) -> None:
    assert result.ok, f"{result.source} -> {result.target}: {result.error}"
    rank_change = ALL_SOURCES[result.source].nproc != _target_nproc(result)
    # DCP written offline is for no number of ranks: its load is no world-size change to report
    assert not any("component 'dcp': saved by" in n for n in result.notes), result.notes
    if rank_change and not result.source.startswith("hf"):  # a Hugging Face model has no RNG state to lose
        assert any("rng" in n.lower() and ("reseed" in n or "fresh" in n) for n in result.notes), result.notes


def _target_nproc(result: Result) -> int:
    from .resume_matrix import target_layout

    return target_layout(result.source, result.target).nproc


@pytest.mark.parametrize(("src", "dst"), CI_SLICE, ids=[f"{s}-to-{d}" for s, d in CI_SLICE])
def test_resume_continues_the_source_run(source, src, dst):
    """One `interop convert`, `interop verify` on its output, a resume in the target's trainer: the next
    losses are the source run's own to float rounding, and what could not be kept is in the manifest."""
    check(run_pair(source(src), dst, source.work))


FULL = [p for p in all_pairs() if p not in CI_SLICE]


@pytest.mark.slow
@pytest.mark.parametrize(("src", "dst"), FULL, ids=[f"{s}-to-{d}" for s, d in FULL])
def test_full_matrix(source, src, dst):
    check(run_pair(source(src), dst, source.work))


# Every trainer's --resume takes a checkpoint of any format and converts it in-process (rank 0, into a scratch
# directory it removes): ZeRO from FSDP2, DDP from ZeRO-3 and transformers' Trainer from a ZeRO-3 LoRA run
# here; the Megatron-style trainer from universal in test_megatron_trainer.py.
# (Megatron-style TP2xPP2 into the Trainer directly, under -m slow: the Trainer's in-process conversion is the LoRA
# pair's here, and TP2xPP2 -> Trainer by `interop convert` is in the slice above)
# (ZeRO-3 -> DDP and the ZeRO-3 LoRA run -> Trainer under -m slow too: DDP's load_state of our output is in
# test_accelerate.py's fsdp2 -> ddp1 resume, LoRA resumes in test_peft.py)
DIRECT = [("fsdp2", "ds-z2")]
DIRECT_SLOW = [("ds-z3", "ddp"), ("ds-z3@lora", "hf-trainer@lora"), ("fsdp2@moe", "ds-z3@moe"), ("tp2pp2", "hf-trainer")]


@pytest.mark.parametrize(("src", "dst"), DIRECT, ids=[f"{s}-to-{d}" for s, d in DIRECT])
def test_resume_directly_from_another_format(source, src, dst):
    check(run_pair(source(src), dst, source.work, direct=True))


@pytest.mark.slow
@pytest.mark.parametrize(("src", "dst"), DIRECT_SLOW, ids=[f"{s}-to-{d}" for s, d in DIRECT_SLOW])
def test_resume_directly_from_another_format_slow(source, src, dst):
    check(run_pair(source(src), dst, source.work, direct=True))
