"""The AMX plugin: registered for vLLM, and after it runs the process holds the tile state."""

from __future__ import annotations

import ctypes
import platform
from importlib.metadata import entry_points

import pytest

torch = pytest.importorskip("torch")

_SYS_ARCH_PRCTL = 158
_ARCH_GET_XCOMP_PERM = 0x1022
_XFEATURE_XTILEDATA = 18


def _tile_state_permitted() -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    features = ctypes.c_ulong(0)
    assert libc.syscall(_SYS_ARCH_PRCTL, _ARCH_GET_XCOMP_PERM, ctypes.byref(features)) == 0
    return bool(features.value & (1 << _XFEATURE_XTILEDATA))


def test_plugin_is_registered_for_vllm() -> None:
    plugins = entry_points(group="vllm.general_plugins")
    (plugin,) = [e for e in plugins if e.name.startswith("hybrid")]
    assert plugin.value == "hybrid_connector.cpu_features:request_amx_tiles"


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is x86-only")
def test_after_the_plugin_amx_kernels_may_run() -> None:
    from hybrid_connector.cpu_features import request_amx_tiles

    request_amx_tiles()
    if torch.cpu._is_amx_tile_supported():
        assert _tile_state_permitted()
