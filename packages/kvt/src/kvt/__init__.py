"""KV-cache transport: access, control and data-plane layers."""

__version__ = "0.1.0"
