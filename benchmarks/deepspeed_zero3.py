"""DeepSpeed ZeRO-3: interop's converters against DeepSpeed's own tools, on a checkpoint real DeepSpeed wrote.

    python benchmarks/deepspeed_zero3.py [--hidden 1024 --layers 17] [--workdir DIR]

Trains one step of a Llama (257M parameters at the defaults) with ZeRO-3 on 2 CPU ranks through the
interop DeepSpeed trainer, whose checkpoint is DeepSpeed's ``save_checkpoint`` output, then runs each step
in its own process (wall time, peak RSS):

  interop convert CKPT UNI --to universal      vs  ds_to_universal (weights + optimizer state)
  the same, with INTEROP_CACHE_DIR=off         the first conversion of a model: transformers asked (2-3 s)
  interop convert ... --workers 2              the same, written by 2 processes (each a share of the bytes)
  interop convert CKPT DSU --to ds-universal   vs  ds_to_universal (the same layout, file for file)
  interop convert CKPT HF --to hf              vs  zero_to_fp32.py --safe_serialization

The page cache is warmed with the checkpoint's files first, so every step reads from memory alike; dirty
pages are written back before each step, and each step's time runs until its output is on disk (interop
fsyncs what it writes; DeepSpeed's tools leave it in the page cache). Peak RSS is the largest single process's (ds_to_universal
spreads its work over a pool of 4 + 2 processes).
"""

from __future__ import annotations

import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_bench  # noqa: E402
from measure import REPO, measure  # noqa: E402


def train_and_save(out: str, hidden: int, layers: int) -> None:
    """Runs on each process under torch.distributed.run: one ZeRO-3 step, then the trainer's checkpoint."""
    from trainers.deepspeed import DeepSpeedTrainer, DeepSpeedTrainerConfig

    cfg = DeepSpeedTrainerConfig(zero_stage=3, steps=1, batch_size=2, seq_len=16, output_dir=out, keep_last=None)
    engine_bench.train_one_step(DeepSpeedTrainer, cfg, hidden, layers)


def time_saves(args) -> None:
    """Under torchrun: DeepSpeed's save_checkpoint alone, then our trainer's save around it."""
    from trainers.deepspeed import DeepSpeedTrainer, DeepSpeedTrainerConfig

    cfg = DeepSpeedTrainerConfig(zero_stage=3, steps=1, batch_size=args.batch_size, seq_len=args.seq_len, output_dir=args.train,
                                 keep_last=None, dtype="bfloat16" if args.bf16 else "float32")
    engine_bench.time_saves(DeepSpeedTrainer, cfg, args.hidden, args.layers,
                            lambda trainer, d: trainer.engine.save_checkpoint(d, tag="global_step1"), args.repeat, args.saves)


def collect(args) -> engine_bench.Section:
    """Train (once per workdir), then measure every step; the rows and which row each is compared with."""
    prepared = engine_bench.prepare(args, __file__, "deepspeed", "DeepSpeed ZeRO-3", 29517, {"DS_ACCELERATOR": "cpu"})
    work, ckpt, native = prepared.work, prepared.ckpt, prepared.native
    outputs = {k: os.path.join(work, k) for k in ("universal", "universal_2", "ds_universal", "hf", "zero", "ref_universal", "ref_hf")}
    for d in outputs.values():
        shutil.rmtree(d, ignore_errors=True)

    cli = [sys.executable, "-m", "converters.cli"]
    ds_env = {"DS_ACCELERATOR": "cpu"}
    # the directory holding the ZeRO files, and the one whose 'latest' names it (the run's root names checkpoint-1)
    tag = native if any(f.endswith("_optim_states.pt") for f in os.listdir(native)) else os.path.join(native, "global_step1")
    n = args.repeat
    rows = [
        ("import torch + deepspeed (baseline)", measure([sys.executable, "-c", "import torch, deepspeed"], ds_env, n)),
        ("ZeRO-3 -> universal, safetensors (interop)", measure(
            cli + ["convert", ckpt, outputs["universal"], "--to", "universal"], None, n, outputs["universal"], floor=True)),
        ("ZeRO-3 -> universal, first conversion of the model (interop)", measure(  # transformers asked, not its kept answers
            cli + ["convert", ckpt, outputs["universal"], "--to", "universal"], {"INTEROP_CACHE_DIR": "off"}, n, outputs["universal"], floor=True)),
        ("ZeRO-3 -> universal, 2 processes (interop --workers 2)", measure(
            cli + ["convert", ckpt, outputs["universal_2"], "--to", "universal", "--workers", "2"], None, n, outputs["universal_2"], floor=True)),
        ("ZeRO-3 -> ds-universal (interop)", measure(
            cli + ["convert", ckpt, outputs["ds_universal"], "--to", "ds-universal"], ds_env, n, outputs["ds_universal"], floor=True)),
        ("ds_to_universal (DeepSpeed)", measure(
            [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", tag,
             "--output_folder", os.path.join(outputs["ref_universal"], "global_step1_universal"), "--inject_missing_state"],
            ds_env, n, outputs["ref_universal"],
        )),
        ("ZeRO-3 -> HF safetensors (interop)", measure(cli + ["convert", ckpt, outputs["hf"], "--to", "hf"], None, n, outputs["hf"], floor=True)),
        ("universal -> ZeRO-2, 4 ranks (interop)", measure(  # the way back: DeepSpeed's own files at another layout
            cli + ["convert", outputs["universal"], outputs["zero"], "--to", "deepspeed", "--zero-stage", "2", "--world-size", "4"],
            ds_env, n, outputs["zero"], floor=True)),
        ("zero_to_fp32.py --safe_serialization (DeepSpeed)", measure(
            [sys.executable, os.path.join(native, "zero_to_fp32.py"), os.path.dirname(tag), outputs["ref_hf"], "--safe_serialization",
             "--tag", os.path.basename(tag)],
            ds_env, n, outputs["ref_hf"],
        )),
    ]
    save_rows, save_reference = engine_bench.save_rows(__file__, work, args, 29527, "save_checkpoint", ds_env)
    rows += save_rows
    return engine_bench.Section(rows, {
        **save_reference,
        "ZeRO-3 -> universal, safetensors (interop)": "ds_to_universal (DeepSpeed)",
        "ZeRO-3 -> universal, first conversion of the model (interop)": "ds_to_universal (DeepSpeed)",
        "ZeRO-3 -> universal, 2 processes (interop --workers 2)": "ds_to_universal (DeepSpeed)",
        "ZeRO-3 -> ds-universal (interop)": "ds_to_universal (DeepSpeed)",
        "ZeRO-3 -> HF safetensors (interop)": "zero_to_fp32.py --safe_serialization (DeepSpeed)",
    }, outputs, work)


def main() -> None:
    engine_bench.main(__doc__, collect, train_and_save, saves=time_saves)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", REPO)
    main()
