"""``kvt-demo``: two processes move a scattered KV-like region; kvt next to a plain socket.

Needs the ``demo`` extra (``rich``, for the table); without it the command says so and exits 2.
"""

from __future__ import annotations

import argparse
import sys

from kvt.loopback import run_loopback


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="kvt-demo",
        description="Move a KV-like region of scattered blocks between two processes with kvt "
        "(zero-copy TCP) and compare with a plain contiguous sendall/recv_into of the same bytes.",
    )
    parser.add_argument("--mib", type=int, default=256, help="region size in MiB (default 256)")
    parser.add_argument(
        "--block-kib", type=int, nargs="+", default=[64], help="block sizes in KiB (default 64)"
    )
    parser.add_argument("--repeats", type=int, default=2, help="timed runs per row (best shown)")
    args = parser.parse_args(argv)
    total = args.mib << 20
    block_sizes = tuple(k << 10 for k in args.block_kib)
    if any(total % b for b in block_sizes) or args.mib <= 0 or args.repeats <= 0:
        parser.error("the region size must be a positive multiple of every block size")

    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print("kvt-demo needs rich for its table: pip install 'kvt[demo]'", file=sys.stderr)
        return 2

    console = Console()
    result = run_loopback(
        total, block_sizes, repeats=args.repeats,
        progress=lambda msg: console.print(f"[dim]... {msg}[/dim]"),
    )  # fmt: skip

    table = Table(title=f"{args.mib} MiB between two processes over loopback TCP")
    for column, justify in (("transfer", "left"), ("best GB/s", "right"),
                            ("median GB/s", "right"), ("vs plain", "right"),
                            ("exact", "center")):  # fmt: skip
        table.add_column(column, justify=justify)
    plain = result.plain
    table.add_row(plain.label, f"{plain.best_gbps:.2f}", f"{plain.median_gbps:.2f}", "1.00x", "")
    all_ok = True
    for m in result.kvt:
        ok = result.verified[m.block_size]
        all_ok &= ok
        table.add_row(
            m.label, f"{m.best_gbps:.2f}", f"{m.median_gbps:.2f}",
            f"{m.best_gbps / plain.best_gbps:.2f}x", "yes" if ok else "NO",
        )  # fmt: skip
    console.print(table)
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())
