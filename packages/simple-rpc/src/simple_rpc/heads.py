"""Registry of the 4-byte heads simple_rpc itself knows about.

Packages define their own `Method`s (with their own heads) in their own `protocol.py`; this module
only holds the seed's examples and the values simple_rpc reserves. Ranges by convention, so that
heads never collide across packages:

    0x4B56xxxx  kvt                0x4843xxxx  hybrid-connector
    0x5253xxxx  refstore           0x5352xxxx  simple-rpc's own (tests, benchmarks)
"""

from __future__ import annotations

# The seed's example: the sender tells the scheduler a transfer finished.
SEND_DONE_REQ = 0x20181218
SEND_DONE_RESP = 0x81218102

# The seed's other control messages, as examples of the convention (ASCII mnemonics; the
# request is upper case, its response lower case).
TRANSFER_KV_REQ = 0x54524B56  # "TRKV"
TRANSFER_KV_RESP = 0x74726B76  # "trkv"
ABORT_REQ = 0x41425254  # "ABRT"
ABORT_RESP = 0x61627274  # "abrt"
LOAD_DONE_REQ = 0x4C444F4E  # "LDON"
LOAD_DONE_RESP = 0x6C646F6E  # "ldon"
SAVE_DONE_REQ = 0x53444F4E  # "SDON"
SAVE_DONE_RESP = 0x73646F6E  # "sdon"
PREFILL_REQ = 0x5052464C  # "PRFL"
PREFILL_RESP = 0x7072666C  # "prfl"

# Reserved: the response head of every error answer (unknown head, bad request, handler raised).
ERROR_RESP = 0x45525221  # "ERR!"

# simple-rpc's own range, for its tests and benchmarks.
ECHO_REQ = 0x53520001
ECHO_RESP = 0x53528001

RESERVED = frozenset({ERROR_RESP})


def name_of(head: int) -> str:
    """Human-readable name of a known head (for logs), or its hex value."""
    for name, value in globals().items():
        if name.isupper() and name != "RESERVED" and value == head:
            return name
    return f"0x{head:08x}"
