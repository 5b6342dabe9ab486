"""Start memprof from the environment set by `memprof run` (imported by our sitecustomize)."""

from __future__ import annotations

import os


def start_from_env() -> None:
    import memprof

    sig = os.environ.get("MEMPROF_SIGNAL", "SIGUSR2")
    if sig in ("", "0", "none"):
        signum = 0
    elif sig.isdigit():
        signum = int(sig)
    else:
        import signal

        signum = int(getattr(signal, sig))
    memprof.start(
        mean=int(os.environ.get("MEMPROF_MEAN", memprof.DEFAULT_MEAN)),
        out_dir=os.environ.get("MEMPROF_OUT", "memprof-out"),
        interval=float(os.environ.get("MEMPROF_INTERVAL", "60")),
        keep=int(os.environ.get("MEMPROF_KEEP", "5")),
        signum=signum,
        native=os.environ.get("MEMPROF_NATIVE") == "1",
        seed=int(os.environ.get("MEMPROF_SEED", "0")),
    )
