"""Child process for CLI tests: retains memory from two known sites, snapshots, then grows."""

import sys

import memprof

keep = []


def retain_bytearrays(n: int) -> None:
    for _ in range(n):
        keep.append(bytearray(20_000))


def retain_strings(n: int) -> None:
    for i in range(n):
        keep.append("s" * 150 + str(i))


retain_bytearrays(1000)
retain_strings(20_000)
assert memprof.flush(30)
first = memprof.writer_info()["last_path"]
retain_bytearrays(3000)  # the growth `memprof diff` must find
assert memprof.flush(30)
print(first)
print(memprof.writer_info()["last_path"])
sys.stdout.flush()
