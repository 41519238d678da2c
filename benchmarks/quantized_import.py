"""Importing a pre-quantized release: a GPT-OSS with MXFP4 experts, as the hub ships it, dequantized by interop's
reader against transformers' own dequantizing load + save_pretrained.

    python benchmarks/quantized_import.py [--hidden 1024 --layers 4 --experts 32] [--workdir DIR]

Builds a GPT-OSS from a config (bf16; its experts' weights as MXFP4 ``*_blocks`` / ``*_scales``, 32 to a block),
then runs each step in its own process and reports wall time and that process's peak RSS:

  interop convert Q UNI --to universal                    vs  from_pretrained(Q) (dequantizing on CPU) + save_pretrained(REF)
  interop convert Q MEG --to megatron-dist --ep-size 2    (no reference: Megatron-Bridge's import needs CUDA)
"""

from __future__ import annotations

import argparse
import json
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


def build(dst: str, hidden: int, layers: int, experts: int) -> int:
    """A GPT-OSS saved as the hub keeps it: bf16, its experts MXFP4 (random blocks, scales near 2**0), and
    config.json's quantization_config."""
    import torch
    import transformers
    from safetensors.torch import save_file

    config = transformers.AutoConfig.for_model(
        "gpt_oss", architectures=["GptOssForCausalLM"], dtype="bfloat16", vocab_size=32000, hidden_size=hidden,
        intermediate_size=hidden, num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
        head_dim=64, num_local_experts=experts, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=4096)
    with torch.device("meta"):
        meta = transformers.GptOssForCausalLM(config)
    g = torch.Generator().manual_seed(0)
    tensors, params = {}, 0
    for name, p in meta.state_dict().items():
        params += p.numel()
        leaf = name.rpartition(".")[2]
        if leaf in ("gate_up_proj", "down_proj"):
            e, cols, rows = p.shape  # the module's (in, out) per expert; stored (out, in / 32 blocks, 16 bytes)
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            tensors[f"{name}_scales"] = torch.randint(122, 130, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
        else:
            tensors[name] = (torch.randn(p.shape, generator=g) * 0.02).to(torch.bfloat16)
    os.makedirs(dst, exist_ok=True)
    save_file(tensors, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    raw = {**config.to_dict(), "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(raw, f)
    return params


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--workdir", default=None)
    p.add_argument("--repeat", type=int, default=1, help="runs of each step; the median wall time is reported")
    p.add_argument("--build", default=None, help=argparse.SUPPRESS)
    return p


def collect(args) -> Section:
    work = workdir(args.workdir, "interop-bench-mxfp4-")
    src, uni, meg, ref = (os.path.join(work, d) for d in ("mxfp4_hf", "universal", "megatron_dist", "ref_hf"))
    for d in (uni, meg, ref):
        shutil.rmtree(d, ignore_errors=True)
    if not os.path.isdir(src):  # in a child process (its pages are not this one's)
        measure([sys.executable, os.path.abspath(__file__), "--build", src, "--hidden", str(args.hidden), "--layers", str(args.layers),
                 "--experts", str(args.experts)])
    size = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src))
    print(f"model: GPT-OSS, hidden {args.hidden}, {args.layers} layers, {args.experts} MXFP4 experts; stored {size / 2**30:.2f} GiB")
    cli = [sys.executable, "-m", "converters.cli"]
    n = args.repeat
    rows = [
        ("MXFP4 HF -> universal, dequantized (interop)", measure(cli + ["convert", src, uni, "--to", "universal"], None, n, uni, floor=True)),
        ("MXFP4 HF -> megatron-dist EP2, dequantized (interop)",
         measure(cli + ["convert", src, meg, "--to", "megatron-dist", "--ep-size", "2"], None, n, meg, floor=True)),
        ("from_pretrained (dequantizing) + save_pretrained (transformers)", measure([sys.executable, "-c", REFERENCE, src, ref], None, n, ref)),
    ]
    reference = rows[-1][0]
    return Section(rows, {name: reference for name, _ in rows[:-1]}, {"universal": uni, "megatron": meg, "ref_hf": ref}, work)


def main() -> None:
    args = parser().parse_args()
    if args.build:
        build(args.build, args.hidden, args.layers, args.experts)
        return
    section = collect(args)
    print_table(section.rows, section.reference)
    if args.workdir:
        print(f"\nfiles under {section.work}")


if __name__ == "__main__":
    main()
