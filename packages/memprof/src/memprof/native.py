"""Finding jemalloc and the MALLOC_CONF that native mode runs with."""

from __future__ import annotations

import os

# lg_prof_sample:19 -> jemalloc samples on average once per 512 KiB, like our Python hooks.
# prof_active:false until memprof.start() has installed its backtrace hook, so nothing is
# sampled with jemalloc's own (slow, libgcc) unwinder at interpreter start-up.
# background_thread:true moves page purging (decay) off the allocating threads; see README
# ("Native mode") for the measured effect of the decay settings on numpy churn.
DEFAULT_MALLOC_CONF = (
    "prof:true,prof_active:false,lg_prof_sample:19,prof_accum:false,background_thread:true"
)

_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2",
    "/usr/lib/aarch64-linux-gnu/libjemalloc.so.2",
    "/usr/lib64/libjemalloc.so.2",
    "/usr/lib/libjemalloc.so.2",
    "/usr/local/lib/libjemalloc.so.2",
)


class NativeModeUnavailable(RuntimeError):
    """Native mode needs a profiling-enabled jemalloc (Debian/Ubuntu: apt install libjemalloc2)."""


def find_jemalloc() -> str | None:
    """MEMPROF_JEMALLOC if set, else the usual distribution paths."""
    override = os.environ.get("MEMPROF_JEMALLOC")
    if override:
        return override if os.path.isfile(override) else None
    for cand in _CANDIDATES:
        if os.path.isfile(cand):
            return cand
    return None


def native_env(
    base: dict[str, str], *, lg_sample: int = 19, extra_conf: str = ""
) -> dict[str, str]:
    """Environment that runs a child under jemalloc with profiling set up for memprof."""
    lib = find_jemalloc()
    if lib is None:
        raise NativeModeUnavailable(
            "native mode needs libjemalloc.so.2 (apt install libjemalloc2, or set MEMPROF_JEMALLOC)"
        )
    env = dict(base)
    preload = env.get("LD_PRELOAD", "")
    env["LD_PRELOAD"] = f"{lib}:{preload}" if preload else lib
    conf = DEFAULT_MALLOC_CONF.replace("lg_prof_sample:19", f"lg_prof_sample:{lg_sample}")
    if extra_conf:
        conf = f"{conf},{extra_conf}"
    env["MALLOC_CONF"] = conf
    return env
