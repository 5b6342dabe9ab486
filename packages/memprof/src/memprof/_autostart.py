"""Start memprof from the environment set by `memprof run` (imported by our sitecustomize)."""

from __future__ import annotations

import os
import signal


def start_from_env() -> None:
    import memprof

    sig = os.environ.get("MEMPROF_SIGNAL", "SIGUSR2")
    signum = 0 if sig in ("", "0", "none") else int(getattr(signal, sig, sig))
    memprof.start(
        mean=int(os.environ.get("MEMPROF_MEAN", memprof.DEFAULT_MEAN)),
        out_dir=os.environ.get("MEMPROF_OUT", "memprof-out"),
        interval=float(os.environ.get("MEMPROF_INTERVAL", "60")),
        keep=int(os.environ.get("MEMPROF_KEEP", "5")),
        signum=signum,
        native=os.environ.get("MEMPROF_NATIVE") == "1",
        seed=int(os.environ.get("MEMPROF_SEED", "0")),
    )
