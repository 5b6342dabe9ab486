"""memprof command line: run, top, diff, flamegraph, export."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from . import autostart_env
from .native import NativeModeUnavailable, native_env
from .snapfile import (
    GROUP_INNERMOST,
    GROUP_USER,
    Frame,
    Snapshot,
    SnapshotFormatError,
    diff,
    latest_snapshot,
)


def _fmt_bytes(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{sign}{n:.1f} {unit}" if unit != "B" else f"{sign}{n:.0f} B"
        n /= 1024
    return f"{sign}{n:.1f} TiB"


def _site(path: tuple[Frame, ...]) -> str:
    """The grouping frame, then its callers."""
    return "  <-  ".join(str(f) for f in path)


def _grouping(args: argparse.Namespace) -> dict:
    if args.depth < 1:
        raise SystemExit(f"memprof {args.cmd}: --depth must be >= 1, got {args.depth}")
    return {"group": GROUP_INNERMOST if args.innermost else GROUP_USER, "depth": args.depth}


def _load(arg: str) -> Snapshot:
    path = Path(arg)
    if path.is_dir():
        latest = latest_snapshot(path)
        if latest is None:
            raise SystemExit(f"memprof: no snapshots in {path}")
        path = latest
    try:
        return Snapshot.load(path)
    except (OSError, SnapshotFormatError) as exc:
        raise SystemExit(f"memprof: cannot read snapshot {path}: {exc}") from exc


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = list(args.command)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    if not cmd:
        raise SystemExit(
            "memprof run: give the command after --, e.g. memprof run -- python app.py"
        )
    env = autostart_env(
        args.out,
        interval=args.interval,
        keep=args.keep,
        mean=args.mean,
        signal=args.signal,
        seed=args.seed,
    )
    if args.native:
        try:
            env = native_env(env, extra_conf=args.malloc_conf)
        except NativeModeUnavailable as exc:
            raise SystemExit(f"memprof run --native: {exc}") from exc
        env["MEMPROF_NATIVE"] = "1"
    Path(args.out).mkdir(parents=True, exist_ok=True)
    # exec: the profiled program keeps this pid, so signals (SIGUSR2, kill -9) reach it directly
    try:
        os.execvpe(cmd[0], cmd, env)
    except OSError as exc:
        raise SystemExit(f"memprof run: cannot run {cmd[0]!r}: {exc}") from exc
    return 0  # not reached


def _cmd_top(args: argparse.Namespace) -> int:
    snap = _load(args.snapshot)
    total = snap.total_bytes
    print(f"pid {snap.pid}  live (estimated) {_fmt_bytes(total)}  sampling mean {snap.mean:.0f} B")
    print(f"{'live bytes':>12} {'%':>6} {'objects':>10} {'samples':>8} {'kind':>6}  site")
    for s in snap.sites(**_grouping(args))[: args.n]:
        pct = 100.0 * s.est_bytes / total if total else 0.0
        print(
            f"{_fmt_bytes(s.est_bytes):>12} {pct:6.1f} {s.est_objects:10.0f} "
            f"{s.samples:8d} {s.kind:>6}  {_site(s.path)}"
        )
    if args.stacks:
        print()
        recs = sorted(snap.records, key=lambda r: r.est_bytes, reverse=True)[: args.stacks]
        for r in recs:
            st = snap.stack(r.stack_id)
            print(
                f"{_fmt_bytes(r.est_bytes)} in {r.est_objects:.0f} objects, thread {st.thread_id}"
            )
            for f in st.frames:
                print(f"    {f}")
    return 0


def _cmd_diff(args: argparse.Namespace) -> int:
    a, b = _load(args.before), _load(args.after)
    print(f"live (estimated): {_fmt_bytes(a.total_bytes)} -> {_fmt_bytes(b.total_bytes)}")
    print(f"{'growth':>12} {'before':>12} {'after':>12} {'kind':>6}  site")
    for d in diff(a, b, **_grouping(args))[: args.n]:
        if d.growth_bytes <= 0 and not args.all:
            break
        print(
            f"{_fmt_bytes(d.growth_bytes):>12} {_fmt_bytes(d.before_bytes):>12} "
            f"{_fmt_bytes(d.after_bytes):>12} {d.kind:>6}  {_site(d.path)}"
        )
    return 0


def _cmd_flamegraph(args: argparse.Namespace) -> int:
    from .flamegraph import flamegraph_html

    Path(args.output).write_text(flamegraph_html(_load(args.snapshot)), encoding="utf-8")
    print(f"wrote {args.output}")
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    fmt = "pprof" if args.pprof else args.format
    if fmt is None:
        raise SystemExit("memprof export: choose a format (--format pprof|speedscope)")
    output = args.output or ("memprof.pb.gz" if fmt == "pprof" else "memprof.speedscope.json")
    snap = _load(args.snapshot)
    if fmt == "pprof":
        from .pprof import export_pprof

        export_pprof(snap, output)
    else:
        from .speedscope import export_speedscope

        export_speedscope(snap, output)
    print(f"wrote {output}")
    return 0


def _grouping_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--innermost",
        action="store_true",
        help="group by the frame that allocated (default: the first frame in your code, "
        "outside the standard library and site-packages)",
    )
    p.add_argument(
        "--depth", type=int, default=1, help="frames per site: the site and its N-1 callers"
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="memprof", description="always-on sampling memory profiler")
    sub = p.add_subparsers(dest="cmd", required=True)

    r = sub.add_parser("run", help="run a command with memprof started in its Python processes")
    r.add_argument(
        "--out", default="memprof-out", help="snapshot directory (default ./memprof-out)"
    )
    r.add_argument("--interval", type=float, default=60.0, help="seconds between snapshots")
    r.add_argument("--keep", type=int, default=5, help="snapshots kept per process")
    r.add_argument("--mean", type=int, default=512 * 1024, help="mean bytes between samples")
    r.add_argument("--signal", default="SIGUSR2", help="signal that requests a snapshot (or none)")
    r.add_argument("--seed", type=int, default=0, help="sampling seed (0: random)")
    r.add_argument(
        "--native", action="store_true", help="also sample native allocations (jemalloc)"
    )
    r.add_argument("--malloc-conf", default="", help="extra MALLOC_CONF options for --native")
    r.add_argument("command", nargs=argparse.REMAINDER, help="-- command to run")
    r.set_defaults(func=_cmd_run)

    t = sub.add_parser("top", help="live bytes by allocation site")
    t.add_argument("snapshot", help="snapshot file, or a directory (newest snapshot)")
    t.add_argument("-n", type=int, default=25, help="sites to show")
    t.add_argument("--stacks", type=int, default=0, help="also show the N biggest full stacks")
    _grouping_args(t)
    t.set_defaults(func=_cmd_top)

    d = sub.add_parser("diff", help="what grew between two snapshots")
    d.add_argument("before")
    d.add_argument("after")
    d.add_argument("-n", type=int, default=25)
    d.add_argument("--all", action="store_true", help="also show sites that shrank")
    _grouping_args(d)
    d.set_defaults(func=_cmd_diff)

    f = sub.add_parser("flamegraph", help="self-contained HTML flame graph of live bytes")
    f.add_argument("snapshot")
    f.add_argument("-o", "--output", default="memprof-flamegraph.html")
    f.set_defaults(func=_cmd_flamegraph)

    e = sub.add_parser("export", help="export a snapshot (pprof, speedscope)")
    e.add_argument("snapshot")
    e.add_argument(
        "--format",
        choices=("pprof", "speedscope"),
        help="pprof: gzipped profile.proto (go tool pprof); speedscope: its JSON file format",
    )
    e.add_argument("--pprof", action="store_true", help="same as --format pprof")
    e.add_argument(
        "-o", "--output", help="default memprof.pb.gz or memprof.speedscope.json (by format)"
    )
    e.set_defaults(func=_cmd_export)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
