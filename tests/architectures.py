"""Tiny models of many Hugging Face architectures, built from configs with odd sizes (no hub): the cases of
tests/test_architectures.py. Each is (name, model_type, architecture, config overrides); norms and biases are
randomised so that a weight taken from the wrong place cannot pass for the right one.

Run as a module, it fills docs/architectures.md: every architecture through every target, each checked by the
target's own loader:

    python -m tests.architectures --out docs/architectures.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import transformers

V = 131  # an odd vocabulary: no size lines up by chance
LLAMA = dict(hidden_size=36, intermediate_size=52, num_attention_heads=6, num_key_value_heads=2, num_hidden_layers=2,
             vocab_size=V, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

ARCHITECTURES: dict[str, tuple[str, str, dict]] = {
    "llama": ("llama", "LlamaForCausalLM", dict(LLAMA)),
    "llama-tied": ("llama", "LlamaForCausalLM", dict(LLAMA, tie_word_embeddings=True)),
    "mistral": ("mistral", "MistralForCausalLM", dict(LLAMA, sliding_window=16)),
    "qwen2": ("qwen2", "Qwen2ForCausalLM", dict(LLAMA)),  # attention bias
    "qwen3": ("qwen3", "Qwen3ForCausalLM", dict(LLAMA, head_dim=6)),  # q / k norms
    "gemma": ("gemma", "GemmaForCausalLM", dict(LLAMA, head_dim=6)),  # tied by default, scaled embedding
    "gemma2": ("gemma2", "Gemma2ForCausalLM", dict(LLAMA, head_dim=6, sliding_window=16)),  # soft-capping
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM", dict(LLAMA, head_dim=6, sliding_window=16)),  # q / k norms, local + global
    "phi3": ("phi3", "Phi3ForCausalLM", dict(LLAMA, num_key_value_heads=6)),  # fused qkv and gate_up
    "opt": ("opt", "OPTForCausalLM", dict(hidden_size=36, ffn_dim=52, num_attention_heads=6, num_hidden_layers=2, vocab_size=V,
                                          word_embed_proj_dim=36, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "falcon": ("falcon", "FalconForCausalLM", dict(hidden_size=36, num_attention_heads=6, num_hidden_layers=2, vocab_size=V,
                                                   bos_token_id=1, eos_token_id=2)),  # parallel attention
    "bloom": ("bloom", "BloomForCausalLM", dict(hidden_size=36, n_head=6, n_layer=2, vocab_size=V, bos_token_id=1, eos_token_id=2,
                                                pad_token_id=0)),  # ALiBi
    "gpt2": ("gpt2", "GPT2LMHeadModel", dict(n_embd=36, n_head=6, n_layer=2, vocab_size=V, n_positions=64, bos_token_id=1,
                                             eos_token_id=2)),  # Conv1D
    "gpt_neox": ("gpt_neox", "GPTNeoXForCausalLM", dict(hidden_size=36, intermediate_size=52, num_attention_heads=6, num_hidden_layers=2,
                                                        vocab_size=V, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)),
    "bert": ("bert", "BertForMaskedLM", dict(hidden_size=36, intermediate_size=52, num_attention_heads=6, num_hidden_layers=2,
                                             vocab_size=V, max_position_embeddings=64, pad_token_id=0)),  # encoder
    "t5": ("t5", "T5ForConditionalGeneration", dict(d_model=36, d_ff=52, num_heads=6, d_kv=6, num_layers=2, vocab_size=V,
                                                    pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)),  # encoder-decoder
    "llama-classifier": ("llama", "LlamaForSequenceClassification", dict(LLAMA, num_labels=3)),  # a classification head
    "llava": ("llava", "LlavaForConditionalGeneration", dict(  # multimodal: nested text_config (tied) and vision_config
        text_config=dict(LLAMA, model_type="llama", tie_word_embeddings=True), image_token_index=V - 1, pad_token_id=0,
        vision_config=dict(model_type="clip_vision_model", hidden_size=24, intermediate_size=40, num_attention_heads=4,
                           num_hidden_layers=2, image_size=28, patch_size=14, projection_dim=24))),
    "mixtral": ("mixtral", "MixtralForCausalLM", dict(LLAMA, num_local_experts=4, num_experts_per_tok=2)),  # MoE
    "qwen2_moe": ("qwen2_moe", "Qwen2MoeForCausalLM", dict(LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20,
                                                           shared_expert_intermediate_size=24)),  # MoE with a shared expert
    "qwen3_moe": ("qwen3_moe", "Qwen3MoeForCausalLM", dict(LLAMA, head_dim=6, num_experts=4, num_experts_per_tok=2,
                                                           moe_intermediate_size=20)),  # MoE, q / k norms
    # MLA attention (low-rank q and kv), one dense layer first, routed experts in groups with a score-correction bias
    # (a buffer: no gradient, no optimizer state), a shared expert
    "deepseek_v3": ("deepseek_v3", "DeepseekV3ForCausalLM", dict(
        LLAMA, num_key_value_heads=6, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2, first_k_dense_replace=1,
        q_lora_rank=12, kv_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=6, moe_intermediate_size=20,
        n_shared_experts=1, rope_parameters=dict(rope_type="default", rope_theta=10000.0))),
    # experts stored fused (gate_up interleaved) with per-expert biases, a router bias, attention sinks
    "gpt_oss": ("gpt_oss", "GptOssForCausalLM", dict(LLAMA, head_dim=6, num_local_experts=4, num_experts_per_tok=2,
                                                     intermediate_size=20, sliding_window=16, rope_parameters=dict(
                                                         rope_type="default", rope_theta=10000.0),
                                                     layer_types=["sliding_attention", "full_attention"])),
    # transformers' conversion patterns written as regular expressions (``\\.experts.*.w1.weight``), and a renaming
    # (``.norm.`` -> ``.kv_norm.``) that from_pretrained does not apply to a key the model already has (model.norm)
    "deepseek_v4": ("deepseek_v4", "DeepseekV4ForCausalLM", dict(
        vocab_size=V, hidden_size=32, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4, head_dim=16, q_lora_rank=16,
        n_routed_experts=4, num_experts_per_tok=2, o_groups=2, o_lora_rank=8, index_n_heads=2, index_head_dim=8, index_topk=4,
        qk_rope_head_dim=8, sliding_window=8, max_position_embeddings=64, num_nextn_predict_layers=0, bos_token_id=1, eos_token_id=2)),
}
# architectures with tests of their own, outside the grid of every target above: Ernie 4.5 MoE's modules build a
# parameter frozen (e_score_correction_bias, 2-D), which from_pretrained makes trainable
OUTSIDE_GRID: dict[str, tuple[str, str, dict]] = {
    "ernie4_5_moe": ("ernie4_5_moe", "Ernie4_5_MoeForCausalLM", dict(LLAMA, head_dim=6, moe_num_experts=4, moe_k=2,
                                                                     moe_intermediate_size=20, moe_layer_start_index=1)),
    # GLM-4.5's: a dense layer first, then MoE layers with a sigmoid router (a score-correction bias, groups, scaled
    # weights) and a shared expert; q/k/v biases, q/k norms, rotary embeddings on half of each head (tests/test_megatron_moe.py)
    "glm4_moe": ("glm4_moe", "Glm4MoeForCausalLM", dict(
        LLAMA, num_hidden_layers=3, head_dim=8, n_routed_experts=4, num_experts_per_tok=2, n_group=2, topk_group=1,
        first_k_dense_replace=1, moe_intermediate_size=20, n_shared_experts=1, routed_scaling_factor=2.5, attention_bias=True,
        use_qk_norm=True, rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5))),
    # Llama 3.1's rotary scaling (rope_type llama3, factor 8) on a theta and head size that put frequencies in each of
    # its three bands (kept, smoothed, divided by the factor)
    "llama3": ("llama", "LlamaForCausalLM", dict(LLAMA, head_dim=12, max_position_embeddings=131072, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192))),
    # Qwen3's long-context YaRN (factor 4 over an original context; the cos/sin factor moves), the correction range
    # not rounded (truncate false)
    "qwen3_yarn": ("qwen3", "Qwen3ForCausalLM", dict(LLAMA, head_dim=12, max_position_embeddings=128, rope_parameters=dict(
        rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=32, truncate=False))),
    # DeepSeek-V3's model as DeepSeek-V2-Lite has it: q without a low-rank bottleneck (q_lora_rank None), YaRN
    # rotary scaling (DeepSeek-V2-Lite's factor; mscales apart: the cos/sin factor and the softmax scale both move); and rotary embeddings on halves of the
    # rotary part rather than interleaved pairs (rope_interleave False)
    "deepseek_v3_plain_q": ("deepseek_v3", "DeepseekV3ForCausalLM", dict(
        ARCHITECTURES["deepseek_v3"][2], q_lora_rank=None, rope_interleave=False, qk_rope_head_dim=6, rope_parameters=dict(
            rope_type="yarn", rope_theta=10000.0, factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0, beta_slow=1.0,
            mscale=1.0, mscale_all_dim=0.707))),
    # GPT-OSS as released: YaRN on a 150000 base with the correction range not rounded (truncate false), windows on every
    # other layer (shorter than the test's sequences), and a clamp low enough that the tiny model's activations meet it
    "gpt_oss_yarn": ("gpt_oss", "GptOssForCausalLM", dict(
        ARCHITECTURES["gpt_oss"][2], sliding_window=8, max_position_embeddings=64, swiglu_limit=0.5, rope_parameters=dict(
            rope_type="yarn", rope_theta=150000.0, factor=4.0, original_max_position_embeddings=16, beta_fast=32.0, beta_slow=1.0,
            truncate=False))),
}


def spec(name: str) -> tuple[str, str, dict]:
    """(model_type, architecture, config overrides) of a model of the grid or outside it."""
    return ARCHITECTURES.get(name) or OUTSIDE_GRID[name]


FSDP2_CANNOT_RUN = ("bert", "t5")  # ties across modules accelerate's FSDP2 shards apart: FSDP2 refuses the model itself
MOE = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3", "gpt_oss", "deepseek_v4")  # one fused module tensor per layer (one file tensor per expert but GPT-OSS's)


def build(name: str) -> transformers.PreTrainedModel:
    model_type, architecture, overrides = spec(name)
    config = transformers.AutoConfig.for_model(model_type, architectures=[architecture], **overrides)
    torch.manual_seed(0)
    model = getattr(transformers, architecture)(config)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if p.dim() == 1:  # norms and biases start at 1 / 0: make each one its own
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
        kept = model.state_dict()
        for bname, b in model.named_buffers():  # persistent ones too (a router's score-correction bias starts at 0:
            if bname in kept and b.is_floating_point() and b.dim() == 1:  # one dropped would pass for one kept)
                b.copy_(torch.rand(b.shape, generator=g) * 0.1)
    return model.eval()


# --- conversions and the engines' own loaders --------------------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]


def saved(root: Path, name: str) -> tuple[transformers.PreTrainedModel, Path]:
    model = build(name)
    model.save_pretrained(root / name / "hf")
    return model, root / name / "hf"


def with_mtp(model, hf: Path, seed: int = 7) -> dict[str, torch.Tensor]:
    """A hub release's multi-token-prediction layer added to ``hf`` (save_pretrained writes none): DeepSeek-V3's and
    GLM-4.5's layout, ``model.layers.<num_hidden_layers>.``: a decoder layer of the last one's kind (values apart from
    it), its enorm / hnorm / eh_proj and shared_head.norm, and copies of the embedding and head. transformers'
    MtpModel loads it (see :func:`mtp_model`). Returns the tensors added."""
    from safetensors.torch import load_file, save_file

    n, h = model.config.num_hidden_layers, model.config.hidden_size
    path = next(hf.glob("*.safetensors"))
    tensors = load_file(str(path))
    g = torch.Generator().manual_seed(seed)
    added = {k.replace(f"model.layers.{n - 1}.", f"model.layers.{n}."): v + 0.05 * torch.randn(v.shape, generator=g).to(v.dtype)
             for k, v in tensors.items() if k.startswith(f"model.layers.{n - 1}.")}
    for name in ("enorm", "hnorm", "shared_head.norm"):
        added[f"model.layers.{n}.{name}.weight"] = 1 + 0.1 * torch.randn(h, generator=g)
    added[f"model.layers.{n}.eh_proj.weight"] = 0.1 * torch.randn(h, 2 * h, generator=g)
    added[f"model.layers.{n}.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].clone()
    added[f"model.layers.{n}.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    save_file({**tensors, **added}, str(path), metadata={"format": "pt"})
    return added


def mtp_model(hf: Path):
    """(the model, transformers' MtpModel) as from_pretrained loads them from ``hf``. MtpModel.from_pretrained finds the
    MTP layers by the model class's ignored-key patterns, written for the hub release's layer count
    (``model.layers.61`` for DeepSeek-V3): this model's own count is given instead."""
    from transformers.modeling_layers import MtpModel

    model = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).eval()
    n = model.config.num_hidden_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n + k}\..*" for k in range(model.config.num_mtp_layers)]
    return model, MtpModel.from_pretrained(model).eval()


