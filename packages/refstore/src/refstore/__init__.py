"""Reference store for RL data (R3): shared-memory pool, leases, manifests."""

__version__ = "0.1.0"
