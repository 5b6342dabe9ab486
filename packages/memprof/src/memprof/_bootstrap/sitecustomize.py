"""Put on PYTHONPATH by `memprof run`: starts memprof, then runs any other sitecustomize."""

import contextlib
import importlib
import os
import sys

_here = os.path.dirname(os.path.abspath(__file__))
_saved_path = list(sys.path)
_this = sys.modules.pop(__name__, None)
try:
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _here]
    with contextlib.suppress(ImportError):
        importlib.import_module("sitecustomize")
finally:
    sys.path[:] = _saved_path
    if _this is not None:
        sys.modules.setdefault(__name__, _this)

if os.environ.get("MEMPROF_AUTOSTART") == "1":
    from memprof._autostart import start_from_env

    start_from_env()