def mtp_logits(model, mtp) -> torch.Tensor:
    """Each MTP layer's logits on :func:`logits`' ids, [layer, batch, position, vocab]: at position i, layer k's
    prediction from the main model's last hidden state and the k next tokens (positions without them left out)."""
    ids = (torch.arange(14).reshape(2, 7) * 5) % model.config.vocab_size
    out = []
    with torch.no_grad():
        hidden = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
        for k in range(mtp.num_mtp_layers):
            s = ids.shape[1] - 1 - k
            hidden = mtp.forward_layer(k, hidden[:, :s], torch.arange(s).expand(ids.shape[0], s), None, input_ids=ids[:, k + 1:])
            out.append(mtp._project_to_logits(hidden))
    return torch.stack(out) if len({o.shape for o in out}) == 1 else out


def logits(model, config) -> torch.Tensor:
    ids = (torch.arange(14).reshape(2, 7) * 5) % config.get_text_config().vocab_size
    extra = {"decoder_input_ids": ids} if getattr(config, "is_encoder_decoder", False) else {}
    with torch.no_grad():
        return model(input_ids=ids, **extra).logits


def engine_load(root: Path, names: list[str], engine: str, stage: int = 0) -> list[dict]:
    """Each model (saved under ``root`` unless it is there) converted `--to deepspeed|accelerate --world-size 2`, then loaded by the
    engine's own loader on 2 processes, one launch for all (tests/arch_worker.py): one result per model."""
    from converters import registry
    from tests.conftest import run_workers, worker_env

    pairs = []
    for name in names:
        hf = root / name / "hf"
        if not hf.exists():
            saved(root, name)
        dst = root / name / f"{engine}{stage}"
        extra = {"world_size": 2, "zero_stage": stage, "param_groups": "single"} if engine == "deepspeed" else {"world_size": 2}
        if engine == "fsdp2":
            extra["fsdp"] = True
        registry.writer("accelerate" if engine == "fsdp2" else engine).write(registry.read(str(hf))[1], str(dst), registry.Options(extra=extra))
        pairs.append(f"{hf}={dst}")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
           str(ROOT / "tests" / "arch_worker.py"), engine, str(stage) if engine == "deepspeed" else "-", *pairs]
    done = run_workers(cmd, worker_env(), timeout=1800)
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


