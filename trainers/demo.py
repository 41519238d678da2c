"""`interop demo`: the whole story on CPU with no arguments.

DeepSpeed ZeRO-2 trains a tiny Llama on 2 processes and saves mid-run; the checkpoint becomes a universal
one; Accelerate FSDP2 and a Megatron-style TP2 run each resume from it and continue the ZeRO-2 run's losses;
the TP2 run's final checkpoint is exported to Hugging Face, reloaded with ``from_pretrained`` and generates
a few tokens. Registered as a CLI command through the ``interop.commands`` entry point, so converters never
import trainers.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from dataclasses import dataclass, field

LOSS_REL = 1e-5  # float rounding between engines (they sum gradients and shards in different orders)


@dataclass
class DemoResult:
    reference: list[float]  # the ZeRO-2 run's losses after the save: what a resume must reproduce
    resumed: dict[str, list[float]] = field(default_factory=dict)  # run -> its losses over the same steps
    diff_exact: int = 0
    diff_total: int = 0
    verify_problems: list[str] = field(default_factory=list)
    generated: str = ""
    weights_exact: bool = False
    rng_notes: list[str] = field(default_factory=list)  # what the resumed runs' manifests record about RNG streams

    def max_rel(self, run: str) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(self.resumed[run], self.reference))

    @property
    def ok(self) -> bool:
        return (not self.verify_problems and self.diff_exact == self.diff_total and self.weights_exact
                and all(len(v) == len(self.reference) and self.max_rel(k) <= LOSS_REL for k, v in self.resumed.items()))


def _say(line: str = "") -> None:
    print(line, flush=True)


def run_demo(out: str, steps: int = 6) -> DemoResult:
    """Returns what it found, so tests can assert on it; prints the story for people."""
    import torch  # here, not at the top: the CLI loads this module to list the command on every call

    from converters import registry
    from converters.diff import diff_checkpoints
    from interop.commit import resolve_checkpoint_dir
    from interop.manifest import read_manifest
    from interop.verify import verify_checkpoint

    from .launch import launch

    saved_at = steps // 2
    common = ["--steps", str(steps), "--batch-size", "4", "--seq-len", "32"]
    d = {k: os.path.join(out, k) for k in ("zero2", "universal", "fsdp2-checkpoint", "fsdp2", "tp2", "hf")}
    options = registry.Options(overwrite=True)

    _say(f"1. DeepSpeed ZeRO-2, 2 processes: deepspeed trains a tiny Llama for {steps} steps, saving at step {saved_at}")
    zero = launch("trainers.deepspeed", 2, [*common, "--zero-stage", "2", "--save-every", str(saved_at), "--output-dir", d["zero2"]])
    source = os.path.join(d["zero2"], f"checkpoint-{saved_at}")
    result = DemoResult(reference=zero.losses[saved_at:])
    _say(f"   loss {zero.losses[0]:.4f} -> {zero.losses[-1]:.4f}; the checkpoint: {source}")

    _say(f"2. $ interop convert {source} {d['universal']} --to universal")
    _, logical = registry.read(source, options)
    registry.writer("universal").write(logical, d["universal"], options)  # type: ignore[misc]
    _, result.verify_problems = verify_checkpoint(d["universal"])
    _, universal = registry.read(d["universal"], options)
    report = diff_checkpoints(logical, universal)
    result.diff_exact, result.diff_total = report.count("exact"), len(report.entries)
    opt = universal.optimizer
    _say(f"   verify: {'OK' if not result.verify_problems else result.verify_problems}; "
         f"{result.diff_exact}/{result.diff_total} tensors bit-identical to the ZeRO-2 shards "
         f"(weights, {', '.join(opt.state_keys) if opt else 'no optimizer state'})")
    _say(f"   carried beside them: {', '.join(sorted(universal.components))} (step {universal.step})")

    _say(f"3. $ interop convert {d['universal']} {d['fsdp2-checkpoint']} --to accelerate --world-size 2 --fsdp")
    registry.writer("accelerate").write(universal, d["fsdp2-checkpoint"],  # type: ignore[misc]
                                        registry.Options(overwrite=True, extra={"world_size": 2, "fsdp": True}))
    _say("   Accelerate FSDP2, 2 processes, resumes from it")
    fsdp = launch("trainers.accelerate", 2, [*common, "--fsdp", "--resume", d["fsdp2-checkpoint"], "--output-dir", d["fsdp2"]])
    result.resumed["Accelerate FSDP2"] = fsdp.losses

    _say("4. Megatron-style TP2, 2 processes, resumes from the universal checkpoint directly")
    tp2 = launch("trainers.megatron", 2, [*common, "--tp", "2", "--resume", d["universal"], "--output-dir", d["tp2"]])
    result.resumed["Megatron-style TP2"] = tp2.losses

    _say(f"5. $ interop convert {tp2.checkpoint} {d['hf']} --to hf")
    _, final = registry.read(tp2.checkpoint, options)
    registry.writer("hf").write(final, d["hf"], options)  # type: ignore[misc]
    import transformers

    transformers.utils.logging.disable_progress_bar()
    model = transformers.AutoModelForCausalLM.from_pretrained(d["hf"]).eval()
    state = {k: t.load() for k, t in final.model.items()}
    result.weights_exact = all(torch.equal(v, state[k]) for k, v in model.state_dict().items() if k in state)
    prompt = b"The checkpoint "
    with torch.no_grad():
        ids = model.generate(torch.tensor([list(prompt)]), max_new_tokens=16, do_sample=False, pad_token_id=0)
    result.generated = bytes(int(i) for i in ids[0, len(prompt):]).decode("utf-8", errors="replace")
    _say(f"   from_pretrained: weights {'equal' if result.weights_exact else 'DIFFER from'} the TP2 checkpoint's; "
         f"generate({prompt.decode()!r}) -> {result.generated!r} (byte tokens; a 6-step model babbles)")

    _say("\nloss after the step-%d save (the ZeRO-2 run never stopped; the others resumed from its checkpoint):" % saved_at)
    _say(f"  {'step':>4}  {'ZeRO-2 x2':>11}" + "".join(f"  {k:>18}" for k in result.resumed))
    for i, ref in enumerate(result.reference):
        _say(f"  {saved_at + 1 + i:>4}  {ref:>11.6f}" + "".join(f"  {v[i]:>18.6f}" for v in result.resumed.values()))
    for k in result.resumed:
        _say(f"  {k}: largest relative difference {result.max_rel(k):.1e} (float rounding between engines)")
    _say("preserved: weights and AdamW state bit for bit, per-parameter step, both param groups, the LR schedule, "
         "the data position and trainer progress (the losses above continue ZeRO-2's)")
    # what the resumed runs' own checkpoints record about the state they could not take as saved
    result.rng_notes = [f"{name}: {n}" for name, run in (("Accelerate FSDP2", fsdp), ("Megatron-style TP2", tp2))
                        for n in read_manifest(resolve_checkpoint_dir(run.checkpoint)).notes if "rng" in n.lower()]
    _say("RNG streams: " + ("; ".join(result.rng_notes) if result.rng_notes else
                            "each rank's restored as saved (no checkpoint's manifest records otherwise)"))
    return result


def require_engines(*packages: str, extra: str) -> None:
    """One line naming what to install when an engine the command runs is missing (the launched processes
    would otherwise end in an import traceback each)."""
    import importlib.util

    from interop.errors import ConfigurationError

    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigurationError(f"needs {' and '.join(missing)}, not installed here: pip install 'interop[{extra}]' "
                                 f"(or pip install -e '.[{extra}]' in a clone)")


def _command(args: argparse.Namespace) -> int:
    require_engines("deepspeed", "accelerate", extra="demo")
    logging.getLogger().setLevel(logging.WARNING)
    out = args.out or tempfile.mkdtemp(prefix="interop-demo-")
    result = run_demo(out, args.steps)
    print(f"\n{'demo OK' if result.ok else 'demo FAILED'}: files under {out}")
    return 0 if result.ok else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="ZeRO-2 -> universal -> FSDP2 and TP2 resumes -> Hugging Face, on CPU")
    p.add_argument("--out", default=None, help="output directory (default: a new temporary directory)")
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6; the save is at half)")
    p.set_defaults(func=_command)
