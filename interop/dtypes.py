"""dtype names shared by the safetensors files, the manifest and the CLI.

A dtype is named as torch names it ("bfloat16"); the table below answers what the files and the byte path need
(safetensors code, item size) without importing torch, which only a tensor's values need.
"""

from __future__ import annotations

import struct

from .lazy_import import torch

# torch's name -> (safetensors code, bytes per item, floating point). The manifest uses the names, files the codes.
_DTYPES: dict[str, tuple[str, int, bool]] = {
    "float64": ("F64", 8, True),
    "float32": ("F32", 4, True),
    "float16": ("F16", 2, True),
    "bfloat16": ("BF16", 2, True),
    "int64": ("I64", 8, False),
    "int32": ("I32", 4, False),
    "int16": ("I16", 2, False),
    "int8": ("I8", 1, False),
    "uint8": ("U8", 1, False),
    "uint16": ("U16", 2, False),
    "uint32": ("U32", 4, False),
    "uint64": ("U64", 8, False),
    "bool": ("BOOL", 1, False),
    "float8_e4m3fn": ("F8_E4M3", 1, True),
    "float8_e5m2": ("F8_E5M2", 1, True),
}
_CODE_TO_NAME = {code: name for name, (code, _, _) in _DTYPES.items()}


def dtype_name(dtype: "torch.dtype | str") -> str:
    """'float32' for torch.float32, 'float32' or 'float' (an alias): the name used in manifests and tables. An
    unknown name is a ValueError."""
    if isinstance(dtype, str):
        if dtype in _DTYPES:
            return dtype
        dtype = dtype_from_name(dtype)  # a dtype the table leaves out, or an alias: torch knows
    return str(dtype).removeprefix("torch.")


_STRUCT = {"float64": "d", "float32": "f", "float16": "e", "int64": "q", "int32": "i", "int16": "h", "int8": "b",
           "uint8": "B", "bool": "?"}


def unpack_scalar(data: bytes, name: str) -> int | float | bool | None:
    """The value ``tensor.item()`` gives for one element's little-endian bytes, without torch; None for a dtype
    the table does not decode."""
    if name == "bfloat16" and len(data) == 2:
        return struct.unpack("<f", b"\x00\x00" + bytes(data))[0]  # bfloat16 is float32's high half
    code = _STRUCT.get(name)
    if code is None or len(data) != struct.calcsize("<" + code):
        return None
    return struct.unpack("<" + code, bytes(data))[0]


def is_dtype_name(name: str) -> bool:
    """Whether torch has a dtype of this name in the table (without importing torch)."""
    return name in _DTYPES


def st_code(dtype: "torch.dtype | str") -> str:
    try:
        return _DTYPES[dtype_name(dtype)][0]
    except KeyError:
        raise ValueError(f"dtype {dtype} has no safetensors encoding") from None


def name_of_st_code(code: str) -> str:
    """The dtype name of a safetensors code ('BF16' -> 'bfloat16'), without torch."""
    try:
        return _CODE_TO_NAME[code]
    except (KeyError, TypeError):
        raise ValueError(f"unknown safetensors dtype {code!r}") from None


def from_st_code(code: str) -> "torch.dtype":
    return getattr(torch, name_of_st_code(code))


def dtype_from_name(name: str) -> "torch.dtype":
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype name {name!r}")
    return dtype


def itemsize(dtype: "torch.dtype | str") -> int:
    known = _DTYPES.get(dtype_name(dtype))
    if known is not None:
        return known[1]
    return torch.empty((), dtype=dtype_from_name(dtype) if isinstance(dtype, str) else dtype).element_size()


def is_floating(dtype: "torch.dtype | str") -> bool:
    known = _DTYPES.get(dtype_name(dtype))
    if known is not None:
        return known[2]
    return (dtype_from_name(dtype) if isinstance(dtype, str) else dtype).is_floating_point
