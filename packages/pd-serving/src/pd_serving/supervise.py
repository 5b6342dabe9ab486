"""The parent of one vLLM instance under ``pdserve up``: SIGTERM to it drains the instance first.

``pdserve up --drain-grace S`` starts each P and D as
``python -m pd_serving.supervise --drain URL --instance NAME --grace S -- <vLLM's argv>``. The
supervisor runs vLLM as its child (same process group, output and CPUs; vLLM gets SIGTERM if the
supervisor dies) and waits for a signal or the child's exit, nothing else::

    running --SIGTERM--> draining: POST URL?instance=NAME&wait=S (the proxy moves its streams
       |                 to other instances and sends it nothing new; at most S seconds, or at
       |                 once when the proxy is unreachable)
       |                   --> stopping: SIGTERM to vLLM --vLLM exits--> exit with its code
       |--SIGINT--> passed on to vLLM
       '--vLLM exits--> exit with its code

A second SIGTERM while draining stops vLLM at once. The proxy sees the instance drained before
it goes, so ``pdserve up`` goes on serving with the others.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import signal
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Sequence

_PR_SET_PDEATHSIG = 1
_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGCHLD}


def _say(message: str) -> None:
    print(f"pdserve-supervise: {message}", file=sys.stderr, flush=True)


def drain_through_proxy(drain_url: str, instance: str, grace_s: float) -> dict | None:
    """The proxy's last drain report (its NDJSON stream's last line), or None if it failed."""
    query = urllib.parse.urlencode({"instance": instance, "wait": f"{grace_s:g}"})
    request = urllib.request.Request(f"{drain_url}?{query}", method="POST")
    try:
        with urllib.request.urlopen(request, timeout=grace_s + 10.0) as resp:
            lines = [line for line in resp.read().splitlines() if line.strip()]
        return json.loads(lines[-1]) if lines else None
    except (OSError, ValueError) as exc:  # unreachable, refused, timed out, not JSON
        _say(f"{instance}: the proxy did not drain it ({exc}); stopping it as it is")
        return None


def _child_setup() -> None:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def supervise(argv: Sequence[str], drain_url: str, instance: str, grace_s: float) -> int:
    """Run ``argv`` to its end; SIGTERM drains ``instance`` through ``drain_url`` first."""
    # Blocked before the child exists, so no signal is lost; sigwait takes them one by one.
    signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    # No thread exists yet (the drain thread starts on SIGTERM): preexec_fn is safe here.
    child = subprocess.Popen(list(argv), preexec_fn=_child_setup)  # noqa: PLW1509
    drain: threading.Thread | None = None
    while True:
        sig = signal.sigwait(_SIGNALS)
        if child.poll() is not None:
            return child.returncode  # an unfinished drain call (a daemon thread) ends with us
        if sig == signal.SIGINT:
            child.send_signal(signal.SIGINT)
        elif sig == signal.SIGTERM and drain is None:
            _say(f"{instance}: SIGTERM: draining it through the proxy (grace {grace_s:g} s)")

            def drain_then_stop() -> None:
                report = drain_through_proxy(drain_url, instance, grace_s)
                if report is not None:
                    _say(f"{instance}: {report.get('phase')}, {report.get('moved', 0)} moved")
                child.terminate()

            drain = threading.Thread(target=drain_then_stop, name="pdserve-drain", daemon=True)
            drain.start()
        elif sig == signal.SIGTERM:
            child.terminate()  # a second SIGTERM: no more waiting


def main(args: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pd_serving.supervise", description=__doc__)
    parser.add_argument("--drain", required=True, help="the proxy's /admin/drain URL")
    parser.add_argument("--instance", required=True, help="the instance's URL or name")
    parser.add_argument("--grace", type=float, required=True, help="seconds a drain may take")
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then vLLM's command line")
    parsed = parser.parse_args(args)
    argv = parsed.argv[1:] if parsed.argv[:1] == ["--"] else parsed.argv
    if not argv:
        parser.error("no command to run (give it after --)")
    return supervise(argv, parsed.drain, parsed.instance, parsed.grace)


if __name__ == "__main__":
    sys.exit(main())
