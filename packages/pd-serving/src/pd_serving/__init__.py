"""Launch prefill/decode vLLM instances behind an OpenAI-compatible proxy."""

__version__ = "0.1.0"
