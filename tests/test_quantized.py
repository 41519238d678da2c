"""Pre-quantized Hugging Face releases (GPT-OSS's MXFP4 experts, block-wise FP8 as DeepSeek-V3 ships) are read as
transformers' from_pretrained gives them on a machine without quantized kernels: dequantized to the model's dtype, by
transformers' own quantizer operations. The judge is from_pretrained on the quantized directory: every target's
output loads to its weights exactly. Before, a hub GPT-OSS was refused with a misleading line ("expert 0 and 3 more
of 4: missing") and an FP8 model's weights would have been carried as float8 bytes with their scales."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from converters import registry
from tests import architectures
from tests.conftest import ROOT, worker_env

# GPT-OSS with sizes MXFP4's 32-wide blocks divide (hidden 64, experts 64 wide)
GPT_OSS = dict(hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=2,
               vocab_size=131, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=64,
               layer_types=["sliding_attention", "full_attention"], rope_parameters=dict(rope_type="default", rope_theta=10000.0))


def cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "converters.cli", *map(str, args)], capture_output=True, text=True,
                          env=worker_env(), cwd=ROOT)


def convert(src, dst, target: str, **extra) -> list[str]:
    """``interop convert SRC DST --to TARGET`` in this process (the CLI's own reader and writer); the notes."""
    ckpt = registry.read(str(src))[1]
    registry.writer(target).write(ckpt, str(dst), registry.Options(extra=extra))
    return ckpt.notes


def quantized_dir(path, model: transformers.PreTrainedModel, tensors: dict[str, torch.Tensor], quantization: dict) -> None:
    """A directory as a hub release keeps a pre-quantized model: its tensors and config.json's quantization_config."""
    model.save_pretrained(path)
    for f in path.glob("*.safetensors"):
        f.unlink()
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))


