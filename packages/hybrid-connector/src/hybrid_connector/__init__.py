"""vLLM KV connector runtime on kvt."""

__version__ = "0.1.0"
