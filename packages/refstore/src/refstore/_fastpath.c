/* The byte work of a local put and get, in one call each: copying a payload into the pool,
 * writing and reading the object header (layout in header.py). Python does the rest. Also the
 * disk tier's checksum (XXH64) and its hashed reads.
 *
 * Why C: a put and a get run where caches are cold (a Ray actor right after a task dispatch), and
 * there every interpreted step costs microseconds. Each function here replaces several of them.
 *
 * Every function takes the pool's memoryview, never a raw address: holding a buffer export for
 * the call keeps the mapping from being unmapped under it (SharedPool.close() cannot release a
 * view that is exported), and all offsets are checked against the view's length.
 *
 * The header, little-endian (header.py has the same layout for Python's struct):
 *   0 magic "RSo1" | 4 state u32 | 8 oid u64 | 16 tag u64 | 24 header_len u32 | 28 layout_len u32
 *   | 32 nbytes u64 | 40 last_access_ns u64 | 48 lease_deadline_ns u64 | 56 flags u32 | 64 layout
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <unistd.h>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_STREAMING 1
#endif

#define HEADER_FIXED 64
#define CONTROL_BYTES 4096
#define STATE_WRITING 0u
#define STATE_SEALED 1u
#define GOLDEN 0x9E3779B97F4A7C15ull
#define FLAG_MASTER_PATH 1u
/* Below this a copy's destination is likely to be read soon (or fits in cache anyway). */
#define STREAM_MIN (256 * 1024)
/* From here a copy runs without the GIL (a few ms and more: other threads of the caller go on);
 * below, getting the GIL back in a busy process (a Ray actor's threads) costs more than the copy. */
#define RELEASE_GIL_MIN (8 * 1024 * 1024)
/* Each helper thread of a split copy gets at least this much (a thread start is ~30 us). */
#define SPLIT_MIN (8 * 1024 * 1024)
#define MAX_COPY_THREADS 8

static const char MAGIC[4] = {'R', 'S', 'o', '1'};

static int have_avx2 = 0;

#ifdef HAVE_STREAMING
/* Non-temporal stores: the destination's cache lines are not read first (no read-for-ownership)
 * and the copy does not evict the caller's working set. The pool's payloads are written once and
 * read later, by other processes: the case these stores are for. */
__attribute__((target("avx2"))) static void copy_streaming(char *dst, const char *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (head > n)
        head = n;
    memcpy(dst, src, head);
    dst += head;
    src += head;
    n -= head;
    size_t blocks = n / 128;
    for (size_t i = 0; i < blocks; i++) {
        __m256i a = _mm256_loadu_si256((const __m256i *)src);
        __m256i b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64));
        __m256i d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
        src += 128;
        dst += 128;
    }
    /* Streamed stores are weakly ordered: make them visible before the header that seals them. */
    _mm_sfence();
    memcpy(dst, src, n - blocks * 128);
}
#endif

static void copy_one(char *dst, const char *src, size_t n)
{
#ifdef HAVE_STREAMING
    if (have_avx2 && n >= STREAM_MIN) {
        copy_streaming(dst, src, n);
        return;
    }
#endif
    memcpy(dst, src, n);
}

struct copy_part {
    char *dst;
    const char *src;
    size_t n;
};

static void *copy_part_run(void *arg)
{
    struct copy_part *part = arg;
    copy_one(part->dst, part->src, part->n);
    return NULL;
}

/* Copy n bytes with up to `threads` threads (the caller's included), each on a contiguous,
 * page-aligned part; the caller's part is copied by the caller. If a helper thread cannot be
 * started its part is copied by the caller too. Called without the GIL for large copies. */
static void copy_split(char *dst, const char *src, size_t n, int threads)
{
    if (threads > MAX_COPY_THREADS)
        threads = MAX_COPY_THREADS;
    if (threads > 1 && n / SPLIT_MIN < (size_t)threads)
        threads = (int)(n / SPLIT_MIN) > 1 ? (int)(n / SPLIT_MIN) : 1;
    if (threads <= 1) {
        copy_one(dst, src, n);
        return;
    }
    struct copy_part parts[MAX_COPY_THREADS];
    pthread_t helpers[MAX_COPY_THREADS];
    int started[MAX_COPY_THREADS] = {0};
    size_t share = (n / (size_t)threads) & ~(size_t)4095, at = 0;
    for (int i = 0; i < threads; i++) {
        parts[i].dst = dst + at;
        parts[i].src = src + at;
        parts[i].n = i == threads - 1 ? n - at : share;
        at += share;
    }
    for (int i = 1; i < threads; i++)
        started[i] = pthread_create(&helpers[i], NULL, copy_part_run, &parts[i]) == 0;
    copy_one(parts[0].dst, parts[0].src, parts[0].n);
    for (int i = 1; i < threads; i++) {
        if (started[i])
            pthread_join(helpers[i], NULL);
        else
            copy_one(parts[i].dst, parts[i].src, parts[i].n);
    }
}