ENGINE_LIMIT = "the engine cannot run this model"


def dcp_load(root: Path, name: str) -> dict:
    """``--to dcp``, then what a torch user does: the model built from the config with other weights,
    ``dcp.load({"model": model.state_dict()}, checkpoint_id=DST)`` and ``load_state_dict``; the result as
    :func:`engine_load`'s."""
    import torch.distributed.checkpoint as dcp

    from converters import registry

    hf, dst = root / name / "hf", root / name / "dcp"
    if not hf.exists():
        saved(root, name)
    registry.writer("dcp").write(registry.read(str(hf))[1], str(dst), registry.Options())
    cls = getattr(transformers, spec(name)[1])
    config = transformers.AutoConfig.from_pretrained(hf)
    torch.manual_seed(1234)  # other weights than the checkpoint's: the load must replace every one
    model = cls._from_config(config).eval()
    state = {"model": model.state_dict()}
    dcp.load(state, checkpoint_id=str(dst))
    model.load_state_dict(state["model"])
    reference = cls.from_pretrained(hf).eval()
    ours, theirs = model.state_dict(), reference.state_dict()
    return {
        "hf": str(hf), "loaded": str(dst),
        "missing": sorted(set(theirs) - set(ours)), "unexpected": sorted(set(ours) - set(theirs)),
        "different": sorted(k for k in theirs if k in ours and not torch.equal(ours[k], theirs[k])),
        "logits_equal": bool(torch.equal(logits(model, config), logits(reference, config))),
    }


