"""The any-to-any resume matrix: a checkpoint of one engine and layout, one ``interop convert``, and a resume
in another engine's trainer at another layout, whose next losses must equal the source run's own.

Used by ``tests/test_resume_matrix.py`` (a slice in CI, every pair under ``-m slow``) and, as a script, to
regenerate the table in ``docs/resume-matrix.md``:

    python -m tests.resume_matrix --out docs/resume-matrix.md [--pairs ds-z2:fsdp2,tp2:ds-z3]

Every run uses the same tiny Llama, data order, AdamW and schedule (``--batch-size`` is the global batch in
every trainer), so an engine's losses equal another's to float rounding. A source trains 4 steps and saves
at steps 2 and 4; the converted step-2 checkpoint resumes in the target, whose losses at steps 3 and 4 are
compared with the source's. The Hugging Face source is a model directory (weights only, step 0); its
reference is the single-process trainer started from it with ``--init-from``.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from trainers.launch import LaunchError, launch, run_processes

ROOT = Path(__file__).resolve().parent.parent
STEPS, SAVED_AT = 4, 2
RUN = ("--steps", str(STEPS), "--batch-size", "4", "--seq-len", "16")
HF_SEED = 7  # the Hugging Face source's weights differ from every trainer's own initial model (seed 1234)
REL = 1e-5  # float rounding: engines sum gradients and shards in different orders


@dataclass(frozen=True)
class Layout:
    """One engine at one layout: how its trainer is launched, and how ``interop convert`` writes for it."""

    key: str
    label: str
    module: str  # the trainer, run under torchrun
    nproc: int
    flags: tuple[str, ...] = ()
    to: tuple[str, ...] = ()  # `interop convert ... --to ...` flags producing this layout's checkpoint

    @property
    def engine(self) -> str:
        return self.key.split("@")[0]


def _ds(stage: int, world: int = 2) -> Layout:
    return Layout(f"ds-z{stage}", f"DeepSpeed ZeRO-{stage} x{world}", "trainers.deepspeed", world, ("--zero-stage", str(stage)),
                  ("--to", "deepspeed", "--world-size", str(world), "--zero-stage", str(stage)))


def _accelerate(fsdp: bool, world: int = 2) -> Layout:
    return Layout("fsdp2" if fsdp else "ddp", f"Accelerate {'FSDP2' if fsdp else 'DDP'} x{world}", "trainers.accelerate", world,
                  ("--fsdp",) if fsdp else (), ("--to", "accelerate", "--world-size", str(world)) + (("--fsdp",) if fsdp else ()))


def _megatron(key: str, tp: int, pp: int, dp: int = 1, ep: int = 1) -> Layout:
    label = " x ".join(f"{n}{s}" for n, s in (("DP", dp), ("TP", tp), ("PP", pp), ("EP", ep)) if s > 1)
    flags = ("--tp", str(tp), "--pp", str(pp)) + (("--microbatches", "2") if pp > 1 else ()) + (("--ep", str(ep)) if ep > 1 else ())
    return Layout(key, f"Megatron-style {label}", "trainers.megatron", dp * tp * pp, flags, ("--to", "interop-dcp"))


HF = Layout("hf", "Hugging Face model", "trainers.base", 1, (), ("--to", "hf"))
HF_TRAINER = Layout("hf-trainer", "Hugging Face Trainer x1", "trainers.hf_trainer", 1, (), ("--to", "hf-trainer"))

SOURCES: dict[str, Layout] = {
    layout.key: layout
    for layout in (_ds(1), _ds(2), _ds(3), _accelerate(False), _accelerate(True),
                   _megatron("tp2", 2, 1), _megatron("pp2", 1, 2), _megatron("tp2pp2", 2, 2), HF)
}
TARGETS: dict[str, Layout] = {**{k: v for k, v in SOURCES.items() if k != "hf"}, "hf-trainer": HF_TRAINER}
ENGINE_TARGETS = list(TARGETS)  # Hugging Face as a target: transformers' Trainer, resuming its own checkpoint format

# The same runs on a tiny Mixtral (the Llama's MLP as 4 experts, 2 per token: one fused expert tensor per layer in
# the engines, one tensor per expert in universal and Hugging Face files), key "<layout>@moe"
MOE_FLAGS = ("--model", "mixtral")


def _moe(layout: Layout) -> Layout:
    return replace(layout, key=f"{layout.key}@moe", label=f"{layout.label}, Mixtral", flags=layout.flags + MOE_FLAGS)


# the Megatron-style trainer with its experts split over 2 expert-parallel ranks (token all-to-all on gloo);
# resumed by itself, it runs 4 ranks with 1 expert each (EP 4)
EP2 = _megatron("ep2", 1, 1, dp=2, ep=2)
MOE_SOURCES: dict[str, Layout] = {m.key: m for m in map(_moe, (SOURCES["ds-z3"], SOURCES["fsdp2"], EP2, HF))}
MOE_TARGETS: dict[str, Layout] = {m.key: m for m in map(_moe, (TARGETS["ds-z3"], TARGETS["fsdp2"], EP2, HF_TRAINER))}
# LoRA runs: every trainer wraps the tiny Llama with peft's LoRA (r=4 on q_proj and v_proj), the base frozen; key
# "<layout>@lora". What moves is the frozen base, the adapters and the adapters' Adam moments.
LORA_FLAGS = ("--lora-rank", "4", "--lora-alpha", "8")


def _lora(layout: Layout) -> Layout:
    return replace(layout, key=f"{layout.key}@lora", label=f"{layout.label}, LoRA", flags=layout.flags + LORA_FLAGS)


LORA_SOURCES: dict[str, Layout] = {m.key: m for m in map(_lora, (SOURCES["ds-z1"], SOURCES["ds-z3"], SOURCES["fsdp2"], SOURCES["ddp"]))}
LORA_TARGETS: dict[str, Layout] = {m.key: m for m in map(_lora, (TARGETS["ds-z2"], TARGETS["ds-z3"], TARGETS["fsdp2"], TARGETS["ddp"], HF_TRAINER))}
ALL_SOURCES = {**SOURCES, **MOE_SOURCES, **LORA_SOURCES}
ALL_TARGETS = {**TARGETS, **MOE_TARGETS, **LORA_TARGETS}


def target_layout(source: str, target: str) -> Layout:
    """``target``'s layout for a resume from ``source``: its usual one, or, for the same engine and layout,
    another world size (ZeRO and accelerate on 1 process, Megatron with a second data-parallel replica)."""
    if target.endswith("@moe"):
        return _moe(target_layout(source.removesuffix("@moe"), target.removesuffix("@moe")))
    if target.endswith("@lora"):
        return _lora(target_layout(source.removesuffix("@lora"), target.removesuffix("@lora")))
    if target == EP2.key:
        return EP2 if source != target else _megatron("ep2", 1, 1, dp=4, ep=4)
    if source != target:
        return TARGETS[target]
    if target.startswith("ds-z"):
        return _ds(int(target[-1]), world=1)
    if target in ("ddp", "fsdp2"):
        return _accelerate(target == "fsdp2", world=1)
    layout = SOURCES[target]
    tp, pp = int(layout.flags[1]), int(layout.flags[3])
    return _megatron(target, tp, pp, dp=2)


def all_pairs() -> list[tuple[str, str]]:
    return ([(s, t) for s in SOURCES for t in ENGINE_TARGETS] + [(s, t) for s in MOE_SOURCES for t in MOE_TARGETS]
            + [(s, t) for s in LORA_SOURCES for t in LORA_TARGETS])


# --- running ---------------------------------------------------------------------------------------------


# what the engines print when a trainer does not keep them quiet (it does, unless --verbose): DeepSpeed's logger
# and its op builder's print, accelerate's line per saved file, Python warnings (torch's deprecations)
ENGINE_NOISE = re.compile(r"\[WARNING\]|\[INFO\]|^INFO (accelerate|DeepSpeed|transformers)|built successfully|Warning: |warnings.warn")


def train(layout: Layout, out: Path, *extra: str) -> list[float]:
    """Launch ``layout``'s trainer under torchrun; the losses of the steps this run trained. The run prints
    its own lines only."""
    summary = launch(layout.module, layout.nproc, [*RUN, *layout.flags, "--output-dir", str(out), *extra])
    noise = [line for line in summary.log.splitlines() if ENGINE_NOISE.search(line)]
    if noise:
        raise AssertionError(f"{layout.module}: library output in a run without --verbose: {noise[:5]}")
    return summary.losses


def interop(*args: str) -> subprocess.CompletedProcess:
    return run_processes([sys.executable, "-m", "converters.cli", *args], timeout=600)


@dataclass
class Source:
    layout: Layout
    checkpoint: Path  # what is converted
    reference: list[float]  # the losses a resume must reproduce: steps 3-4 (the HF source: steps 1-4)
    universal: Path | None = None  # the checkpoint as a universal one: what every round trip must give back


def make_source(key: str, work: Path) -> Source:
    layout = ALL_SOURCES[key]
    out = work / f"source-{key}"
    if layout.engine == "hf":
        source = _hf_source(out, layout)
    else:
        losses = train(layout, out, "--save-every", str(SAVED_AT))
        source = Source(layout, out / f"checkpoint-{SAVED_AT}", losses[SAVED_AT:])
    source.universal = out / "universal"
    interop("convert", str(source.checkpoint), str(source.universal), "--to", "universal", "--overwrite")
    return source


# `interop diff` of two universal checkpoints checks each tensor against the digest its manifest records and
# compares those digests; no engine is imported (asserted), however the tensors travelled in between
DIFF_WITHOUT_ENGINES = """
import sys
from converters.cli import main
code = main(sys.argv[1:])
engines = sorted(m for m in ("deepspeed", "accelerate", "megatron", "transformers") if m in sys.modules)
assert not engines, f"diff imported {engines}"
sys.exit(code)
"""


def round_trip_is_lossless(source: Source, converted: Path, work: Path) -> None:
    """A -> universal and A -> B -> universal hold the same bytes (weights only from a model: B adds AdamW's
    initial state for engines that need it)."""
    back = work / f"{converted.name}--universal"
    interop("convert", str(converted), str(back), "--to", "universal", "--overwrite")
    model_only = ["--model-only"] if source.layout.engine == "hf" else []
    done = run_processes([sys.executable, "-c", DIFF_WITHOUT_ENGINES, "diff", str(source.universal), str(back), *model_only], timeout=600)
    summary = next(line for line in done.stdout.splitlines() if " compared, " in line)
    if "0 different; 0 only in A, 0 only in B" not in summary or " 0 exact" in summary:
        raise AssertionError(f"round trip through {converted.name} changed something: {summary}")


def _hf_source(out: Path, layout: Layout = HF) -> Source:
    """A Hugging Face model directory, and the single-process trainer's losses fine-tuning from it."""
    import torch
    import transformers

    from trainers.base import tiny_config

    torch.manual_seed(HF_SEED)
    transformers.AutoModelForCausalLM.from_config(tiny_config("mixtral" if layout.key.endswith("@moe") else "llama")).save_pretrained(out / "model")
    losses = train(layout, out / "run", "--init-from", str(out / "model"))
    return Source(layout, out / "model", losses)


