"""Child for the kill -9 test: snapshots continuously while allocating until it is killed."""

import sys

import memprof

keep = []


def retain_blocks(n: int) -> None:
    for _ in range(n):
        keep.append(bytearray(50_000))


retain_blocks(400)
assert memprof.flush(30)
print("ready", flush=True)
# keep allocating and freeing so that snapshots are being written while the kill lands
i = 0
while True:
    junk = [bytearray(10_000) for _ in range(200)]
    del junk
    i += 1
    if i % 50 == 0:
        memprof.request_snapshot()
    if i == 100:
        print("churning", flush=True)
        sys.stdout.flush()
