"""Make installed wheels' ``WHEEL`` tags agree with the file uv chose, so `uv run` stops
re-installing them: CI's and nox's entry to ``pd_serving.wheel_tags`` (the why is there and in
README.md, "Installing elsewhere"). `pdserve` runs the same fix on every start.

Run it with the venv's interpreter after a `uv sync` into a fresh venv::

    .venv/bin/python .ci/fix_wheel_tags.py [path/to/uv.lock [site-packages dir ...]]

The module is loaded by its path, so this works in venvs that do not hold pd-serving (nox's
per-package sessions); it needs only ``packaging``. Prints one line per wheel it changed (or
could not), nothing when every installed wheel's tags already fit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MODULE = ROOT / "packages" / "pd-serving" / "src" / "pd_serving" / "wheel_tags.py"


def _load_wheel_tags():
    spec = importlib.util.spec_from_file_location("_pd_serving_wheel_tags", MODULE)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {MODULE}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main(argv: list[str]) -> int:
    wheel_tags = _load_wheel_tags()
    lock_path = Path(argv[1]) if len(argv) > 1 else ROOT / "uv.lock"
    search_path = argv[2:] or sys.path  # where to look for installed distributions
    for change in wheel_tags.fix_wheel_tags(lock_path, search_path):
        print(f"fix_wheel_tags: {change.describe()}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
