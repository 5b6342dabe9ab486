"""refstore: a node-local reference store for RL data (R3).

    import refstore
    client = refstore.connect(autostart=True)        # finds or starts this node's master
    ref = client.put({"tokens": tokens, "topk": topk})  # one copy into shared memory; ref < 200 B
    views = client.get(ref)                           # zero-copy, read-only numpy / torch views
    client.release(ref)                               # free now (or let the lease expire)

See README.md for leases, soft pins, eviction, keyed objects, the disk tier, peer masters,
manifests, remote get, faults and Ray helpers.
"""

from .client import Client, connect
from .errors import (
    CallerError,
    InjectedFault,
    MasterRestarted,
    MasterUnavailable,
    ObjectEvicted,
    ObjectExpired,
    ObjectGone,
    ObjectReleased,
    PeerError,
    PoolFull,
    RefstoreError,
    UnknownObject,
)
from .launch import start_master_process
from .manifest import Manifest, materialize
from .master import Master, MasterThread
from .protocol import KeyEvent, KeysLost, KeysRemoved, KeysStored, PeerStatus, Stats
from .putget import Payloads, checksum, gather
from .ref import Ref
from .subscription import KeySubscription

__version__ = "0.1.0"

__all__ = [
    "CallerError",
    "Client",
    "InjectedFault",
    "KeyEvent",
    "KeySubscription",
    "KeysLost",
    "KeysRemoved",
    "KeysStored",
    "Manifest",
    "Master",
    "MasterRestarted",
    "MasterThread",
    "MasterUnavailable",
    "ObjectEvicted",
    "ObjectExpired",
    "ObjectGone",
    "ObjectReleased",
    "Payloads",
    "PeerError",
    "PeerStatus",
    "PoolFull",
    "Ref",
    "RefstoreError",
    "Stats",
    "UnknownObject",
    "checksum",
    "connect",
    "gather",
    "materialize",
    "start_master_process",
]
