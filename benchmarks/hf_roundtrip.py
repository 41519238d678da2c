"""HF import/export: interop's streaming converters against transformers' own load + save_pretrained.

    python benchmarks/hf_roundtrip.py [--hidden 1024 --layers 16] [--workdir DIR]

Builds a Llama from a config (246M parameters at the defaults), saves it with save_pretrained, then
runs each step in its own process and reports wall time and that process's peak RSS:

  interop convert SRC UNI --to universal      vs  from_pretrained(SRC) + save_pretrained(REF)
  interop convert UNI OUT --to hf             (the same reference: transformers has no other re-export)
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from measure import Section, measure, print_table, workdir  # noqa: E402

REFERENCE = """
import sys, transformers
m = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1])
m.save_pretrained(sys.argv[2])
"""


EXPERTS_ENV = "INTEROP_BENCH_EXPERTS"  # set by --experts; every process of a benchmark (torchrun's too) inherits it


def model_config(hidden: int, layers: int):
    """The benchmarks' Llama: 246M parameters at hidden 1024 and 16 layers, 257M at 17. With --experts N (the
    environment's INTEROP_BENCH_EXPERTS), a Mixtral: its MLP as N experts of intermediate ``hidden``, 2 per token
    (260M parameters at hidden 1024, 7 layers, 8 experts)."""
    import transformers

    experts = int(os.environ.get(EXPERTS_ENV) or 0)
    common = dict(vocab_size=32000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64,
                  num_key_value_heads=max(1, hidden // 256), tie_word_embeddings=False)
    if experts:
        return transformers.MixtralConfig(intermediate_size=hidden, num_local_experts=experts, num_experts_per_tok=2, **common)
    return transformers.LlamaConfig(intermediate_size=int(hidden * 2.75), **common)


def describe(hidden: int, layers: int) -> str:
    experts = int(os.environ.get(EXPERTS_ENV) or 0)
    return f"Mixtral ({experts} experts, 2 per token)" if experts else "Llama"


def build(src: str, hidden: int, layers: int) -> int:
    import torch
    import transformers

    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(model_config(hidden, layers))
    model.save_pretrained(src, max_shard_size="1GB")
    return sum(p.numel() for p in model.parameters())


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--workdir", default=None)
    p.add_argument("--repeat", type=int, default=1, help="runs of each step; the median wall time is reported")
    p.add_argument("--build", default=None, help=argparse.SUPPRESS)
    return p


def collect(args) -> Section:
    """Build the model (once per workdir), then measure: the rows, which row each is compared with, the outputs."""
    work = workdir(args.workdir, "interop-bench-")
    src, uni, out, ref = (os.path.join(work, d) for d in ("src_hf", "universal", "out_hf", "ref_hf"))
    for d in (uni, out, ref):
        shutil.rmtree(d, ignore_errors=True)
    if not os.path.isdir(src):
        # in a child process: a child forked from a parent holding the model would inherit its resident pages
        measure([sys.executable, os.path.abspath(__file__), "--build", src, "--hidden", str(args.hidden), "--layers", str(args.layers)])
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    print(f"model: Llama, hidden {args.hidden}, {args.layers} layers, fp32 safetensors {size / 2**30:.2f} GiB")
    cli = [sys.executable, "-m", "converters.cli"]
    n = args.repeat
    rows = [
        ("import torch + transformers (baseline)", measure([sys.executable, "-c", "import torch, transformers"], None, n)),
        ("HF -> universal (interop)", measure(cli + ["convert", src, uni, "--to", "universal"], None, n, uni, floor=True)),
        ("universal -> HF (interop)", measure(cli + ["convert", uni, out, "--to", "hf"], None, n, out, floor=True)),
        ("from_pretrained + save_pretrained (transformers)", measure([sys.executable, "-c", REFERENCE, src, ref], None, n, ref)),
    ]
    reference = rows[-1][0]
    return Section(rows, {name: reference for name, _ in rows[1:-1]}, {"universal": uni, "hf": out, "ref_hf": ref}, work)


def main() -> None:
    args = parser().parse_args()
    if args.build:
        build(args.build, args.hidden, args.layers)
        return
    section = collect(args)
    print_table(section.rows, section.reference)
    if args.workdir:  # a temporary one is removed at exit
        print(f"\nfiles under {section.work}")


if __name__ == "__main__":
    main()