/* The copy of a payload: without the GIL from RELEASE_GIL_MIN (the buffers stay exported, so
 * neither side can be unmapped meanwhile), split over `threads` threads when asked. */
static void copy_bytes(char *dst, const char *src, size_t n, int threads)
{
    if (n < RELEASE_GIL_MIN) {
        copy_one(dst, src, n);
        return;
    }
    Py_BEGIN_ALLOW_THREADS
    copy_split(dst, src, n, threads);
    Py_END_ALLOW_THREADS
}

static int copy_threads = 1;

static int get_u64(PyObject *obj, uint64_t *out)
{
    unsigned long long value = PyLong_AsUnsignedLongLong(obj);
    if (value == (unsigned long long)-1 && PyErr_Occurred())
        return -1;
    *out = (uint64_t)value;
    return 0;
}

static int get_offset(PyObject *obj, Py_ssize_t *out)
{
    Py_ssize_t value = PyLong_AsSsize_t(obj);
    if (value == -1 && PyErr_Occurred())
        return -1;
    if (value < 0) {
        PyErr_SetString(PyExc_ValueError, "negative offset or size");
        return -1;
    }
    *out = value;
    return 0;
}

static inline void store_u32(char *at, uint32_t value) { memcpy(at, &value, 4); }
static inline void store_u64(char *at, uint64_t value) { memcpy(at, &value, 8); }
static inline uint32_t load_u32(const char *at)
{
    uint32_t value;
    memcpy(&value, at, 4);
    return value;
}
static inline uint64_t load_u64(const char *at)
{
    uint64_t value;
    memcpy(&value, at, 8);
    return value;
}

/* XXH64 (xxHash's 64-bit hash, after its specification): the checksum of the disk tier's records
 * (disk_tier.py). Measured here about 3x zlib's crc32, which made the checksum, not the disk,
 * the bound of a read from the page cache. Little-endian lanes, as everything in this file. */
#define XXH_P1 0x9E3779B185EBCA87ull
#define XXH_P2 0xC2B2AE3D27D4EB4Full
#define XXH_P3 0x165667B19E3779F9ull
#define XXH_P4 0x85EBCA77C2B2AE63ull
#define XXH_P5 0x27D4EB2F165667C5ull
/* A read is hashed chunk by chunk, each while it is still in cache; a multiple of 32. */
#define HASH_CHUNK (256 * 1024)
#define HASH_RELEASE_GIL_MIN (64 * 1024)

typedef struct {
    uint64_t v[4];
    uint64_t seed;
    uint64_t striped; /* bytes consumed as 32-byte stripes */
} xxh64_state;

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t xxh_round(uint64_t acc, uint64_t lane)
{
    acc += lane * XXH_P2;
    return rotl64(acc, 31) * XXH_P1;
}

static inline uint64_t xxh_merge(uint64_t acc, uint64_t v)
{
    acc ^= xxh_round(0, v);
    return acc * XXH_P1 + XXH_P4;
}

static void xxh_init(xxh64_state *s, uint64_t seed)
{
    s->v[0] = seed + XXH_P1 + XXH_P2;
    s->v[1] = seed + XXH_P2;
    s->v[2] = seed;
    s->v[3] = seed - XXH_P1;
    s->seed = seed;
    s->striped = 0;
}

/* n: a multiple of 32. */
static void xxh_stripes(xxh64_state *s, const char *p, size_t n)
{
    uint64_t v0 = s->v[0], v1 = s->v[1], v2 = s->v[2], v3 = s->v[3];
    for (const char *end = p + n; p < end; p += 32) {
        v0 = xxh_round(v0, load_u64(p));
        v1 = xxh_round(v1, load_u64(p + 8));
        v2 = xxh_round(v2, load_u64(p + 16));
        v3 = xxh_round(v3, load_u64(p + 24));
    }
    s->v[0] = v0, s->v[1] = v1, s->v[2] = v2, s->v[3] = v3;
    s->striped += n;
}

