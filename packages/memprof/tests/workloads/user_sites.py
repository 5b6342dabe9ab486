"""Child process for the grouping tests: the user's functions allocate through a stdlib call
(json.loads), through numpy (np.save into a BytesIO; np.ones in native mode) and at import."""

import io
import json
import sys

import imported_table  # noqa: F401  (its table is allocated while importing)
import memprof
import numpy as np

keep = []


def load_json(n: int) -> None:
    text = "[" + ",".join(f'"{i:0100d}"' for i in range(n)) + "]"
    keep.append(json.loads(text))  # the strings are made inside json's decoder


def save_array(n: int) -> None:
    buf = io.BytesIO()
    np.save(buf, np.ones(n))  # the bytes are written by numpy's format.write_array
    keep.append(buf)


def make_ones(n: int) -> None:
    keep.append(np.ones(n))  # native mode: numpy's ones() mallocs the data


load_json(40_000)
assert memprof.flush(30)
print(memprof.writer_info()["last_path"])
save_array(2_000_000)
make_ones(2_000_000)
assert memprof.flush(30)
print(memprof.writer_info()["last_path"])
sys.stdout.flush()