def problem(result: dict) -> str | None:
    """What is wrong with one model's load, or None."""
    if "engine_error" in result:
        return f"{ENGINE_LIMIT}: {result['engine_error']}"
    if result["loaded"] is None:
        return "the engine found no checkpoint"
    for key in ("missing", "unexpected", "different"):
        if result[key]:
            return f"{key}: {result[key][:3]}"
    return None if result["logits_equal"] else "logits differ"


def through(root: Path, name: str, target: str, *flags: str) -> str:
    """HF -> ``target`` -> universal -> HF through the CLI: 'ok' when from_pretrained gives every weight and the
    logits back, else the refusal's line or what differs."""
    from tests.conftest import worker_env

    hf, work = root / name / "hf", root / name / target
    cli = [sys.executable, "-m", "converters.cli", "convert"]
    for src, dst, extra in ((hf, work / "out", ["--to", target, *flags]), (work / "out", work / "back", ["--to", "hf"])):
        done = subprocess.run(cli + [str(src), str(dst), *extra], capture_output=True, text=True, env=worker_env(), cwd=ROOT)
        if done.returncode != 0:
            return "refused: " + done.stderr.strip().splitlines()[-1].removeprefix("interop convert: error: ")
    cls = getattr(transformers, spec(name)[1])
    model, back = cls.from_pretrained(hf).eval(), cls.from_pretrained(work / "back").eval()
    theirs = model.state_dict()
    wrong = [k for k, t in back.state_dict().items() if k not in theirs or not torch.equal(t, theirs[k])]
    if wrong:
        return f"FAIL: {wrong[:3]} differ"
    return "ok" if torch.equal(logits(back, back.config), logits(model, model.config)) else "FAIL: logits differ"