/* The hash of everything striped so far followed by the n bytes at p. */
static uint64_t xxh_finish(xxh64_state *s, const char *p, size_t n)
{
    size_t full = n & ~(size_t)31;
    xxh_stripes(s, p, full);
    p += full;
    n -= full;
    uint64_t acc;
    if (s->striped) {
        acc = rotl64(s->v[0], 1) + rotl64(s->v[1], 7) + rotl64(s->v[2], 12) + rotl64(s->v[3], 18);
        for (int i = 0; i < 4; i++)
            acc = xxh_merge(acc, s->v[i]);
    } else {
        acc = s->seed + XXH_P5;
    }
    acc += s->striped + n;
    for (; n >= 8; n -= 8, p += 8) {
        acc ^= xxh_round(0, load_u64(p));
        acc = rotl64(acc, 27) * XXH_P1 + XXH_P4;
    }
    if (n >= 4) {
        acc ^= (uint64_t)load_u32(p) * XXH_P1;
        acc = rotl64(acc, 23) * XXH_P2 + XXH_P3;
        n -= 4;
        p += 4;
    }
    for (; n; n--, p++) {
        acc ^= (uint64_t)(unsigned char)*p * XXH_P5;
        acc = rotl64(acc, 11) * XXH_P1;
    }
    acc ^= acc >> 33;
    acc *= XXH_P2;
    acc ^= acc >> 29;
    acc *= XXH_P3;
    acc ^= acc >> 32;
    return acc;
}

PyDoc_STRVAR(xxh64_doc,
             "xxh64(buffer, seed=0) -> int\n\n"
             "XXH64 of a C-contiguous buffer (without the GIL from 64 KiB).");

static PyObject *xxh64(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 1 || nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "xxh64(buffer, seed=0)");
        return NULL;
    }
    uint64_t seed = 0;
    if (nargs == 2 && get_u64(args[1], &seed) < 0)
        return NULL;
    Py_buffer data;
    if (PyObject_GetBuffer(args[0], &data, PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    xxh64_state state;
    xxh_init(&state, seed);
    uint64_t hash;
    if (data.len >= HASH_RELEASE_GIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        hash = xxh_finish(&state, (const char *)data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        hash = xxh_finish(&state, (const char *)data.buf, (size_t)data.len);
    }
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLongLong(hash);
}

PyDoc_STRVAR(pread_xxh64_doc,
             "pread_xxh64(fd, view, offset) -> (nread, hash)\n\n"
             "Read len(view) bytes of the file fd at offset into view (a writable buffer), in "
             "chunks of 256 KiB, each hashed as it arrives: hash is the XXH64 (seed 0) of the "
             "bytes read. nread < len(view): the file ended first (hash is then 0). Without "
             "the GIL; OSError if a read fails.");

static PyObject *pread_xxh64(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "pread_xxh64(fd, view, offset)");
        return NULL;
    }
    int fd = PyObject_AsFileDescriptor(args[0]);
    if (fd < 0)
        return NULL;
    Py_ssize_t offset;
    if (get_offset(args[2], &offset) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    char *buf = (char *)view.buf;
    size_t len = (size_t)view.len, done = 0;
    int err = 0, short_read = 0;
    uint64_t hash = 0;
    xxh64_state state;
    xxh_init(&state, 0);
    Py_BEGIN_ALLOW_THREADS
    while (done < len) {
        size_t want = len - done < HASH_CHUNK ? len - done : HASH_CHUNK, got = 0;
        while (got < want) {
            ssize_t n = pread(fd, buf + done + got, want - got, (off_t)(offset + done + got));
            if (n < 0 && errno == EINTR)
                continue;
            if (n < 0) {
                err = errno;
                break;
            }
            if (n == 0) {
                short_read = 1;
                break;
            }
            got += (size_t)n;
        }
        if (err || short_read) {
            done += got;
            break;
        }
        if (done + want < len)
            xxh_stripes(&state, buf + done, want);
        else
            hash = xxh_finish(&state, buf + done, want);
        done += want;
    }
    if (len == 0)
        hash = xxh_finish(&state, buf, 0);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&view);
    if (err) {
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return Py_BuildValue("(nK)", (Py_ssize_t)done, (unsigned long long)(short_read ? 0 : hash));
}

PyDoc_STRVAR(copy_in_doc,
             "copy_in(view, offset, source) -> bool\n\n"
             "Copy the bytes of source, a C-contiguous buffer (a numpy array), to "
             "view[offset:]; large copies use non-temporal stores. False, with nothing copied, "
             "if source exports no C-contiguous buffer.");

/* Copy nbytes from src into the pool's view at offset: the one place both copies check bounds.
 * 0, or -1 with an exception set. */
static int copy_into_view(PyObject *view_obj, Py_ssize_t offset, const char *src,
                          Py_ssize_t nbytes)
{
    Py_buffer view;
    if (PyObject_GetBuffer(view_obj, &view, PyBUF_WRITABLE) < 0)
        return -1;
    if (offset > view.len || nbytes > view.len - offset) {
        PyErr_Format(PyExc_ValueError, "copy of %zd bytes at %zd is outside the pool (%zd bytes)",
                     nbytes, offset, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    copy_bytes((char *)view.buf + offset, src, (size_t)nbytes, copy_threads);
    PyBuffer_Release(&view);
    return 0;
}

static PyObject *copy_in(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "copy_in(view, offset, source)");
        return NULL;
    }
    Py_ssize_t offset;
    if (get_offset(args[1], &offset) < 0)
        return NULL;
    Py_buffer source;
    if (PyObject_GetBuffer(args[2], &source, PyBUF_C_CONTIGUOUS) < 0) {
        PyErr_Clear();
        Py_RETURN_FALSE;
    }
    int failed = copy_into_view(args[0], offset, (const char *)source.buf, source.len);
    PyBuffer_Release(&source);
    if (failed)
        return NULL;
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(copy_from_doc,
             "copy_from(view, offset, source_address, nbytes)\n\n"
             "Copy nbytes from source_address (a contiguous CPU buffer the caller keeps alive, "
             "e.g. a tensor's data_ptr()) to view[offset:]; large copies use non-temporal stores.");

static PyObject *copy_from(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "copy_from(view, offset, source_address, nbytes)");
        return NULL;
    }
    Py_ssize_t offset, nbytes;
    uint64_t source;
    if (get_offset(args[1], &offset) < 0 || get_u64(args[2], &source) < 0 ||
        get_offset(args[3], &nbytes) < 0)
        return NULL;
    if (copy_into_view(args[0], offset, (const char *)(uintptr_t)source, nbytes) < 0)
        return NULL;
    Py_RETURN_NONE;
}

