"""dtype names shared by the safetensors files, the manifest and the CLI."""

from __future__ import annotations

import torch

# safetensors dtype code <-> torch dtype. The manifest uses torch's names ("float32"), the files use codes.
_ST_CODES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "U16": torch.uint16,
    "U32": torch.uint32,
    "U64": torch.uint64,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_TORCH_TO_CODE = {v: k for k, v in _ST_CODES.items()}


def st_code(dtype: torch.dtype) -> str:
    try:
        return _TORCH_TO_CODE[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors encoding") from None


def from_st_code(code: str) -> torch.dtype:
    try:
        return _ST_CODES[code]
    except KeyError:
        raise ValueError(f"unknown safetensors dtype {code!r}") from None


def dtype_name(dtype: torch.dtype) -> str:
    """'float32' for torch.float32: the name used in manifests and tables."""
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
