"""Every conversion and save beside the engine's own tool, on the same checkpoints, in one run: one table.

    python benchmarks/run.py [--workdir DIR] [--repeat 3]      # about 12 min on 2 cores the first time

Runs benchmarks/hf_roundtrip.py, deepspeed_zero3.py, accelerate_fsdp2.py and megatron_legacy.py (each trains
or builds its ~250M-parameter checkpoint once under --workdir and reuses it), host_side_step.py, and
deepspeed_zero3.py again on a 260M-parameter Mixtral (8 experts; rows marked [MoE]), and quantized_import.py (a GPT-OSS
with MXFP4 experts, dequantized on reading), then prints their rows together:
wall time until the output is on disk and peak RSS of each step in its own process, and for each interop row
the speed-up and RSS ratio against the engine's tool on the same files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import accelerate_fsdp2  # noqa: E402
import deepspeed_zero3  # noqa: E402
import hf_roundtrip  # noqa: E402
import host_side_step  # noqa: E402
import megatron_legacy  # noqa: E402
import quantized_import  # noqa: E402
from measure import REPO, print_table, workdir  # noqa: E402

ENGINES = (("deepspeed", deepspeed_zero3, 17), ("accelerate", accelerate_fsdp2, 17), ("megatron", megatron_legacy, megatron_legacy.LAYERS))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default=None, help="keeps the checkpoints between runs (default: a new temporary directory)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each step; the median wall time is reported")
    p.add_argument("--hidden", type=int, default=1024)
    args = p.parse_args()
    work = workdir(args.workdir, "interop-bench-all-")
    rows, reference = [], {}

    def add(section, tag: str) -> None:
        """The section's rows, each tagged where names repeat across sections; its outputs removed after."""
        measured = section.rows
        named = {r: f"{r} [{tag}]" if r.startswith(("save:", "step:")) or "(baseline)" in r or tag == "MoE" else r
                 for r, _ in measured}
        rows.extend((named[r], m) for r, m in measured)
        reference.update({named[k]: named[v] for k, v in section.reference.items()})
        for out in section.outputs.values():  # several GiB each: the next section needs the disk
            shutil.rmtree(out, ignore_errors=True)

    add(hf_roundtrip.collect(argparse.Namespace(hidden=args.hidden, layers=16, repeat=args.repeat, workdir=os.path.join(work, "hf"))), "hf")
    for name, module, layers in ENGINES:
        add(module.collect(argparse.Namespace(hidden=args.hidden, layers=layers, repeat=args.repeat,
                                              workdir=os.path.join(work, name), train=None)), name)
    # a GPU step's host side (a launch-bound loop on the training thread) beside each background save: what a save
    # takes from a thread that launches kernels, which a CPU training step, competing for the cores, cannot show
    add(host_side_step.collect(argparse.Namespace(hidden=args.hidden, layers=17, repeat=args.repeat, workdir=os.path.join(work, "host"))), "host")
    # a MoE model (Mixtral, 8 experts of 2 per token, 260M parameters) through ZeRO-3: the experts fused in the
    # engine's files, one tensor per expert in universal and Hugging Face files
    os.environ[hf_roundtrip.EXPERTS_ENV] = "8"
    try:
        add(deepspeed_zero3.collect(argparse.Namespace(hidden=args.hidden, layers=7, repeat=args.repeat,
                                                       workdir=os.path.join(work, "deepspeed-moe"), train=None)), "MoE")
    finally:
        del os.environ[hf_roundtrip.EXPERTS_ENV]
    # a pre-quantized release (GPT-OSS's MXFP4 experts) dequantized on reading, beside transformers' own dequantizing load
    add(quantized_import.collect(argparse.Namespace(hidden=args.hidden, layers=4, experts=32, repeat=args.repeat,
                                                    workdir=os.path.join(work, "mxfp4"))), "mxfp4")
    print_table(rows, reference)
    if args.workdir:  # a temporary one is removed at exit
        print(f"\nfiles under {work}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", REPO)
    main()