/* A buffer of n uint64 values (a numpy array): its items, or NULL with an exception set. The
 * caller releases *held once done. */
static const uint64_t *u64_items(PyObject *obj, Py_buffer *held, Py_ssize_t *n, const char *what)
{
    if (PyObject_GetBuffer(obj, held, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return NULL;
    const char *format = held->format ? held->format : "B";
    if (strchr("<=@", format[0]) != NULL && format[0] != '\0')
        format++;
    if (held->itemsize != 8 || (strcmp(format, "Q") != 0 && strcmp(format, "L") != 0)) {
        PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous uint64 array", what);
        PyBuffer_Release(held);
        return NULL;
    }
    *n = held->len / 8;
    return (const uint64_t *)held->buf;
}

/* The segment copies: between view[offsets[i]:offsets[i] + lengths[i]] and the caller's
 * addresses[i], for every i; `out` copies from the view. Every range in the view is checked
 * first, then one loop copies them all, without the GIL from RELEASE_GIL_MIN bytes in all. */
static PyObject *copy_segments(PyObject *const *args, Py_ssize_t nargs, int out)
{
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, out ? "copy_out_segments(view, offsets, addresses, lengths)"
                                             : "copy_in_segments(view, offsets, addresses, lengths)");
        return NULL;
    }
    Py_buffer view, offsets_buf, addresses_buf, lengths_buf;
    Py_ssize_t n_off = 0, n_addr = 0, n_len = 0;
    if (PyObject_GetBuffer(args[0], &view, out ? PyBUF_SIMPLE : PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *result = NULL;
    const uint64_t *offsets = u64_items(args[1], &offsets_buf, &n_off, "offsets");
    if (offsets == NULL)
        goto release_view;
    const uint64_t *addresses = u64_items(args[2], &addresses_buf, &n_addr, "addresses");
    if (addresses == NULL)
        goto release_offsets;
    const uint64_t *lengths = u64_items(args[3], &lengths_buf, &n_len, "lengths");
    if (lengths == NULL)
        goto release_addresses;
    if (n_off != n_addr || n_off != n_len) {
        PyErr_Format(PyExc_ValueError, "%zd offsets, %zd addresses, %zd lengths", n_off, n_addr,
                     n_len);
        goto release_all;
    }
    uint64_t total = 0, size = (uint64_t)view.len;
    for (Py_ssize_t i = 0; i < n_off; i++) {
        if (offsets[i] > size || lengths[i] > size - offsets[i]) {
            PyErr_Format(PyExc_ValueError,
                         "segment %zd (%llu bytes at %llu) is outside the buffer (%zd bytes)", i,
                         (unsigned long long)lengths[i], (unsigned long long)offsets[i], view.len);
            goto release_all;
        }
        total += lengths[i];
    }
    char *base = (char *)view.buf;
    if (total >= RELEASE_GIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        for (Py_ssize_t i = 0; i < n_off; i++) {
            char *at = base + offsets[i], *other = (char *)(uintptr_t)addresses[i];
            if (out)
                memcpy(other, at, lengths[i]);
            else
                memcpy(at, other, lengths[i]);
        }
        Py_END_ALLOW_THREADS
    } else {
        for (Py_ssize_t i = 0; i < n_off; i++) {
            char *at = base + offsets[i], *other = (char *)(uintptr_t)addresses[i];
            if (out)
                memcpy(other, at, lengths[i]);
            else
                memcpy(at, other, lengths[i]);
        }
    }
    result = Py_None;
    Py_INCREF(result);
release_all:
    PyBuffer_Release(&lengths_buf);
release_addresses:
    PyBuffer_Release(&addresses_buf);
release_offsets:
    PyBuffer_Release(&offsets_buf);
release_view:
    PyBuffer_Release(&view);
    return result;
}

PyDoc_STRVAR(copy_out_segments_doc,
             "copy_out_segments(view, offsets, addresses, lengths)\n\n"
             "For every i, copy lengths[i] bytes from view[offsets[i]:] to addresses[i] (memory "
             "of this process the caller keeps valid); the three are uint64 arrays of one length. "
             "Every range in the view is checked before anything is copied; from RELEASE_GIL_MIN "
             "bytes in all the copies run without the GIL.");

static PyObject *copy_out_segments(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return copy_segments(args, nargs, 1);
}

PyDoc_STRVAR(copy_in_segments_doc,
             "copy_in_segments(view, offsets, addresses, lengths)\n\n"
             "For every i, copy lengths[i] bytes from addresses[i] (memory of this process the "
             "caller keeps valid) to view[offsets[i]:], view writable; as copy_out_segments.");

static PyObject *copy_in_segments(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    return copy_segments(args, nargs, 0);
}

/* The template of a header (seal, put_sealed): bytes of at least the fixed header, to be written
 * 8-byte aligned, within header_len when one is given (>= 0). 0, or -1 with an exception set. */
static int check_template(PyObject *template, Py_ssize_t at, Py_ssize_t header_len)
{
    if (!PyBytes_Check(template) || PyBytes_GET_SIZE(template) < HEADER_FIXED) {
        PyErr_SetString(PyExc_TypeError, "template must be bytes of at least 64");
        return -1;
    }
    if (header_len >= 0 && PyBytes_GET_SIZE(template) > header_len) {
        PyErr_Format(PyExc_ValueError, "template of %zd bytes is longer than the header (%zd)",
                     PyBytes_GET_SIZE(template), header_len);
        return -1;
    }
    if ((at & 7) != 0) {
        PyErr_Format(PyExc_ValueError, "header at %zd is not 8-byte aligned", at);
        return -1;
    }
    return 0;
}

/* The template (magic, lengths, layout), then the object's fields, then SEALED last with release
 * ordering: a reader that sees SEALED (acquire) sees the whole header and the payload before it. */
static void write_header(char *header, PyObject *template, uint64_t oid, uint64_t key,
                         uint64_t nbytes, uint64_t deadline, uint64_t flags)
{
    memcpy(header, PyBytes_AS_STRING(template), (size_t)PyBytes_GET_SIZE(template));
    store_u32(header + 4, STATE_WRITING);
    store_u64(header + 8, oid);
    store_u64(header + 16, (oid * GOLDEN) ^ key);
    store_u64(header + 32, nbytes);
    store_u64(header + 40, 0);
    store_u64(header + 48, deadline);
    store_u32(header + 56, (uint32_t)flags);
    __atomic_store_n((uint32_t *)(header + 4), STATE_SEALED, __ATOMIC_RELEASE);
}

PyDoc_STRVAR(seal_doc,
             "seal(view, at, template, oid, key, nbytes, lease_deadline_ns, flags)\n\n"
             "Write the header template (magic, lengths, layout) at view[at:], fill in the "
             "object's fields (its tag mixes oid and the pool key), then store state SEALED last, "
             "with release ordering.");

static PyObject *seal(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 8) {
        PyErr_SetString(PyExc_TypeError,
                        "seal(view, at, template, oid, key, nbytes, lease_deadline_ns, flags)");
        return NULL;
    }
    Py_ssize_t at;
    uint64_t oid, key, nbytes, deadline, flags;
    if (get_offset(args[1], &at) < 0 || get_u64(args[3], &oid) < 0 ||
        get_u64(args[4], &key) < 0 || get_u64(args[5], &nbytes) < 0 ||
        get_u64(args[6], &deadline) < 0 || get_u64(args[7], &flags) < 0)
        return NULL;
    if (check_template(args[2], at, -1) < 0)
        return NULL;
    Py_ssize_t size = PyBytes_GET_SIZE(args[2]);
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    if (at > view.len || size > view.len - at) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "header at %zd is outside the pool", at);
        return NULL;
    }
    write_header((char *)view.buf + at, args[2], oid, key, nbytes, deadline, flags);
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(put_sealed_doc,
             "put_sealed(view, at, header_len, source, nbytes, template, oid, key, "
             "lease_deadline_ns, flags) -> bool | None\n\n"
             "A whole put into view[at:] in one call: the payload (nbytes from source, a "
             "C-contiguous buffer such as a numpy array, or the address of a contiguous CPU buffer "
             "the caller keeps alive, e.g. a tensor's data_ptr()) at at + header_len, then the "
             "header, as seal() writes it. False, with nothing written, if source exports no "
             "C-contiguous buffer; None, with nothing written, while the pool's control page "
             "sends every operation to the master (a fault plan).");

