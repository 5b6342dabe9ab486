"""Imported by user_sites.py: builds a table while it is being imported."""

TABLE = [bytearray(4096) for _ in range(2000)]  # ~8 MiB allocated during `import`
