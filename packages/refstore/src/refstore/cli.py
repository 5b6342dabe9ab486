"""``refstore`` command line: serve, stop, stats, peers."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys

from . import discovery
from .disk_tier import DEFAULT_SPILL_QUEUE
from .master import PEER_FETCH_TIMEOUT_S, PEER_TIMEOUT_S


def _cmd_serve(args: argparse.Namespace) -> int:
    from .master import Master, serve

    def ready(master: Master) -> None:
        if args.ready_line:
            sys.stdout.write(f"ready {master.address} {master.epoch}\n")
            sys.stdout.flush()
            # Whoever waited for the ready line may go away: never write to that pipe again.
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, 1)
            os.close(devnull)
        else:
            print(
                f"refstore master {master.name!r} epoch {master.epoch} at {master.address}",
                flush=True,
            )

    try:
        asyncio.run(
            serve(
                args.name,
                args.size,
                args.host,
                args.port,
                advertise=args.advertise,
                ready=ready,
                remote=args.remote,
                peers=args.peer,
                peer_timeout_s=args.peer_timeout,
                peer_fetch_timeout_s=args.peer_fetch_timeout,
                disk=args.disk,
                disk_size=args.disk_size,
                spill_queue=args.spill_queue,
            )
        )
    except Exception as err:
        print(f"refstore serve: {type(err).__name__}: {err}", file=sys.stderr)
        return 1
    return 0


def _cmd_stop(args: argparse.Namespace) -> int:
    from .client import Client

    if not discovery.master_running(args.name):
        print(f"no refstore master {args.name!r} is running")
        return 0
    with Client(args.name) as client:
        client.shutdown_master("refstore stop")
    return 0


def _cmd_peers(args: argparse.Namespace) -> int:
    import msgspec

    from .client import Client

    with Client(args.name) as client:
        peers = client.peers(add=args.add, remove=args.remove)
    print(msgspec.json.format(msgspec.json.encode(peers).decode()))
    return 0


def _cmd_stats(args: argparse.Namespace) -> int:
    import msgspec

    from .client import Client

    with Client(args.name) as client:
        print(msgspec.json.format(msgspec.json.encode(client.stats()).decode()))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="refstore", description=__doc__)
    parser.add_argument("-v", "--verbose", action="store_true")
    sub = parser.add_subparsers(dest="command", required=True)
    serve_p = sub.add_parser("serve", help="run a local master (owns the node's pool)")
    serve_p.add_argument("--name", default=discovery.DEFAULT_NAME)
    serve_p.add_argument("--size", default="1G", help="pool size, e.g. 512M, 4G")
    serve_p.add_argument("--host", default="127.0.0.1")
    serve_p.add_argument("--port", type=int, default=0)
    serve_p.add_argument("--advertise", default=None, help="address other nodes use (host:port)")
    serve_p.add_argument("--remote", default="auto", choices=("auto", "kvt", "rpc"))
    serve_p.add_argument(
        "--peer",
        action="append",
        default=None,
        metavar="HOST:PORT",
        help="another node's master to ask for keys a lookup misses here (repeat for more; "
        "default: env REFSTORE_PEERS, comma-separated)",
    )
    serve_p.add_argument(
        "--peer-timeout",
        type=float,
        default=PEER_TIMEOUT_S,
        help="seconds a peer may take to answer",
    )
    serve_p.add_argument(
        "--peer-fetch-timeout",
        type=float,
        default=PEER_FETCH_TIMEOUT_S,
        help="seconds the move of a peer's objects may take",
    )
    serve_p.add_argument(
        "--disk",
        default=None,
        metavar="DIR",
        help="a directory for the disk tier: evicted keyed cache entries are written there and "
        "promoted back by lookups (default: env REFSTORE_DISK; none if unset)",
    )
    serve_p.add_argument(
        "--disk-size",
        default=None,
        help="the disk tier's file, e.g. 20G (default: env REFSTORE_DISK_SIZE, else 16G)",
    )
    serve_p.add_argument(
        "--spill-queue",
        default=DEFAULT_SPILL_QUEUE,
        help="bytes of evicted entries waiting for the disk writer (more are dropped)",
    )
    serve_p.add_argument("--ready-line", action="store_true", help=argparse.SUPPRESS)
    serve_p.set_defaults(func=_cmd_serve)
    peers_p = sub.add_parser("peers", help="list (and add or remove) the master's peers")
    peers_p.add_argument("--name", default=discovery.DEFAULT_NAME)
    peers_p.add_argument("--add", action="append", default=[], metavar="HOST:PORT")
    peers_p.add_argument("--remove", action="append", default=[], metavar="HOST:PORT")
    peers_p.set_defaults(func=_cmd_peers)
    for cmd, func, text in (
        ("stop", _cmd_stop, "stop the local master"),
        ("stats", _cmd_stats, "print the local master's stats"),
    ):
        p = sub.add_parser(cmd, help=text)
        p.add_argument("--name", default=discovery.DEFAULT_NAME)
        p.set_defaults(func=func)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