static PyObject *put_sealed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 10) {
        PyErr_SetString(PyExc_TypeError,
                        "put_sealed(view, at, header_len, source, nbytes, template, oid, key, "
                        "lease_deadline_ns, flags)");
        return NULL;
    }
    Py_ssize_t at, hlen, nbytes;
    uint64_t oid, key, deadline, flags;
    if (get_offset(args[1], &at) < 0 || get_offset(args[2], &hlen) < 0 ||
        get_offset(args[4], &nbytes) < 0 || get_u64(args[6], &oid) < 0 ||
        get_u64(args[7], &key) < 0 || get_u64(args[8], &deadline) < 0 ||
        get_u64(args[9], &flags) < 0)
        return NULL;
    if (check_template(args[5], at, hlen) < 0)
        return NULL;
    Py_buffer source = {0};
    const char *from;
    if (PyLong_Check(args[3])) {
        uint64_t address;
        if (get_u64(args[3], &address) < 0)
            return NULL;
        from = (const char *)(uintptr_t)address;
    }
    else {
        if (PyObject_GetBuffer(args[3], &source, PyBUF_C_CONTIGUOUS) < 0) {
            PyErr_Clear();
            Py_RETURN_FALSE;
        }
        if (source.len != nbytes) {
            PyErr_Format(PyExc_ValueError, "source has %zd bytes, not %zd", source.len, nbytes);
            PyBuffer_Release(&source);
            return NULL;
        }
        from = (const char *)source.buf;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0) {
        PyBuffer_Release(&source);
        return NULL;
    }
    /* The control page's flags (header.py): a fault plan sends every operation to the master. */
    if (view.len < CONTROL_BYTES || (load_u32((const char *)view.buf + 4) & FLAG_MASTER_PATH)) {
        PyBuffer_Release(&view);
        PyBuffer_Release(&source);
        Py_RETURN_NONE;
    }
    if (at > view.len || hlen > view.len - at || nbytes > view.len - at - hlen) {
        PyErr_Format(PyExc_ValueError, "object of %zd bytes at %zd is outside the pool (%zd bytes)",
                     hlen + nbytes, at, view.len);
        PyBuffer_Release(&view);
        PyBuffer_Release(&source);
        return NULL;
    }
    copy_bytes((char *)view.buf + at + hlen, from, (size_t)nbytes, copy_threads);
    PyBuffer_Release(&source);
    write_header((char *)view.buf + at, args[5], oid, key, (uint64_t)nbytes, deadline, flags);
    PyBuffer_Release(&view);
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(read_sealed_doc,
             "read_sealed(view, at, oid, key, now_ns) -> (header_len, nbytes, layout bytes) | None"
             "\n\nThe header of object oid at view[at:] if the pool's control page lets clients "
             "read headers, it is sealed, its tag matches the pool key, its lease has not passed "
             "at now_ns and the object lies inside the view; its last access is then set to "
             "now_ns (eviction's second chance).");

