"""Megatron-LM legacy TP2 x PP2 -> Hugging Face: interop's streaming reader against loading and merging with
plain torch.load.

    python benchmarks/megatron_legacy.py [--hidden 1024 --layers 18] [--workdir DIR] [--repeat 3]

Builds the benchmarks' Llama (270M parameters at the defaults), takes one AdamW step with the interop base
trainer so the files carry optimizer state as Megatron's do, and writes it as a Megatron-LM checkpoint at TP 2 x
PP 2 (four model_optim_rng.pt files: weights, fp32 Adam moments, args, RNG). Then, each in its own process
(median wall time, peak RSS):

  interop convert MEG HF --to hf        maps each file, merges one tensor's TP pieces at a time, streams out
  torch.load + merge + save_file        loads the four files whole (as Megatron-LM's checkpoint tools do), merges
                                        every tensor with the same rules, writes the state dict with safetensors

and the same for torch_dist (Megatron-LM's default format), written from the universal checkpoint at TP 2 x PP 2:
interop's export against torch's own dcp_to_torch_save, each layer then cut from its stacked tensor and merged.
"""

from __future__ import annotations

import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_bench  # noqa: E402
from measure import REPO, measure, workdir  # noqa: E402

# both references end alike: each full Megatron tensor cut to the vocabulary, unfused as interop unfuses it, and the
# state dict written with safetensors and fsynced (``add`` is called per rule, the rest runs after the loop)
WRITE_HF = r"""
os.makedirs(out, exist_ok=True)
save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
fd = os.open(os.path.join(out, "model.safetensors"), os.O_RDONLY); os.fsync(fd); os.close(fd)
"""
ADD_HF = r"""
tensors = {}
def add(rule, full):
    if rule.split == VOCAB:
        full = full[: arch.vocab]
    tensors.update(zip(rule.hf, (t.contiguous() for t in rule.unfuse(full))))
"""

REFERENCE = r"""
import argparse, os, sys, torch
from safetensors.torch import save_file
from converters.megatron import locate
from converters.megatron_arch import MegatronArch
from converters.megatron_map import rules, merge, local_name, layer_of, VOCAB

src, out = sys.argv[1], sys.argv[2]
files = locate(src)
states = {k: torch.load(p, map_location="cpu", weights_only=False) for k, p in files.paths.items()}
arch = MegatronArch.from_args(vars(states[(0, 0)]["args"]), src)
per_stage = arch.num_layers // files.pp
""" + ADD_HF + r"""
for rule in rules(arch):
    p = 0 if rule.layer == -1 else files.pp - 1 if rule.layer == -2 else rule.layer // per_stage
    name = local_name(rule.megatron, p * per_stage)
    full = merge(rule, [states[(t, p)]["model"][name] for t in range(files.tp)])
    add(rule, full)
""" + WRITE_HF


# torch_dist: torch's own tool flattens the DCP directory into one torch.save file; each layer is then cut from its
# stacked tensor, merged the same way, and written with safetensors
REFERENCE_DIST = r"""
import os, sys, tempfile, torch
from safetensors.torch import save_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from converters.megatron_dist import locate, stacked_name
from converters.megatron_arch import MegatronArch
from converters.megatron_map import rules, stack_index, VOCAB

src, out = sys.argv[1], sys.argv[2]
d = locate(src)
args = torch.load(os.path.join(d, "common.pt"), map_location="cpu", weights_only=False)["args"]
arch = MegatronArch.from_args(vars(args), d, grouped_gemm=True)
with tempfile.TemporaryDirectory(dir=os.path.dirname(os.path.abspath(out))) as tmp:  # on the same disk as the rest
    dcp_to_torch_save(d, os.path.join(tmp, "all.pt"))
    state = torch.load(os.path.join(tmp, "all.pt"), map_location="cpu", weights_only=False)
""" + ADD_HF + r"""
for rule in rules(arch):
    key = next(stacked_name(n) for n in (rule.megatron, *rule.aliases) if stacked_name(n) in state)
    full = state[key][stack_index(rule.megatron)]
    add(rule, full)
""" + WRITE_HF


