"""Ray helpers: one refstore master per Ray node, and a per-process client for tasks and actors.

    import ray, refstore.ray as rsray
    ray.init()
    rsray.start_masters(pool_size="4G")          # one master actor per alive node (idempotent)

    @ray.remote
    def produce():
        return rsray.client().put(np.ones(1 << 20))   # a Ref: pass it as a plain argument

    @ray.remote
    def consume(ref):
        return rsray.client().get(ref).sum()          # zero-copy on the same node, pulled otherwise

Refs are small msgspec Structs, so Ray pickles them like any argument (no ObjectRef, no Ray object
store involvement). Each master is an actor pinned to its node with NodeAffinitySchedulingStrategy
(``soft=False``), using no CPU, running the master on its own loop thread inside the actor process;
it listens on the node's IP so other nodes' masters can pull from it. Masters live as long as the
driver unless ``detached=True``; ``stop_masters()`` ends them.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from . import discovery
from .client import Client
from .master import MasterThread

NAMESPACE = "refstore"


class _MasterActor:
    def __init__(self, name: str, pool_size: str | int, env: dict[str, str]) -> None:
        os.environ.update(env)
        host = ray.util.get_node_ip_address()
        self._master = MasterThread(name, pool_size, host=host)

    def info(self) -> dict[str, Any]:
        return {
            "address": self._master.address,
            "epoch": self._master.epoch,
            "node_id": ray.get_runtime_context().get_node_id(),
        }

    def close(self) -> None:
        self._master.close()


_master_handles: dict[str, list[Any]] = {}
_MasterActorRemote = ray.remote(num_cpus=0, max_restarts=0)(_MasterActor)


def _actor_name(name: str, node_id: str) -> str:
    return f"refstore-master-{name}-{node_id[:16]}"


def start_masters(
    pool_size: str | int = "1G", name: str = discovery.DEFAULT_NAME, *, detached: bool = False
) -> list[dict[str, Any]]:
    """Start (or find) the master actor of every alive node; returns their addresses."""
    env = {"REFSTORE_DIR": str(discovery.directory())}
    actors = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = node["NodeID"]
        actors.append(
            _MasterActorRemote.options(
                name=_actor_name(name, node_id),
                namespace=NAMESPACE,
                get_if_exists=True,
                lifetime="detached" if detached else None,
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            ).remote(name, pool_size, env)
        )
    # Keep the handles: Ray ends a non-detached actor when its last handle goes away.
    _master_handles.setdefault(name, []).extend(actors)
    return ray.get([a.info.remote() for a in actors])


def stop_masters(name: str = discovery.DEFAULT_NAME) -> None:
    """Close and kill every node's master actor of ``name``."""
    for node in ray.nodes():
        try:
            actor = ray.get_actor(_actor_name(name, node["NodeID"]), namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(actor.close.remote())
        finally:
            ray.kill(actor)
    _master_handles.pop(name, None)


_clients: dict[str, Client] = {}
_clients_lock = threading.Lock()


def client(name: str = discovery.DEFAULT_NAME) -> Client:
    """This process's client of its node's master (created on first use, closed at exit)."""
    with _clients_lock:
        existing = _clients.get(name)
    if existing is not None:
        return existing
    made = Client(name)  # connects: not under the lock
    with _clients_lock:
        existing = _clients.setdefault(name, made)
    if existing is not made:  # another thread made one first
        made.close()
    return existing


def close_clients() -> None:
    with _clients_lock:
        clients = list(_clients.values())
        _clients.clear()
    for c in clients:
        c.close()


atexit.register(close_clients)