static PyObject *read_sealed(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "read_sealed(view, at, oid, key, now_ns)");
        return NULL;
    }
    Py_ssize_t at;
    uint64_t oid, key, now;
    if (get_offset(args[1], &at) < 0 || get_u64(args[2], &oid) < 0 ||
        get_u64(args[3], &key) < 0 || get_u64(args[4], &now) < 0)
        return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[0], &view, PyBUF_WRITABLE) < 0)
        return NULL;
    PyObject *result;
    if (at < CONTROL_BYTES || at > view.len - HEADER_FIXED || (at & 7) != 0)
        goto done;
    /* The control page's flags (header.py): a fault plan sends every operation to the master. */
    if (load_u32((const char *)view.buf + 4) & FLAG_MASTER_PATH)
        goto done;
    char *header = (char *)view.buf + at;
    /* State first, with acquire ordering: once SEALED, the rest of the header is complete. */
    if (__atomic_load_n((const uint32_t *)(header + 4), __ATOMIC_ACQUIRE) != STATE_SEALED)
        goto done;
    uint64_t deadline = load_u64(header + 48);
    uint64_t hlen = load_u32(header + 24), llen = load_u32(header + 28);
    uint64_t nbytes = load_u64(header + 32);
    if (memcmp(header, MAGIC, 4) != 0 || load_u64(header + 8) != oid ||
        load_u64(header + 16) != ((oid * GOLDEN) ^ key) || (deadline && now > deadline) ||
        hlen < HEADER_FIXED + llen || hlen > (uint64_t)(view.len - at) ||
        nbytes > (uint64_t)(view.len - at) - hlen)
        goto done;
    store_u64(header + 40, now);
    result = Py_BuildValue("(KKy#)", (unsigned long long)hlen, (unsigned long long)nbytes,
                           header + HEADER_FIXED, (Py_ssize_t)llen);
    PyBuffer_Release(&view);
    return result;
