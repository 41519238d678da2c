"""`interop demo`: the whole story on CPU with no arguments.

Train a tiny Llama for a few steps and save through the adapter, convert to the universal checkpoint and to
a Hugging Face directory, reload with transformers, and show that the logits match the trained model's.
Registered as a CLI command through the ``interop.commands`` entry point, so converters never import trainers.
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile



def run_demo(out: str, steps: int = 6) -> dict:
    """Returns what it found, so tests can assert on it; prints a short story for people."""
    import torch  # here, not at the top: the CLI loads this module to list the command on every call

    from converters import registry
    from converters.diff import diff_checkpoints
    from interop.verify import verify_checkpoint

    from .base import BaseTrainer, TrainerConfig

    run_dir, universal_dir, hf_dir = (os.path.join(out, d) for d in ("run", "universal", "hf"))
    trainer = BaseTrainer(TrainerConfig(steps=steps, output_dir=run_dir, keep_last=2))
    losses = trainer.train()
    ckpt_dir = trainer.save()
    print(f"1. trained a tiny Llama for {steps} steps on CPU: loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"   saved through the adapter: {ckpt_dir}")

    options = registry.Options(overwrite=True)
    _, logical = registry.read(ckpt_dir, options)
    registry.writer("universal").write(logical, universal_dir, options)  # type: ignore[misc]
    _, problems = verify_checkpoint(universal_dir)
    _, universal = registry.read(universal_dir, options)
    report = diff_checkpoints(logical, universal)
    print(f"2. converted to a universal checkpoint: {universal_dir}")
    print(
        f"   verify: {'OK' if not problems else problems}; diff against the source: "
        f"{report.count('exact')}/{len(report.entries)} tensors bit-identical (weights and optimizer state)"
    )

    registry.writer("hf").write(universal, hf_dir, options)  # type: ignore[misc]
    import transformers

    transformers.utils.logging.disable_progress_bar()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    batch = trainer.next_batch()
    trainer.model.eval()
    reloaded.eval()
    with torch.no_grad():
        expected = trainer.model(input_ids=batch).logits
        got = reloaded(input_ids=batch).logits
    exact = torch.equal(expected, got)
    print(f"3. exported to Hugging Face and reloaded with from_pretrained: {hf_dir}")
    print(f"   logits {'match exactly' if exact else 'DIFFER'} (max |diff| {float((expected - got).abs().max()):.3g})")
    return {
        "checkpoint": ckpt_dir,
        "universal": universal_dir,
        "hf": hf_dir,
        "verify_problems": problems,
        "diff_problems": len(report.problems),
        "logits_exact": exact,
    }


def _command(args: argparse.Namespace) -> int:
    logging.getLogger().setLevel(logging.WARNING)
    out = args.out or tempfile.mkdtemp(prefix="interop-demo-")
    result = run_demo(out, args.steps)
    ok = result["logits_exact"] and not result["verify_problems"] and result["diff_problems"] == 0
    print(f"\n{'demo OK' if ok else 'demo FAILED'}: files under {out}")
    return 0 if ok else 1


def register(subparsers) -> None:
    p = subparsers.add_parser("demo", help="train, save, convert, export and reload a tiny model on CPU")
    p.add_argument("--out", default=None, help="output directory (default: a new temporary directory)")
    p.add_argument("--steps", type=int, default=6, help="training steps (default 6)")
    p.set_defaults(func=_command)