@dataclass
class Result:
    source: str
    target: str
    target_label: str
    ok: bool = False
    losses: list[float] = field(default_factory=list)
    reference: list[float] = field(default_factory=list)
    max_rel: float | None = None
    notes: list[str] = field(default_factory=list)  # what the conversion and the resume said they could not keep
    error: str | None = None
    seconds: float = 0.0


def run_pair(source: Source, target_key: str, work: Path, direct: bool = False) -> Result:
    """Convert ``source`` for ``target_key``'s layout with one ``interop convert``, verify the output, resume
    the target's trainer from it, and compare its losses with the source's. ``direct``: the target's trainer
    resumes from the source checkpoint itself (and converts it in-process)."""
    target = target_layout(source.layout.key, target_key)
    result = Result(source.layout.key, target_key, target.label, reference=source.reference)
    start = time.perf_counter()
    converted = work / f"{source.layout.key}--{target_key}"
    try:
        if direct:
            out = work / f"direct-{source.layout.key}--{target_key}"
            result.losses = train(target, out, "--resume", str(source.checkpoint))
            left = [p.name for p in out.iterdir() if p.name.startswith(".import-")]
            if left:
                raise AssertionError(f"the in-process conversion's scratch was left in {out}: {left}")
            saved = json.loads((out / f"checkpoint-{STEPS}" / "manifest.json").read_text())
            if any(".import-" in n for n in saved.get("notes", [])):
                raise AssertionError(f"a note names the removed scratch copy, not {source.checkpoint}: {saved['notes']}")
            result.notes += saved.get("notes", [])
            return _compared(result, start)
        done = interop("convert", str(source.checkpoint), str(converted), *target.to, "--overwrite")
        result.notes += [line.removeprefix("note: ") for line in done.stdout.splitlines() if line.startswith("note: ")]
        interop("verify", str(converted), "--quiet")
        round_trip_is_lossless(source, converted, work)
        from interop.commit import resolve_checkpoint_dir  # an engine's tag file may lead to our manifest

        manifest = json.loads((Path(resolve_checkpoint_dir(str(converted))) / "manifest.json").read_text())
        missing = [n for n in result.notes if n not in manifest.get("notes", [])]
        if missing:
            raise AssertionError(f"notes printed by convert but not in the manifest: {missing}")
        out = work / f"target-{source.layout.key}--{target_key}"
        result.losses = train(target, out, "--resume", str(converted))
        saved = json.loads((out / f"checkpoint-{STEPS}" / "manifest.json").read_text())
        result.notes += [n for n in saved.get("notes", []) if n not in result.notes]
    except (LaunchError, AssertionError, subprocess.TimeoutExpired) as exc:
        result.error = str(exc)
    return _compared(result, start)