done:
    PyBuffer_Release(&view);
    Py_RETURN_NONE;
}

/* DLPack (dlpack.h, the unversioned ABI every framework reads): how a get hands torch a tensor
 * over pool memory without going through torch's view machinery. */
typedef struct {
    int32_t device_type;
    int32_t device_id;
} DLDevice;
typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} DLDataType;
typedef struct {
    void *data;
    DLDevice device;
    int32_t ndim;
    DLDataType dtype;
    int64_t *shape;
    int64_t *strides;
    uint64_t byte_offset;
} DLTensor;
typedef struct DLManagedTensor {
    DLTensor dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct DLManagedTensor *self);
} DLManagedTensor;

#define DL_CPU 1
#define MAX_DIMS 64

typedef struct {
    DLManagedTensor managed;
    int64_t shape[MAX_DIMS];
} Export;

/* Called by the consumer when its tensor dies, from any thread, with or without the GIL. */
static void export_deleter(DLManagedTensor *managed)
{
    if (!Py_IsInitialized())
        return; /* the interpreter is gone: nothing left to keep alive */
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF((PyObject *)managed->manager_ctx);
    PyMem_RawFree(managed);
    PyGILState_Release(gil);
}

static void capsule_destructor(PyObject *capsule)
{
    /* A consumer renames the capsule once it owns the tensor; otherwise it is ours to free. */
    if (!PyCapsule_IsValid(capsule, "dltensor"))
        return;
    DLManagedTensor *managed = (DLManagedTensor *)PyCapsule_GetPointer(capsule, "dltensor");
    if (managed != NULL)
        managed->deleter(managed);
}

PyDoc_STRVAR(tensor_capsule_doc,
             "tensor_capsule(keeper, offset, shape, code, bits) -> DLPack capsule\n\n"
             "A C-contiguous tensor of shape and DLPack dtype (code, bits) at keeper[offset:], "
             "for torch.utils.dlpack.from_dlpack. keeper (a memoryview over the pool) is held "
             "until the tensor dies, which keeps the pool mapped.");

