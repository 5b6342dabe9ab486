"""Always-on sampling memory profiler."""

__version__ = "0.1.0"
