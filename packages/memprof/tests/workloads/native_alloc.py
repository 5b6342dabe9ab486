"""Child for the native-mode test: malloc() from C (outside Python's allocators)."""

import ctypes

import memprof

libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = [ctypes.c_size_t]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
held = []


def native_blocks(n: int, size: int) -> None:
    for _ in range(n):
        p = libc.malloc(size)
        libc.memset(p, 1, size)
        held.append(p)


native_blocks(200, 256 * 1024)  # 50 MiB that Python's allocator hooks never see
assert memprof.stats()["native"] == 1
assert memprof.flush(30)
print(memprof.writer_info()["last_path"], flush=True)