static PyObject *tensor_capsule(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "tensor_capsule(keeper, offset, shape, code, bits)");
        return NULL;
    }
    Py_ssize_t offset;
    uint64_t code, bits;
    if (get_offset(args[1], &offset) < 0 || get_u64(args[3], &code) < 0 ||
        get_u64(args[4], &bits) < 0)
        return NULL;
    if (!PyTuple_Check(args[2]) || PyTuple_GET_SIZE(args[2]) > MAX_DIMS) {
        PyErr_SetString(PyExc_TypeError, "shape must be a tuple of at most 64 sizes");
        return NULL;
    }
    if (code > 255 || bits == 0 || bits > 255 || bits % 8 != 0) {
        PyErr_SetString(PyExc_ValueError, "bad DLPack dtype");
        return NULL;
    }
    Export *export = PyMem_RawMalloc(sizeof(Export));
    if (export == NULL)
        return PyErr_NoMemory();
    Py_ssize_t ndim = PyTuple_GET_SIZE(args[2]);
    uint64_t nbytes = bits / 8;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        Py_ssize_t size = PyLong_AsSsize_t(PyTuple_GET_ITEM(args[2], i));
        if (size < 0) {
            PyMem_RawFree(export);
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_ValueError, "negative size in shape");
            return NULL;
        }
        export->shape[i] = size;
        nbytes *= (uint64_t)size;
    }
    Py_buffer pool;
    if (PyObject_GetBuffer(args[0], &pool, PyBUF_WRITABLE) < 0) {
        PyMem_RawFree(export);
        return NULL;
    }
    if (offset > pool.len || nbytes > (uint64_t)(pool.len - offset)) {
        PyBuffer_Release(&pool);
        PyMem_RawFree(export);
        PyErr_Format(PyExc_ValueError, "tensor at %zd is outside the pool", offset);
        return NULL;
    }
    DLTensor *tensor = &export->managed.dl_tensor;
    tensor->data = (char *)pool.buf + offset;
    PyBuffer_Release(&pool); /* the keeper's own export holds the mapping */
    tensor->device.device_type = DL_CPU;
    tensor->device.device_id = 0;
    tensor->ndim = (int32_t)ndim;
    tensor->dtype.code = (uint8_t)code;
    tensor->dtype.bits = (uint8_t)bits;
    tensor->dtype.lanes = 1;
    tensor->shape = export->shape;
    tensor->strides = NULL; /* compact, row-major */
    tensor->byte_offset = 0;
    Py_INCREF(args[0]);
    export->managed.manager_ctx = args[0];
    export->managed.deleter = export_deleter;
    PyObject *capsule = PyCapsule_New(&export->managed, "dltensor", capsule_destructor);
    if (capsule == NULL)
        export_deleter(&export->managed);
    return capsule;
}

PyDoc_STRVAR(set_copy_threads_doc,
             "set_copy_threads(n) -> previous\n\n"
             "How many threads copy a payload of SPLIT_MIN bytes and more (each gets at least "
             "SPLIT_MIN); 1, the default, copies on the caller's thread alone.");

static PyObject *set_copy_threads(PyObject *module, PyObject *arg)
{
    long threads = PyLong_AsLong(arg);
    if (threads == -1 && PyErr_Occurred())
        return NULL;
    if (threads < 1 || threads > MAX_COPY_THREADS) {
        PyErr_Format(PyExc_ValueError, "copy threads must be in [1, %d], got %ld",
                     MAX_COPY_THREADS, threads);
        return NULL;
    }
    int previous = copy_threads;
    copy_threads = (int)threads;
    return PyLong_FromLong(previous);
}

static PyMethodDef methods[] = {
    {"set_copy_threads", (PyCFunction)set_copy_threads, METH_O, set_copy_threads_doc},
    {"tensor_capsule", (PyCFunction)(void (*)(void))tensor_capsule, METH_FASTCALL,
     tensor_capsule_doc},
    {"copy_in", (PyCFunction)(void (*)(void))copy_in, METH_FASTCALL, copy_in_doc},
    {"copy_from", (PyCFunction)(void (*)(void))copy_from, METH_FASTCALL, copy_from_doc},
    {"copy_out_segments", (PyCFunction)(void (*)(void))copy_out_segments, METH_FASTCALL,
     copy_out_segments_doc},
    {"copy_in_segments", (PyCFunction)(void (*)(void))copy_in_segments, METH_FASTCALL,
     copy_in_segments_doc},
    {"seal", (PyCFunction)(void (*)(void))seal, METH_FASTCALL, seal_doc},
    {"put_sealed", (PyCFunction)(void (*)(void))put_sealed, METH_FASTCALL, put_sealed_doc},
    {"read_sealed", (PyCFunction)(void (*)(void))read_sealed, METH_FASTCALL, read_sealed_doc},
    {"xxh64", (PyCFunction)(void (*)(void))xxh64, METH_FASTCALL, xxh64_doc},
    {"pread_xxh64", (PyCFunction)(void (*)(void))pread_xxh64, METH_FASTCALL, pread_xxh64_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "refstore._fastpath",
    "The byte work of a local put and get (header copy, header write and check).", -1, methods,
};

PyMODINIT_FUNC PyInit__fastpath(void)
{
#ifdef HAVE_STREAMING
    __builtin_cpu_init();
    have_avx2 = __builtin_cpu_supports("avx2") != 0;
#endif
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL)
        return NULL;
    if (PyModule_AddIntConstant(module, "STREAM_MIN", STREAM_MIN) < 0 ||
        PyModule_AddIntConstant(module, "RELEASE_GIL_MIN", RELEASE_GIL_MIN) < 0 ||
        PyModule_AddIntConstant(module, "SPLIT_MIN", SPLIT_MIN) < 0 ||
        PyModule_AddIntConstant(module, "streaming", have_avx2) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
