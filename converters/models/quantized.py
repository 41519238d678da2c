"""Pre-quantized Hugging Face checkpoints (GPT-OSS's MXFP4 experts: ``*_blocks`` / ``*_scales``; DeepSeek-V3's
block-wise FP8: ``weight`` / ``weight_scale_inv``) read as transformers' ``from_pretrained`` gives them on a machine
without quantized kernels: dequantized to the model's dtype.

Which stored tensors make which weight, and how, is transformers' quantizer's answer (its ``serialized_names`` and the
``dequantize`` load operation ``from_pretrained`` runs with ``dequantize=True``); nothing about a quantization method is
written here. Why dequantize: every target holds weights to train or load as the model's (Megatron, DeepSpeed and
accelerate train them; universal is a training checkpoint), and transformers trains no pre-quantized model either.

A stack of experts (GPT-OSS's ``gate_up_proj``: every stored tensor of it has the experts first) is dequantized one
expert at a time, as parts of one tensor: a writer that takes one expert (Megatron's) dequantizes that one alone.
"""

from __future__ import annotations

import logging
from typing import Any

from interop.lazy_import import torch

from interop.errors import ConversionError
from interop.tensors import LazyTensor, TensorSpec, concat, dtype_from_name, dtype_name

from .facts import meta_model

log = logging.getLogger(__name__)


def _quantizer(quantization: Any, where: str) -> Any:
    """transformers' quantizer of a checkpoint's ``quantization_config``, set to dequantize (as ``from_pretrained`` with
    ``dequantize=True``); one line naming the file and the method where transformers cannot."""
    if not isinstance(quantization, dict):
        raise ConversionError(f"{where}: quantization_config is a {type(quantization).__name__}, not a mapping")
    method = quantization.get("quant_method")
    try:
        from transformers.quantizers.auto import AutoHfQuantizer

        quantizer = AutoHfQuantizer.from_config(dict(quantization), pre_quantized=True)
    except Exception as exc:  # noqa: BLE001 - any failure means transformers cannot read it
        raise ConversionError(f"{where}: quantization_config {method!r}: transformers cannot read it ({exc})") from None
    dequantize = quantizer.get_load_operations().get("dequantize")
    if dequantize is None or not quantizer.serialized_names or not hasattr(quantizer.quantization_config, "dequantize"):
        raise ConversionError(f"{where}: a {method!r}-quantized checkpoint, which transformers does not dequantize on loading; "
                              "convert the model's unquantized weights")
    quantizer.quantization_config.dequantize = True
    return quantizer, dequantize(quantizer)


def _groups(names: list[str], serialized: dict[str, list[str]]) -> dict[str, dict[str, str]]:
    """Each weight stored quantized -> its stored tensors by their serialized name (``gate_up_proj_blocks`` -> the
    tensor): the weights whose stored names include a companion (a scale) beside the weight's own."""
    leaf_of = {s: p for p, ss in serialized.items() for s in ss}
    groups: dict[str, dict[str, str]] = {}
    for name in names:
        prefix, _, leaf = name.rpartition(".")
        if leaf in leaf_of:
            groups.setdefault(f"{prefix}.{leaf_of[leaf]}" if prefix else leaf_of[leaf], {})[leaf] = name
    return {target: g for target, g in groups.items() if set(g) - {target.rpartition(".")[2]}}


# dtypes no trainable weight is held in: a tensor left in one after dequantizing lost its scale (or was never dequantized)
_PACKED = ("float8", "float4", "float6")


