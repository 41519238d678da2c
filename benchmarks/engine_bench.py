"""What the engine benchmarks share: their flags, a checkpoint trained once by the engine on 2 processes
(kept in --workdir between runs), the page cache warmed with it, and the model line they print."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass

from hf_roundtrip import EXPERTS_ENV, describe, model_config
from measure import Section, dd_writing, measure, print_table, tree_bytes, workdir  # noqa: F401  (Section: the engine scripts')


BATCH_SIZE, SEQ_LEN = 2, 16  # the save timings' training steps, unless --batch-size / --seq-len say otherwise


def parser(doc: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=17)
    p.add_argument("--workdir", default=None, help="keeps the trained checkpoint between runs")
    p.add_argument("--experts", type=int, default=0, help="a Mixtral with this many experts per layer instead of the Llama")
    p.add_argument("--repeat", type=int, default=3, help="runs of each step; the median wall time is reported")
    p.add_argument("--batch-size", type=int, default=BATCH_SIZE, help="the save timings' training steps: samples per step")
    p.add_argument("--seq-len", type=int, default=SEQ_LEN, help="the save timings' training steps: tokens per sample")
    p.add_argument("--bf16", action="store_true", help="the save timings' training steps in bf16 mixed precision")
    p.add_argument("--train", default=None, help=argparse.SUPPRESS)
    p.add_argument("--saves", default=None, help=argparse.SUPPRESS)  # with --train: time saves, write them here
    return p


@dataclass
class Prepared:
    work: str
    ckpt: str  # our trainer's checkpoint-1
    native: str  # where the engine's own files are (the checkpoint itself)


def _bench_trainer(trainer_cls, cfg, hidden: int, layers: int):
    import transformers

    class BenchTrainer(trainer_cls):
        def build_model(self):
            return transformers.AutoModelForCausalLM.from_config(model_config(hidden, layers))

    return BenchTrainer(cfg)


def train_one_step(trainer_cls, cfg, hidden: int, layers: int) -> None:
    """On each process: ``trainer_cls`` with the benchmark's Llama, one step, then its checkpoint."""
    from trainers.base import shutdown

    trainer = _bench_trainer(trainer_cls, cfg, hidden, layers)
    trainer.train()
    trainer.save()
    shutdown()


def _peak_rss_reset() -> int:
    """Reset this process's RSS high-water mark (Linux: clear_refs 5) and return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":"))


SAVE_KINDS = ("engine", "interop", "interop-background", "interop-async")


def dcp_async_save(trainer, directory: str, group):
    """torch DCP's own asynchronous save of the model and optimizer (``get_state_dict`` + ``dcp.async_save`` over a
    gloo group of its own): the reference for --async-save where the engine is DCP-based. Returns its future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    result = dcp.async_save({"model": model_state, "optim": optim_state}, checkpoint_id=directory, process_group=group)
    return getattr(result, "upload_completion", result)