def grid(root: Path) -> dict[tuple[str, str], str]:
    cells: dict[tuple[str, str], str] = {}
    for name in ARCHITECTURES:
        saved(root, name)
        cells[(name, "universal / hf")] = through(root, name, "universal")
        cells[(name, "hf-trainer")] = through(root, name, "hf-trainer")
        cells[(name, "megatron")] = through(root, name, "megatron", "--tp", "2")
        cells[(name, "megatron-dist")] = through(root, name, "megatron-dist", "--tp", "2")
        cells[(name, "dcp")] = problem(dcp_load(root, name)) or "ok"
    names = list(ARCHITECTURES)
    for engine, stage, column in (("deepspeed", 1, "ZeRO-1"), ("deepspeed", 2, "ZeRO-2"), ("deepspeed", 3, "ZeRO-3"),
                                  ("accelerate", 0, "accelerate DDP"), ("fsdp2", 0, "accelerate FSDP2")):
        for name, result in zip(names, engine_load(root, names, engine, stage)):
            cells[(name, column)] = problem(result) or "ok"
    return cells


COLUMNS = ["universal / hf", "hf-trainer", "dcp", "ZeRO-1", "ZeRO-2", "ZeRO-3", "accelerate DDP", "accelerate FSDP2", "megatron",
           "megatron-dist"]


def table(cells: dict[tuple[str, str], str]) -> str:
    lines = [
        "# Architectures",
        "",
        "Generated by `python -m tests.architectures --out docs/architectures.md` (rows of it run in "
        "`tests/test_architectures.py`; every row under `-m slow`). Each architecture is a tiny random model built "
        "from its config with odd sizes and randomised norms and biases (tests/architectures.py). A cell is `ok` when "
        "the target's own loader, pointed at `interop convert`'s output, gives every weight and the logits of "
        "`from_pretrained` on the source: `universal / hf` through universal and back; `hf-trainer` through a Trainer "
        "checkpoint (`model.safetensors` under save_pretrained's names, `optimizer.pt` numbering the module's "
        "parameters) and back; `ZeRO-n` DeepSpeed's "
        "`engine.load_checkpoint` on 2 processes (`--to deepspeed --world-size 2 --zero-stage n`); `accelerate DDP` "
        "`accelerator.load_state` on 2 processes, and with accelerate's FSDP2 plugin (`--fsdp`, SHARDED_STATE_DICT); "
        "`dcp` torch's `dcp.load({\"model\": model.state_dict()})` into the model built from its config; "
        "`megatron`, `megatron-dist` at TP2 and back to Hugging Face. "
        "`refused` quotes the one line the converter exits 2 with.",
        "",
        "| architecture | " + " | ".join(COLUMNS) + " |",
        "|---" * (len(COLUMNS) + 1) + "|",
    ]
    for name, (model_type, architecture, _) in ARCHITECTURES.items():
        row = [cells.get((name, c), "") for c in COLUMNS]
        short = ["ok" if r == "ok" else "refused" if r.startswith("refused") else "engine's limit" if r.startswith(ENGINE_LIMIT) else r
                 for r in row]
        lines.append(f"| {name} (`{architecture}`) | " + " | ".join(short) + " |")
    lines += ["", "Refusals (one line each, exit 2, nothing written):", ""]
    refused: dict[tuple[str, str], list[str]] = {}
    for name in ARCHITECTURES:
        for column in COLUMNS:
            cell = cells.get((name, column), "")
            if cell.startswith("refused"):
                refused.setdefault((name, cell.removeprefix("refused: ")), []).append(column)
    for (name, line), columns in refused.items():
        lines.append(f"- {name} ({', '.join(columns)}): {line}")
    limits = [(name, column, cells[(name, column)]) for name in ARCHITECTURES for column in COLUMNS
              if cells.get((name, column), "").startswith(ENGINE_LIMIT)]
    if limits:
        lines += ["", "The engine's limit (the engine cannot run the model at all: its first forward fails the same way with or without a checkpoint):", ""]
        lines += [f"- {name} ({column}): {cell.removeprefix(ENGINE_LIMIT + ': ')}" for name, column, cell in limits]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/architectures.md")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = table(grid(Path(tmp)))
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
