"""Ray rollout-to-train pipeline passing R3 references."""

__version__ = "0.1.0"