def _compared(result: Result, start: float) -> Result:
    if result.error is None and result.losses:
        result.max_rel = max(abs(a - b) / abs(b) for a, b in zip(result.losses, result.reference))
        result.ok = len(result.losses) == len(result.reference) and result.max_rel <= REL
        if not result.ok:
            result.error = f"losses {result.losses} vs {result.reference}"
    elif result.error is None:
        result.error = "the resumed run trained no step"
    result.seconds = time.perf_counter() - start
    return result


# --- the docs table --------------------------------------------------------------------------------------


def table(results: list[Result], sources: dict[str, Layout] = SOURCES, targets: list[str] = ENGINE_TARGETS) -> str:
    by_pair = {(r.source, r.target): r for r in results}
    lines = ["| source \\ target | " + " | ".join(targets) + " |", "|---" * (len(targets) + 1) + "|"]
    for s in sources:
        cells = []
        for t in targets:
            r = by_pair.get((s, t))
            cells.append("" if r is None else (f"ok {r.max_rel:.0e}" if r.ok else "FAIL"))
        lines.append(f"| {sources[s].label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", help="write the markdown report here (default: print it)")
    p.add_argument("--pairs", help="comma-separated source:target pairs (default: all)")
    p.add_argument("--workdir", help="keep the runs here (default: a temporary directory)")
    args = p.parse_args()
    pairs = [tuple(x.split(":")) for x in args.pairs.split(",")] if args.pairs else all_pairs()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="interop-matrix-"))
    sources: dict[str, Source] = {}
    results = []
    for s, t in pairs:
        if s not in sources:
            sources[s] = make_source(s, work)
        r = run_pair(sources[s], t, work)
        print(f"{s:>7} -> {t:<7} {'ok' if r.ok else 'FAIL'} {r.seconds:5.1f}s {r.error or ''}"[:300], flush=True)
        results.append(r)
    report = render(results)
    if args.out:
        Path(args.out).write_text(report)
    else:
        print(report)
    sys.exit(0 if all(r.ok for r in results) else 1)