@pytest.fixture(scope="module")
def mxfp4(tmp_path_factory):
    """A GPT-OSS whose experts are MXFP4 (``*_blocks``: two FP4 values a byte, 32 to a block; ``*_scales``: a power of
    two per block), the rest as saved, in bf16 as released."""
    root = tmp_path_factory.mktemp("mxfp4")
    config = transformers.AutoConfig.for_model("gpt_oss", architectures=["GptOssForCausalLM"], dtype="bfloat16", **GPT_OSS)
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(config).to(torch.bfloat16)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(3)
    e, h, i = config.num_local_experts, config.hidden_size, config.intermediate_size
    for layer in range(config.num_hidden_layers):
        p = f"model.layers.{layer}.mlp.experts."
        del tensors[p + "gate_up_proj"], tensors[p + "down_proj"]
        for name, (rows, cols) in (("gate_up_proj", (2 * i, h)), ("down_proj", (h, i))):
            tensors[f"{p}{name}_blocks"] = torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
            tensors[f"{p}{name}_scales"] = torch.randint(122, 130, (e, rows, cols // 32), dtype=torch.uint8, generator=g)
    quantized_dir(root / "q", model, tensors, {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]})
    return root / "q"


def loads_as_from_pretrained(quantized, converted_hf, cls) -> None:
    """transformers' own dequantized load of the release, and its load of our output: every weight the same, and ours
    holds no quantization left."""
    theirs = cls.from_pretrained(quantized).eval()
    ours = cls.from_pretrained(converted_hf).eval()
    assert "quantization_config" not in json.loads((converted_hf / "config.json").read_text())
    expected = theirs.state_dict()
    assert {k: (t.dtype, bool(torch.equal(t, expected[k]))) for k, t in ours.state_dict().items()} == {
        k: (t.dtype, True) for k, t in expected.items()}


def test_an_mxfp4_release_is_read_dequantized_as_from_pretrained_gives_it(mxfp4, tmp_path):
    """GPT-OSS's MXFP4 experts through universal and back, and through Megatron's torch_dist at EP2 (each expert
    dequantized alone, as that writer takes them one at a time) and back: transformers' own dequantized weights."""
    assert ("4 mxfp4-quantized weight(s) dequantized to bfloat16 as transformers' from_pretrained does without "
            "quantized kernels; the output is not quantized") in convert(mxfp4, tmp_path / "u", "universal")
    assert "note:      4 mxfp4-quantized weight(s) dequantized to bfloat16" in cli("inspect", mxfp4).stdout  # inspect says it too
    convert(tmp_path / "u", tmp_path / "hf", "hf")
    loads_as_from_pretrained(mxfp4, tmp_path / "hf", transformers.GptOssForCausalLM)
    convert(mxfp4, tmp_path / "meg", "megatron-dist", ep_size=2)
    convert(tmp_path / "meg", tmp_path / "meg-hf", "hf")
    loads_as_from_pretrained(mxfp4, tmp_path / "meg-hf", transformers.GptOssForCausalLM)


def test_a_block_fp8_release_is_read_dequantized_and_engines_load_it(tmp_path):
    """Block-wise FP8 (``weight`` in float8_e4m3fn beside ``weight_scale_inv``, DeepSeek-V3's release format) on a
    Mixtral, whose experts are stored one tensor each: dequantized per stored tensor, then fused into the module's
    stacked experts for the engine targets as any Mixtral is. From universal and back, and DeepSpeed's layout read
    back, every weight is transformers' dequantized one."""
    model, hf = architectures.saved(tmp_path, "mixtral")
    tensors = {}
    for k, v in load_file(hf / "model.safetensors").items():
        if v.dim() == 2 and "embed" not in k and "lm_head" not in k and not k.endswith(".gate.weight"):
            # a 2 x 2 grid of blocks, each with its own scale (the tiny model's sizes stand for 128 x 128 blocks' multiples)
            rows, cols = v.shape[0] // 2, v.shape[1] // 2
            scale = v.reshape(2, rows, 2, cols).abs().amax(dim=(1, 3)) / 448.0
            tensors[k] = (v.reshape(2, rows, 2, cols) / scale[:, None, :, None]).reshape(v.shape).to(torch.float8_e4m3fn)
            tensors[k.removesuffix("weight") + "weight_scale_inv"] = scale.float()
        else:
            tensors[k] = v
    quantized_dir(tmp_path / "q", model, tensors, {"quant_method": "fp8", "activation_scheme": "dynamic",
                                                  "weight_block_size": [128, 128], "modules_to_not_convert": ["lm_head"]})
    ckpt = registry.read(str(tmp_path / "q"))[1]
    assert not any(n.endswith("weight_scale_inv") for n in ckpt.model) and "quantization_config" not in ckpt.config
    for target in ("universal", "deepspeed"):
        convert(tmp_path / "q", tmp_path / target, target)
        convert(tmp_path / target, tmp_path / f"{target}-hf", "hf")
        loads_as_from_pretrained(tmp_path / "q", tmp_path / f"{target}-hf", transformers.MixtralForCausalLM)


def test_a_quantization_transformers_cannot_dequantize_is_one_line(mxfp4, tmp_path):
    """A quantization_config transformers has no dequantizing load for, or cannot read at all: refused in one line
    naming it, nothing written (never carried as packed bytes an engine would train as weights)."""
    from interop.errors import ConversionError

    config = json.loads((mxfp4 / "config.json").read_text())
    for quantization, says in (({"quant_method": "bitsandbytes_4bit"}, "'bitsandbytes_4bit'"),
                               ({"quant_method": "no-such-method"}, "quantization_config 'no-such-method': transformers cannot read it")):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        bad.mkdir()
        shutil.copy(mxfp4 / "model.safetensors", bad / "model.safetensors")
        (bad / "config.json").write_text(json.dumps({**config, "quantization_config": quantization}))
        if quantization["quant_method"] == "no-such-method":  # (in this process: the CLI's line is the same one)
            with pytest.raises(ConversionError, match=re.escape(says)):
                registry.read(str(bad))
            continue
        done = cli("convert", bad, tmp_path / "out", "--to", "universal")
        assert done.returncode == 2 and not (tmp_path / "out").exists(), done.stderr
        assert says in done.stderr.strip().splitlines()[-1], done.stderr


def test_damaged_quantized_tensors_are_one_line_before_anything_is_written(mxfp4, tmp_path):
    """Scales that do not match their blocks, or blocks without their scales: one line naming the file and the
    tensors, found while reading (the dequantization is planned on shapes first), nothing written."""
    from interop.errors import ConversionError

    tensors = load_file(mxfp4 / "model.safetensors")
    name = "model.layers.1.mlp.experts.down_proj_scales"
    for edit, says in ((lambda t: t.__setitem__(name, t[name][:, :-1].contiguous()), "down_proj_scales uint8[4, 63, 2] do not dequantize"),
                       (lambda t: t.pop(name), "down_proj_blocks uint8[4, 64, 2, 16] do not dequantize")):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        shutil.copytree(mxfp4, bad)
        edited = dict(tensors)
        edit(edited)
        save_file(edited, bad / "model.safetensors", metadata={"format": "pt"})
        with pytest.raises(ConversionError) as caught:
            registry.read(str(bad))  # (the CLI's exit 2 and nothing written: the last test below)
        line = str(caught.value)
        assert "model.safetensors" in line and "model.layers.1.mlp.experts.down_proj, dequantized" in line and says in line, line


def test_quantized_input_that_cannot_be_one_model_is_one_line(mxfp4, tmp_path):
    """What would convert to a wrong model, refused naming the file: a weight stored both as it is and quantized (which
    is the model's is not known), an FP8 weight without its scales (its float8 bytes are no weights), a
    quantization_config that is no mapping, a dtype to dequantize into that is none."""
    from interop.errors import ConversionError

    tensors, config = load_file(mxfp4 / "model.safetensors"), json.loads((mxfp4 / "config.json").read_text())
    plain = "model.layers.0.mlp.experts.gate_up_proj"
    fp8 = {**tensors, "model.layers.0.self_attn.q_proj.weight": tensors["model.layers.0.self_attn.q_proj.weight"].to(torch.float8_e4m3fn)}
    for edited, cfg, says in (
            ({**tensors, plain: torch.zeros(4, 64, 128, dtype=torch.bfloat16)}, config,
             f"{plain} is stored both as it is and quantized ({plain}_blocks, {plain}_scales)"),
            (fp8, {**config, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
             "model.layers.0.self_attn.q_proj.weight is stored float8_e4m3fn without the scales its 'fp8' quantization reads it with"),
            (tensors, {**config, "quantization_config": [["quant_method", "mxfp4"]]}, "quantization_config is a list, not a mapping"),
            (tensors, {**config, "dtype": "auto"}, "dtype 'auto' is no dtype to dequantize into")):
        bad = tmp_path / str(len(list(tmp_path.iterdir())))
        bad.mkdir()
        save_file(edited, bad / "model.safetensors", metadata={"format": "pt"})
        (bad / "config.json").write_text(json.dumps(cfg))
        with pytest.raises(ConversionError, match=re.escape(says)) as caught:
            registry.read(str(bad))
        assert str(bad) in str(caught.value)
