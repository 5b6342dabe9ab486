"""4-byte-head request/response RPC over asyncio streams."""

__version__ = "0.1.0"