def lost(note: str) -> str:
    """A note with the pair's own paths taken out, so the same loss reads the same for every pair."""
    return re.sub(r"/\S+?(?=[ :;,)]|$)", "<checkpoint>", note)


def render(results: list[Result]) -> str:
    notes = sorted({lost(n) for r in results for n in r.notes if "(policy 'reshard')" not in n})  # resharding loses nothing
    out = [
        "# The resume matrix",
        "",
        "Generated by `python -m tests.resume_matrix --out docs/resume-matrix.md` (the same pairs run under "
        "`pytest -m slow tests/test_resume_matrix.py`). Each source trains a tiny Llama for 4 steps on CPU "
        "processes and saves at step 2; one `interop convert` writes that checkpoint for the target's layout; "
        "`interop verify` checks the output; converted back to universal, `interop diff` finds every tensor and "
        "scalar equal to the source's own universal conversion (by the manifests' digests, with no engine "
        "imported); the target's trainer resumes from it and trains steps 3 and 4. A cell "
        "is `ok` with the largest relative difference of those losses from the source run's own steps 3 and 4 "
        f"(the bar is {REL:g}: float rounding between engines). Rows are sources, columns targets; on the diagonal "
        "the target runs at another world size (ZeRO and DDP/FSDP2 on 1 process, Megatron-style with 2 data-parallel replicas). "
        "The Hugging Face source is a model directory (step 0): its targets start from its weights with a fresh "
        "optimizer, compared with the single-process trainer started from it (`--init-from`) over steps 1-4.",
        "",
        table(results),
        "",
        "Targets: " + "; ".join(f"`{k}` {TARGETS[k].label} (`interop convert ... {' '.join(TARGETS[k].to)}`)" for k in ENGINE_TARGETS) + ".",
        "",
        "## Mixture of experts",
        "",
        "The same runs on a tiny Mixtral (`--model mixtral`: 4 experts, 2 per token). The engines hold each layer's "
        "experts as one fused tensor (`experts.gate_up_proj`, with its Adam moments); universal and Hugging Face "
        "files hold one tensor per expert, fused and split by transformers' own conversion operations. The "
        "Hugging Face Trainer column resumes through our trainer, which places the experts itself: transformers' "
        "`Trainer._load_from_checkpoint` loads `model.safetensors` with `load_state_dict(strict=False)` and leaves "
        "per-expert tensors as initialised (its own Mixtral resume continues at 5.5114 where the run was at 5.5022), "
        "so `--to hf-trainer` writes the weights under the module's names, which it and `from_pretrained` both load. "
        "`ep2@moe` is the Megatron-style trainer with each layer's experts split over 2 expert-parallel ranks "
        "(transformers' expert-parallel plan, tokens sent to their experts by all-to-all on gloo); its checkpoint "
        "holds the experts whole under their names (DCP), so on its diagonal it resumes at EP4 (4 ranks, one expert each).",
        "",
        table(results, MOE_SOURCES, list(MOE_TARGETS)),
        "",
        "## LoRA",
        "",
        "The same runs with peft's LoRA on the tiny Llama (`--lora-rank 4 --lora-alpha 8`: r=4 on q_proj and v_proj, "
        "the base frozen). The engines save the peft model's state dict (`base_model.model...base_layer.weight`, "
        "`lora_A.default.weight`); universal holds the frozen base model in `model/` and the adapter as peft's own "
        "adapter directory in `adapter/`, with the adapters' Adam moments; every target's trainer wraps its model "
        "with the same LoRA and resumes. The Trainer's checkpoint holds what transformers' `Trainer.save_model` "
        "writes for a peft model (the adapter directory) and the whole peft model in `model.safetensors`, which "
        "`Trainer._load_from_checkpoint` loads.",
        "",
        table(results, LORA_SOURCES, list(LORA_TARGETS)),
        "",
    ]
    if notes:
        out += ["What conversions and resumes said they could not keep (each also in the manifest):", ""]
        out += [f"- {n}" for n in notes] + [""]
    failed = [r for r in results if not r.ok]
    if failed:
        out += ["Failures:", ""] + [f"- {r.source} -> {r.target}: {(r.error or '').splitlines()[0][:200]}" for r in failed] + [""]
    return "\n".join(out)


if __name__ == "__main__":
    main()
