"""A GPU step's host side beside a background save, on a CPU: what a save's background work takes from a training
thread that launches kernels from Python, measured without a GPU.

    python benchmarks/host_side_step.py [--hidden 1024 --layers 17] [--repeat 3]     # about 3 min on 2 cores

One process trains one step of the benchmark's Llama (257M parameters at the defaults) with Accelerate FSDP2
through the interop trainer, then another with DeepSpeed ZeRO-3. Then, in place of training steps, the training
thread runs a launch-bound loop: tiny tensor ops on one torch thread, each a Python call that holds the GIL as a
kernel launch does, while the save's background work runs beside it: our trainer's --async-save commit, torch
DCP's own ``async_save`` of the model and optimizer (FSDP2; DeepSpeed has none), and ``dd`` writing as many bytes
(the floor: no Python at all). A CPU training step would compete with
a save for this machine's cores; on a GPU the step has the host's cores to itself and competes for the GIL, which
this loop measures. Each row is the loop's mean time over every loop that ran while the work did (the last one,
which most likely outlasted it, left out), and its ratio to the loop alone: ten loops with nothing beside them
before each kind of work, in every repeat, the median of those windows' means (one window slowed by writeback left
over from the work before it, or anything else on the machine, would otherwise move every ratio).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import engine_bench  # noqa: E402
from measure import REPO, Section, dd_writing, print_table, tree_bytes, workdir  # noqa: E402

OPS = 100_000  # tensor ops per loop (about 2 us each here): a loop takes about as long as a GPU step of a small model
ALONE = "host-side step: launch-bound loop, nothing beside it"
BESIDE = {  # in this order: dd writes as many bytes as the --async-save before it
    "interop-async": "host-side step beside an --async-save's commit (interop)",
    "dcp-async": "host-side step beside torch DCP async_save's write",
    "dd": "host-side step beside dd writing a save's bytes (floor)",
}
# each engine's trainer in a process of its own: (tag in the rows, environment, kinds of background work)
ENGINES = {
    "fsdp2": ("FSDP2", {}, tuple(BESIDE)),
    "zero3": ("ZeRO-3", {"DS_ACCELERATOR": "cpu"}, ("interop-async", "dd")),  # DeepSpeed has no async save of its own
}


def _trainer(engine: str, args):
    if engine == "zero3":
        from trainers.deepspeed import DeepSpeedTrainer, DeepSpeedTrainerConfig

        cfg = DeepSpeedTrainerConfig(zero_stage=3, steps=1, batch_size=2, seq_len=16, output_dir=args.train, keep_last=None)
        return engine_bench._bench_trainer(DeepSpeedTrainer, cfg, args.hidden, args.layers)
    from trainers.accelerate import AccelerateTrainer, AccelerateTrainerConfig

    cfg = AccelerateTrainerConfig(fsdp=True, steps=1, batch_size=2, seq_len=16, output_dir=args.train, keep_last=None)
    return engine_bench._bench_trainer(AccelerateTrainer, cfg, args.hidden, args.layers)


def launch_bound_loop(x, w) -> float:
    start = time.perf_counter()
    for _ in range(OPS // 2):
        x.mul_(w).add_(1.0)
    return time.perf_counter() - start


def run(args) -> None:
    """Under torchrun, one process: the loop alone and beside each kind of background work, ``repeat`` times each;
    the means written to ``args.saves`` as JSON."""
    import json

    import torch
    import torch.distributed as dist

    from trainers.base import shutdown

    torch.set_num_threads(1)
    trainer = _trainer(args.engine, args)
    trainer.train()
    group = dist.new_group(backend="gloo")  # DCP's, on its own thread
    x, w = torch.zeros(64), torch.ones(64)
    for _ in range(20):  # warm-up
        launch_bound_loop(x, w)
    loops: dict[str, list[float]] = {k: [] for k in ENGINES[args.engine][2]}
    alone: list[float] = []  # each window's mean
    written = 0
    for i in range(args.repeat):
        for kind in loops:
            os.sync()
            alone.append(statistics.mean(launch_bound_loop(x, w) for _ in range(10)))
            target = os.path.join(args.train, f"{kind}-{i}")
            done = None
            if kind == "dd":
                writer = subprocess.Popen(dd_writing(target, written))
                busy = lambda: writer.poll() is None  # noqa: E731
            elif kind == "dcp-async":
                future = engine_bench.dcp_async_save(trainer, target, group)
                busy, done = (lambda: not future.done()), future.result
            else:
                trainer.cfg.async_save = True
                target = trainer.save(wait=False)
                busy, done = trainer.checkpoints.running, trainer.checkpoints.wait
            times = [launch_bound_loop(x, w)]
            while busy():
                times.append(launch_bound_loop(x, w))
            if len(times) > 2:
                times.pop()  # it began while the work ran and most likely ended after: partly a loop alone
            if done is not None:
                done()
            if kind == "interop-async":
                written = tree_bytes(target)
            loops[kind].extend(times)
            if os.path.isdir(target):
                shutil.rmtree(target, ignore_errors=True)
            elif os.path.exists(target):
                os.remove(target)
    with open(args.saves, "w") as f:
        json.dump({"loops": {"alone": statistics.median(alone), **{k: statistics.mean(v) for k, v in loops.items()}},
                   "counts": {"alone": 10 * len(alone), **{k: len(v) for k, v in loops.items()}}, "written": written}, f)
    shutdown()


def collect(args) -> Section:
    import json

    work = workdir(args.workdir, "interop-bench-host-")
    rows, reference, run_dir = [], {}, os.path.join(work, "run")
    for engine, (tag, env, kinds) in ENGINES.items():
        result = os.path.join(work, f"host_side_step_{engine}.json")
        shutil.rmtree(run_dir, ignore_errors=True)  # a run's own checkpoints: each run trains its step afresh
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=1", "--master_addr=127.0.0.1",
                        "--master_port=29538", os.path.abspath(__file__), "--train", run_dir, "--saves", result, "--engine", engine,
                        "--hidden", str(args.hidden), "--layers", str(args.layers), "--repeat", str(args.repeat)],
                       check=True, env={**os.environ, **env, "PYTHONPATH": REPO})
        with open(result) as f:
            found = json.load(f)
        alone = f"{ALONE} [{tag}]"
        rows.append((alone, (found["loops"]["alone"], 0)))
        for kind in kinds:
            rows.append((f"{BESIDE[kind]} [{tag}]", (found["loops"][kind], 0)))
            reference[f"{BESIDE[kind]} [{tag}]"] = alone
        print(f"{tag}: loops timed {found['counts']}; the --async-save writes {found['written'] / 2**30:.2f} GiB")
    return Section(rows, reference, {"run": run_dir}, work)


def main() -> None:
    p = engine_bench.parser(__doc__)
    p.add_argument("--engine", choices=sorted(ENGINES), default="fsdp2", help=argparse.SUPPRESS)  # a process's own trainer
    args = p.parse_args()
    if args.train and args.saves:
        run(args)
        return
    section = collect(args)
    print_table(section.rows, section.reference)
    for out in section.outputs.values():
        shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONPATH", REPO)
    main()
