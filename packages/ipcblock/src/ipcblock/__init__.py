"""The 30-byte IpcBlock descriptor and ParseBlock KV layouts."""

__version__ = "0.1.0"
