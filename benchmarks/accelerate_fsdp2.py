"""Accelerate FSDP2: interop's DCP converter against torch's own offline tool, on a checkpoint real accelerate wrote.

    python benchmarks/accelerate_fsdp2.py [--hidden 1024 --layers 17] [--workdir DIR] [--repeat 3]

Trains one step of a Llama (257M parameters at the defaults) with FSDP2 on 2 CPU processes through the interop
Accelerate trainer, whose checkpoint is ``accelerator.save_state`` output (two torch DCP directories), then
runs each step in its own process (median wall time, peak RSS):

  interop convert CKPT UNI --to universal   vs  dcp_to_torch_save of model and optimizer, then safetensors
                                                 save_file of every tensor (weights + optimizer state)
  interop convert CKPT HF --to hf           vs  dcp_to_torch_save of the model, then save_file

torch's converter materialises the whole state dict in memory and writes a pickle, which the reference then
loads and writes again as safetensors; interop reads one tensor at a time from the DCP files. The page cache
is warm; each step's time runs until its output is on disk.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_bench  # noqa: E402
from measure import REPO, measure  # noqa: E402

REFERENCE = r"""
import os, sys, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

out = sys.argv[1]
os.makedirs(out, exist_ok=True)
for name in sys.argv[2:]:
    pt = os.path.join(out, os.path.basename(name) + ".pt")
    dcp_to_torch_save(name, pt)
    state = torch.load(pt, weights_only=False)
    flat = {}
    def walk(prefix, node):
        if isinstance(node, torch.Tensor):
            flat[prefix] = node.contiguous()
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
    walk("", state)
    seen = {}
    for k, t in list(flat.items()):  # tied weights share storage; safetensors refuses shared tensors
        key = (t.data_ptr(), t.shape)
        if key in seen:
            del flat[k]
        seen[key] = k
    save_file(flat, os.path.join(out, os.path.basename(name) + ".safetensors"))
    os.remove(pt)
    for f in os.listdir(out):
        fd = os.open(os.path.join(out, f), os.O_RDONLY)
        os.fsync(fd)
        os.close(fd)
"""


def train_and_save(out: str, hidden: int, layers: int) -> None:
    """Runs on each process under torch.distributed.run: one FSDP2 step, then the trainer's checkpoint."""
    from trainers.accelerate import AccelerateTrainer, AccelerateTrainerConfig

    cfg = AccelerateTrainerConfig(fsdp=True, steps=1, batch_size=2, seq_len=16, output_dir=out, keep_last=None)
    engine_bench.train_one_step(AccelerateTrainer, cfg, hidden, layers)


def time_saves(args) -> None:
    """Under torchrun: accelerate's save_state alone, then our trainer's save around it."""
    from trainers.accelerate import AccelerateTrainer, AccelerateTrainerConfig

    cfg = AccelerateTrainerConfig(fsdp=True, steps=1, batch_size=args.batch_size, seq_len=args.seq_len, output_dir=args.train,
                                  keep_last=None, mixed_precision="bf16" if args.bf16 else "no")
    engine_bench.time_saves(AccelerateTrainer, cfg, args.hidden, args.layers,
                            lambda trainer, d: trainer.accelerator.save_state(d), args.repeat, args.saves, dcp_reference=True)


def collect(args) -> engine_bench.Section:
    prepared = engine_bench.prepare(args, __file__, "accelerate", "Accelerate FSDP2 (DCP)", 29518)
    work, ckpt, native = prepared.work, prepared.ckpt, prepared.native
    outputs = {k: os.path.join(work, k) for k in ("universal", "hf", "ref_universal", "ref_hf")}

    cli = [sys.executable, "-m", "converters.cli"]
    model_dcp, optim_dcp = os.path.join(native, "pytorch_model_fsdp_0"), os.path.join(native, "optimizer_0")
    n = args.repeat
    rows = [
        ("import torch (baseline)", measure([sys.executable, "-c", "import torch"], None, n)),
        ("FSDP2 -> universal, safetensors (interop)", measure(
            cli + ["convert", ckpt, outputs["universal"], "--to", "universal"], None, n, outputs["universal"], floor=True)),
        ("dcp_to_torch_save + save_file, model + optimizer (torch)", measure(
            [sys.executable, "-c", REFERENCE, outputs["ref_universal"], model_dcp, optim_dcp], None, n, outputs["ref_universal"])),
        ("FSDP2 -> HF safetensors (interop)", measure(cli + ["convert", ckpt, outputs["hf"], "--to", "hf"], None, n, outputs["hf"], floor=True)),
        ("dcp_to_torch_save + save_file, model (torch)", measure(
            [sys.executable, "-c", REFERENCE, outputs["ref_hf"], model_dcp], None, n, outputs["ref_hf"])),
    ]
    save_rows, save_reference = engine_bench.save_rows(__file__, work, args, 29528, "save_state")
    rows += save_rows
    return engine_bench.Section(rows, {
        **save_reference,
        "FSDP2 -> universal, safetensors (interop)": "dcp_to_torch_save + save_file, model + optimizer (torch)",
        "FSDP2 -> HF safetensors (interop)": "dcp_to_torch_save + save_file, model (torch)",
    }, outputs, work)


def main() -> None:
    engine_bench.main(__doc__, collect, train_and_save, saves=time_saves)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", REPO)
    main()