def dequantized(config: dict[str, Any] | None, tensors: dict[str, LazyTensor],
                where: str = "config.json") -> tuple[dict[str, LazyTensor], dict[str, Any] | None, list[str]]:
    """``tensors`` with each quantized weight dequantized (lazily, checked as its stored tensors are), the config without
    its ``quantization_config``, and a note; as they are for an unquantized checkpoint. ``where``: the config's path."""
    quantization = (config or {}).get("quantization_config")
    if not quantization:
        return tensors, config, []
    quantizer, op = _quantizer(quantization, where)
    groups = _groups(list(tensors), quantizer.serialized_names)
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    for target, group in groups.items():
        if target in tensors and target not in group.values():  # both a weight as it is and its quantized parts
            raise ConversionError(f"{tensors[target].origin}: {target} is stored both as it is and quantized "
                                  f"({', '.join(sorted(group.values()))}); which one is the model's is not known")
    members = {n: target for target, g in groups.items() for n in g.values()}  # each stored part -> the weight it makes
    packed = [n for n, t in tensors.items() if n not in members and t.spec.dtype_name.startswith(_PACKED)]
    if packed:
        raise ConversionError(f"{tensors[packed[0]].origin}: {packed[0]} is stored {tensors[packed[0]].spec.dtype_name} without the "
                              f"scales its {quantization.get('quant_method')!r} quantization reads it with "
                              f"({', '.join(quantizer.serialized_names.get(packed[0].rpartition('.')[2], []))}); "
                              f"{len(packed)} tensor(s) so")
    if not groups:
        return tensors, config, [f"{where}'s quantization_config ({quantization.get('quant_method')}) quantizes none of "
                                 "the stored tensors: read as they are"]
    named = str(config.get("dtype") or config.get("torch_dtype") or "float32").removeprefix("torch.")
    try:
        dtype = dtype_from_name(named)
    except ValueError:
        raise ConversionError(f"{where}: dtype {named!r} is no dtype to dequantize into") from None
    config["dtype"] = dtype_name(dtype)  # (before the model is asked of it: the key its answers are kept under)
    meta = meta_model(config)
    out: dict[str, LazyTensor] = {}
    for name, t in tensors.items():
        if name not in members:
            out[name] = t
            continue
        target = members[name]
        if target not in out:
            out[target] = _dequantized_tensor(target, {leaf: tensors[n] for leaf, n in groups[target].items()}, op, meta, dtype)
    method = quantization.get("quant_method")
    return out, config, [f"{len(groups)} {method}-quantized weight(s) dequantized to {dtype_name(dtype)} as transformers' "
                         "from_pretrained does without quantized kernels; the output is not quantized"]


def _held(meta: Any, name: str) -> bool:
    try:
        meta.get_parameter(name)
    except (AttributeError, TypeError):
        return False
    return True


def _run(op: Any, inputs: dict[str, Any], target: str, meta: Any, dtype: Any) -> Any:
    """transformers' dequantize operation on one weight's stored tensors, as its loader calls it (each input a list of
    one; the model where it holds the weight, whose dtype some operations take), then in the model's dtype."""
    held = meta is not None and _held(meta, target)
    out = op.convert({k: [v] for k, v in inputs.items()}, model=meta if held else None, full_layer_name=target if held else None,
                     missing_keys=set())
    (value,) = out.values()
    value = value[0] if isinstance(value, list) else value
    return value.to(dtype)


def _dequantized_tensor(target: str, stored: dict[str, LazyTensor], op: Any, meta: Any, dtype: Any) -> LazyTensor:
    origin = f"{next(iter(stored.values())).origin} ({target}, dequantized)"

    def run(inputs: dict[str, Any]) -> Any:
        try:
            return _run(op, inputs, target, meta, dtype)
        except Exception as exc:  # noqa: BLE001 - transformers' operation failing on these bytes: one line naming them
            raise ConversionError(f"{origin}: {', '.join(f'{k} {t.spec.describe()}' for k, t in stored.items())} do not "
                                  f"dequantize: {exc}") from None

    shape = tuple(run({k: torch.empty(t.spec.shape, dtype=t.spec.dtype, device="meta") for k, t in stored.items()}).shape)
    spec = TensorSpec(shape, dtype)
    firsts = {t.spec.shape[0] if t.spec.shape else None for t in stored.values()}
    if len(shape) < 2 or firsts != {shape[0]} or shape[0] < 2:  # one block grid over the whole tensor: dequantized whole
        return LazyTensor(spec, lambda: run({k: t.load() for k, t in stored.items()}), origin)

    def part(e: int) -> LazyTensor:  # a stack's entry (an expert): its rows of every stored tensor, dequantized alone
        rows = {k: t.spec.numel // shape[0] for k, t in stored.items()}
        sliced = {k: t.flat_slice(e * rows[k], (e + 1) * rows[k]).reshaped((1, *t.spec.shape[1:])) for k, t in stored.items()}
        return LazyTensor(TensorSpec((1, *shape[1:]), dtype), lambda: run({k: t.load() for k, t in sliced.items()}), f"{origin}[{e}]")

    return concat([part(e) for e in range(shape[0])], dtype_name(dtype), origin)