def time_saves(trainer_cls, cfg, hidden: int, layers: int, engine_save, repeat: int, result: str, dcp_reference: bool = False) -> None:
    """On each process under torchrun: one training step, then ``repeat`` times each kind of save:

    - ``engine``: the engine's own save (``engine_save(trainer, directory)``), as a user's script calls it;
    - ``interop``: our trainer's ``save()``, which returns once the checkpoint is committed (the same engine save
      inside the commit protocol: staging, fsync, every file digested into the manifest, rename, ``latest``);
    - ``interop-background``: the trainer's periodic save (``save(wait=False)``): returns once the engine's files
      are written; the commit runs on a background thread;
    - ``interop-async``: the same with ``--async-save``: returns once the state is copied in memory;
    - ``dcp-async`` (``dcp_reference``): torch DCP's ``async_save`` of the model and optimizer, for comparison.

    For each: the blocking time (until the call returns: what the training loop waits) and the time until the
    checkpoint is on disk (its commit done and ``sync``), on every rank together; memory is the largest rank's RSS
    growth. Then the step time, the mean over steps: with no save running; from the moment an --async-save
    returns for as long as its write and commit run (on any rank; at least one step); likewise beside DCP's
    ``async_save``; and beside ``dd`` writing (and fsyncing) as many bytes as a rank's save writes: the floor for
    any writer on this machine, whose cores the step already uses. Rank 0 writes the figures to ``result`` as
    JSON (medians of the saves, means of the steps, and how many steps each mean is of)."""
    import json
    import shutil
    import statistics
    import time

    import torch.distributed as dist

    from trainers.base import shutdown

    trainer = _bench_trainer(trainer_cls, cfg, hidden, layers)
    trainer.train()
    control = dist.new_group(backend="gloo")  # the benchmark's own collectives, on this thread
    _steps_while(trainer, lambda: False, control, at_least=2)  # warm-up: allocator, kernels' first runs
    kinds = SAVE_KINDS + (("dcp-async",) if dcp_reference else ())
    group = dist.new_group(backend="gloo") if dcp_reference else None  # DCP's, on its own thread
    runs: dict[str, list[tuple[float, float, int]]] = {k: [] for k in kinds}
    for kind in kinds:  # each kind's runs together: the first save after another kind's can pay for its deletes
        for i in range(repeat):
            target = os.path.join(cfg.output_dir, f"engine-{i}")
            trainer.cfg.async_save = kind == "interop-async"
            dist.barrier()
            os.sync()
            before = _peak_rss_reset()
            start = time.perf_counter()
            future = None
            if kind == "engine":
                engine_save(trainer, target)
                path = target
            elif kind == "dcp-async":
                future, path = dcp_async_save(trainer, target, group), target
            else:
                path = trainer.save(wait=kind == "interop")
            blocking = time.perf_counter() - start
            trainer.checkpoints.wait()
            if future is not None:
                future.result()
            os.sync()
            dist.barrier()
            durable = time.perf_counter() - start
            if kind == "interop-async":
                written = tree_bytes(path)
            growth = _max_over_ranks(_status_kib("VmHWM") * 1024 - before, control)
            runs[kind].append((_max_over_ranks_f(blocking, control), durable, growth))
            if trainer.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    steps: dict[str, list[float]] = {"alone": [], "during-async-save": [], "during-dd": [],
                                     **({"during-dcp-async-save": []} if dcp_reference else {})}
    share = written // trainer.world_size  # what an --async-save writes from one rank
    for i in range(repeat):
        for kind in steps:
            dist.barrier()
            os.sync()
            path = future = writer = None
            busy = lambda: False  # noqa: E731
            if kind == "during-dd":  # the floor: only the bytes written (no copy, no digest, no commit)
                path = os.path.join(cfg.output_dir, f"dd-{trainer.rank}.bin")
                writer = subprocess.Popen(dd_writing(path, share))
                busy = lambda: writer.poll() is None  # noqa: E731
            elif kind == "during-async-save":
                trainer.cfg.async_save = True
                path = trainer.save(wait=False)
                busy = trainer.checkpoints.running
            elif kind == "during-dcp-async-save":
                path = os.path.join(cfg.output_dir, f"dcp-step-{i}")
                future = dcp_async_save(trainer, path, group)
                busy = lambda f=future: not f.done()  # noqa: E731
            steps[kind].extend(_steps_while(trainer, busy, control, at_least=STEPS_ALONE if kind == "alone" else 1))
            trainer.checkpoints.wait()
            if future is not None:
                future.result()
            if writer is not None:
                writer.wait()
                os.remove(path)
                path = None
            dist.barrier()
            if path and trainer.rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    if trainer.rank == 0:
        out = {k: {"blocking": statistics.median(b for b, _, _ in v), "durable": statistics.median(d for _, d, _ in v),
                   "rss": max(g for _, _, g in v)} for k, v in runs.items()}
        out["steps"] = {k: statistics.mean(v) for k, v in steps.items()}
        out["step_counts"] = {k: len(v) for k, v in steps.items()}
        with open(result, "w") as f:
            json.dump(out, f)
    shutdown()


STEPS_ALONE = 5  # steps timed per repeat with no save running


def _steps_while(trainer, busy, control, at_least: int = 1) -> list[float]:
    """Training steps, each timed (its slowest rank's time), for as long as ``busy()`` holds on any rank and at
    least ``at_least``: what the training loop sees while a save's background work runs. A step calls
    ``train_step`` itself: ``train()`` would wait for the pending commit at its end."""
    import time

    import torch

    times: list[float] = []
    while len(times) < at_least or _max_over_ranks(int(busy()), control):
        start = time.perf_counter()
        trainer.train_step(trainer.next_batch())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        trainer.state.step += 1
        times.append(_max_over_ranks_f(time.perf_counter() - start, control))
    return times


def _max_over_ranks_f(value: float, group=None) -> float:
    """The largest ``value`` over every rank (a step or a save lasts as long as its slowest rank), over ``group``
    (gloo: CPU tensors whatever backend training uses)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t)


def _max_over_ranks(value: int, group=None) -> int:
    """The largest ``value`` over every rank, over ``group`` (gloo)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return int(t)