def train_and_save(out: str, hidden: int, layers: int) -> None:
    """One AdamW step of the base trainer (one process), then its checkpoint."""
    from trainers.base import BaseTrainer, TrainerConfig

    cfg = TrainerConfig(steps=1, batch_size=2, seq_len=16, output_dir=out, keep_last=None)
    engine_bench.train_one_step(BaseTrainer, cfg, hidden, layers)


LAYERS = 18  # 268M parameters at hidden 1024
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}  # the references' OpenMP threads sleep when idle, as interop's CLI has them


def collect(args) -> engine_bench.Section:
    work = workdir(args.workdir, "interop-bench-megatron-")
    meg = os.path.join(work, "megatron")
    cli = [sys.executable, "-m", "converters.cli"]
    if not os.path.isdir(meg):
        run = os.path.join(work, "run")
        wall = measure([sys.executable, os.path.abspath(__file__), "--train", run, "--hidden", str(args.hidden), "--layers", str(args.layers)]).wall
        print(f"one base-trainer step in {wall:.0f} s")
        subprocess.run(cli + ["convert", os.path.join(run, "checkpoint-1"), meg, "--to", "megatron", "--tp", "2", "--pp", "2"],
                       check=True, env=dict(os.environ, PYTHONPATH=REPO), stdout=subprocess.DEVNULL)
    params = int(subprocess.check_output([sys.executable, engine_bench.__file__, str(args.hidden), str(args.layers)]))
    size = engine_bench.warm(meg)
    print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, {params / 1e6:.0f}M parameters; "
          f"Megatron legacy checkpoint, TP 2 x PP 2: {size / 2**30:.2f} GiB (weights, Adam moments, args, RNG)")
    outputs = {k: os.path.join(work, k) for k in ("hf", "ref_hf", "universal", "megatron_dist", "hf_dist", "ref_hf_dist")}
    outputs["megatron"] = os.path.join(work, "megatron_back")  # "megatron" is the source's folder
    n = args.repeat
    interop, reference = "Megatron TP2xPP2 -> HF safetensors (interop)", "torch.load x4 + merge + save_file"
    dist_interop, dist_reference = "Megatron torch_dist -> HF safetensors (interop)", "dcp_to_torch_save + unstack + merge + save_file (torch)"
    rows = [
        ("import torch (baseline)", measure([sys.executable, "-c", "import torch"], None, n)),
        (interop, measure(cli + ["convert", meg, outputs["hf"], "--to", "hf"], None, n, outputs["hf"], floor=True)),
        (reference, measure([sys.executable, "-c", REFERENCE, meg, outputs["ref_hf"]], PASSIVE, n, outputs["ref_hf"])),
        ("Megatron TP2xPP2 -> universal (interop)", measure(cli + ["convert", meg, outputs["universal"], "--to", "universal"],
                                                           None, n, outputs["universal"], floor=True)),
        ("universal -> Megatron TP2xPP2 (interop)", measure(cli + ["convert", outputs["universal"], outputs["megatron"], "--to",
                                                                   "megatron", "--tp", "2", "--pp", "2"], None, n, outputs["megatron"], floor=True)),
        # torch_dist, Megatron-LM's default format: written from the universal checkpoint, then exported
        ("universal -> Megatron torch_dist TP2xPP2 (interop)", measure(
            cli + ["convert", outputs["universal"], outputs["megatron_dist"], "--to", "megatron-dist", "--tp", "2", "--pp", "2"],
            None, n, outputs["megatron_dist"], floor=True)),
        (dist_interop, measure(cli + ["convert", outputs["megatron_dist"], outputs["hf_dist"], "--to", "hf"], None, n, outputs["hf_dist"], floor=True)),
        (dist_reference, measure([sys.executable, "-c", REFERENCE_DIST, outputs["megatron_dist"], outputs["ref_hf_dist"]], PASSIVE, n,
                                 outputs["ref_hf_dist"])),
    ]
    return engine_bench.Section(rows, {interop: reference, dist_interop: dist_reference}, outputs, work)


def main() -> None:
    engine_bench.main(__doc__, collect, train_and_save, layers=LAYERS)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", REPO)
    main()
