"""Accelerate on a machine without an accelerator: the one compatibility shim, kept here and nowhere else.

accelerate only turns on FSDP for GPU-like distributed types, so with ``cpu=True`` (or no device) an FSDP
plugin is silently ignored and the model is wrapped in DDP. :func:`enable_cpu_fsdp` promotes ``MULTI_CPU`` to
``FSDP`` right after ``AcceleratorState`` initialises, storing the plugin where accelerate's own FSDP path
reads it; prepare then wraps with FSDP2 and save_state/load_state take their sharded (DCP) path.
It does nothing where a GPU (or any accelerator accelerate knows) is present. ``tests/test_accelerate.py``
fails if accelerate changes what this relies on.
"""

from __future__ import annotations

import functools
import logging

log = logging.getLogger(__name__)

_MARK = "_interop_cpu_fsdp"


def has_accelerator() -> bool:
    import torch

    acc = getattr(torch, "accelerator", None)
    if acc is not None and hasattr(acc, "is_available"):
        return bool(acc.is_available())
    return torch.cuda.is_available()


def enable_cpu_fsdp() -> bool:
    """Patch ``AcceleratorState`` so that an FSDP plugin is honoured on CPU; True when the patch is active."""
    if has_accelerator():
        return False
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__
    if getattr(init, _MARK, False):
        return True

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin")
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin
            self.distributed_type = DistributedType.FSDP
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP
            log.info("no accelerator: running accelerate's FSDP%s path on CPU processes (gloo)", plugin.fsdp_version)

    setattr(__init__, _MARK, True)
    AcceleratorState.__init__ = __init__
    return True