def save_rows(script: str, work: str, args, port: int, engine: str, env: dict[str, str] | None = None) -> tuple[list, dict[str, str]]:
    """Run ``script --saves RESULT`` on 2 processes and turn its timings into rows and their comparison."""
    import json

    result = os.path.join(work, "saves.json")
    out = os.path.join(work, "saves")
    measure([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
             f"--master_port={port}", os.path.abspath(script), "--saves", result, "--train", out, "--hidden", str(args.hidden),
             "--layers", str(args.layers), "--repeat", str(args.repeat), "--batch-size", str(getattr(args, "batch_size", BATCH_SIZE)),
             "--seq-len", str(getattr(args, "seq_len", SEQ_LEN)), *(["--bf16"] if getattr(args, "bf16", False) else [])], env=env)
    with open(result) as f:
        timings = json.load(f)
    engine_blocking, engine_durable = f"save: {engine} alone, blocking", f"save: {engine} alone, until on disk (sync)"
    names = {
        "interop": "save: interop trainer, blocking until committed",
        "interop-background": "save: interop trainer, background commit, blocking",
        "interop-async": "save: interop trainer --async-save, blocking",
    }
    rows = [(engine_blocking, (timings["engine"]["blocking"], timings["engine"]["rss"])),
            (engine_durable, (timings["engine"]["durable"], timings["engine"]["rss"]))]
    reference = {}
    for kind, name in names.items():
        rows.append((name, (timings[kind]["blocking"], timings[kind]["rss"])))
        reference[name] = engine_blocking
        if kind != "interop":
            durable = f"save: interop trainer, {'--async-save' if kind == 'interop-async' else 'background commit'}, until committed + sync"
            rows.append((durable, (timings[kind]["durable"], timings[kind]["rss"])))
            reference[durable] = engine_durable
    if "dcp-async" in timings:
        rows += [("save: torch DCP async_save (model + optimizer), blocking", (timings["dcp-async"]["blocking"], timings["dcp-async"]["rss"])),
                 ("save: torch DCP async_save, until written + sync", (timings["dcp-async"]["durable"], timings["dcp-async"]["rss"]))]
    alone, beside = "step: training step, no save running", "step: training step beside an --async-save's commit"
    rows += [(alone, (timings["steps"]["alone"], 0)), (beside, (timings["steps"]["during-async-save"], 0))]
    reference[beside] = alone
    if "during-dcp-async-save" in timings["steps"]:
        dcp_beside = "step: training step beside DCP async_save's write"
        rows.append((dcp_beside, (timings["steps"]["during-dcp-async-save"], 0)))
        reference[dcp_beside] = alone
    if "during-dd" in timings["steps"]:
        dd_beside = "step: training step beside dd writing a save's bytes (floor)"
        rows.append((dd_beside, (timings["steps"]["during-dd"], 0)))
        reference[dd_beside] = alone
    return rows, reference


def warm(path: str) -> int:
    """Read every file once, so each step reads from the page cache alike; returns the bytes read."""
    total = 0
    for d, _, files in os.walk(path):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                while chunk := fh.read(1 << 24):
                    total += len(chunk)
    return total


def prepare(args, script: str, native_key: str, engine: str, port: int, env: dict[str, str] | None = None) -> Prepared:
    """Train (``script --train DIR`` on 2 processes) unless --workdir already holds the checkpoint; warm it."""
    work = workdir(args.workdir, f"interop-bench-{native_key}-")
    run_dir = os.path.join(work, "run")
    ckpt = os.path.join(run_dir, "checkpoint-1")
    if not os.path.isdir(ckpt):
        wall = measure(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--master_addr=127.0.0.1",
             f"--master_port={port}", os.path.abspath(script), "--train", run_dir, "--hidden", str(args.hidden),
             "--layers", str(args.layers)],
            env=env,
        ).wall
        print(f"trained and saved with {engine} on 2 processes in {wall:.0f} s")
    params = int(subprocess.check_output([sys.executable, os.path.abspath(__file__), str(args.hidden), str(args.layers)]))
    native = os.path.join(ckpt, native_key)  # an older trainer's layout; today's keeps the engine's files beside the manifest
    native = native if os.path.isdir(native) else ckpt
    size = warm(native)
    print(f"model: {describe(args.hidden, args.layers)}, hidden {args.hidden}, {args.layers} layers, {params / 1e6:.0f}M parameters; "
          f"{engine} checkpoint on 2 processes: {size / 2**30:.2f} GiB")
    return Prepared(work, ckpt, native)


def main(doc: str, collect, train_and_save, layers: int | None = None, saves=None) -> None:
    """An engine benchmark's command line: ``--train DIR`` (each process under torchrun; with ``--saves`` the
    save timings instead of a checkpoint), else measure and print."""
    p = parser(doc)
    if layers is not None:
        p.set_defaults(layers=layers)
    args = p.parse_args()
    if args.experts:
        os.environ[EXPERTS_ENV] = str(args.experts)
    if args.train and args.saves:
        saves(args)
        return
    if args.train:
        train_and_save(args.train, args.hidden, args.layers)
        return
    report(collect(args), args.repeat, kept=bool(args.workdir))


def report(section: Section, repeat: int, kept: bool = True) -> None:
    print_table(section.rows, section.reference)
    if kept:  # a temporary work directory is removed at exit
        print(f"\nfiles under {section.work}")


def count_parameters(hidden: int, layers: int) -> int:
    """In a child process: a parent that imported torch would lend its resident pages to every step's peak RSS
    (a forked child's high-water mark survives exec)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(model_config(hidden, layers)).parameters())


if __name__ == "__main__":
    print(count_parameters(int(sys.argv[1]), int(sys.argv[2])))
