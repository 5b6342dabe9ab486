/*
 * memprof._core: sampling allocator hooks, stack interning, snapshot writer.
 *
 * Hot paths (see README "Design"):
 *   unsampled alloc = one thread-local countdown decrement and a compare;
 *   unsampled free  = one load from a 1 MiB counting filter indexed by a hash of the pointer;
 *                     only when that byte is non-zero do we look in the sharded sample table.
 * Everything else (stack capture, interning, table updates) happens on the sampled path,
 * which runs about once per `mean` bytes allocated (512 KiB by default).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030D0000
#error "memprof._core supports CPython 3.11 and 3.12 (it walks _PyInterpreterFrame directly)"
#endif
/* The frame walk reads the interpreter's own frame list, like tracemalloc does: the public
 * API (PyThreadState_GetFrame) materialises frame objects, i.e. GC allocations that can start
 * a collection -- running finalizers inside an allocator hook is not acceptable. */
#define Py_BUILD_CORE 1
#include "internal/pycore_frame.h"
#undef Py_BUILD_CORE

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define LIKELY(x) __builtin_expect(!!(x), 1)
#define UNLIKELY(x) __builtin_expect(!!(x), 0)

#define MAX_FRAMES 64
#define SNAP_MAGIC "MEMPROF\0"
#define SNAP_TRAILER "MPROFEND"
#define SNAP_VERSION 2u
/* per-stack flags (snapshot v2) */
#define STACK_IN_IMPORT 1u /* allocated while a module was being imported (see capture_stack) */
#define STACK_TRUNCATED 2u /* deeper than MAX_FRAMES: the outermost frames are missing */
#define KIND_PYTHON 0u
#define KIND_NATIVE 1u
/* fake "return address" tag that carries one of our stack ids through jemalloc's profiler */
#define NATIVE_TAG 0x6d70000000000000ULL
#define NATIVE_TAG_MASK 0xffff000000000000ULL
/* pymalloc serves requests up to this size itself; bigger ones go to the raw domain (malloc) */
#define PYMALLOC_SMALL_MAX 512

/* ------------------------------------------------------------------ thread-local state */

typedef struct {
    int64_t countdown; /* bytes left until the next sample */
    uint64_t rng;
    uint32_t tid;
    uint8_t initialized;
    uint8_t busy;     /* inside a nested allocator call or our own code: no sampling here */
    uint8_t internal; /* inside our own code (may hold our locks): the jemalloc hook stays out */
} tls_state;

/* initial-exec: a plain %fs-relative access, no __tls_get_addr call on the hot path */
static __thread tls_state tls __attribute__((tls_model("initial-exec")));

/* ------------------------------------------------------------------ global config */

static double g_mean = 512.0 * 1024.0;
static uint64_t g_seed = 0x6d656d70726f66ULL;
static atomic_uint g_thread_counter;
static atomic_int g_sampling; /* 1 while started */
static int g_installed;       /* hooks installed */
static int g_native;          /* jemalloc carries native samples */

static uint32_t current_tid(void) {
    if (UNLIKELY(tls.tid == 0)) tls.tid = (uint32_t)syscall(SYS_gettid);
    return tls.tid;
}

static uint64_t splitmix64(uint64_t *x) {
    uint64_t z = (*x += 0x9E3779B97F4A7C15ULL);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

static int64_t draw_countdown_from(uint64_t *rng) {
    /* exponential with the configured mean: the bytes between samples of a Poisson process */
    uint64_t x = splitmix64(rng);
    double u = ((double)(x >> 11) + 1.0) * (1.0 / 9007199254740993.0); /* (0, 1] */
    double c = -log(u) * g_mean;
    if (c > 9.0e18) c = 9.0e18;
    return (int64_t)c;
}

static int64_t draw_countdown(void) { return draw_countdown_from(&tls.rng); }

/* The object and mem domains are only ever called with the GIL held (the C API requires it),
 * so their allocations are serialised and share one countdown in a plain global: the fast
 * path is then `sub size, g_gil.countdown(%rip)` instead of a GOT load plus an %fs-relative
 * access. Thread-local state is still used by the raw domain (called without the GIL) and
 * for the busy/internal flags. Sampling by bytes stays a Poisson process either way. */
static struct {
    int64_t countdown;
    uint64_t rng;
} g_gil;

static void tls_init(void) {
    uint64_t s = g_seed + 0x2545F4914F6CDD1DULL * (uint64_t)(atomic_fetch_add(&g_thread_counter, 1) + 1);
    tls.rng = splitmix64(&s);
    tls.initialized = 1;
    tls.countdown = draw_countdown();
}

/* ------------------------------------------------------------------ small growable buffer */

typedef struct {
    char *data;
    size_t len, cap;
} buf_t;

static int buf_reserve(buf_t *b, size_t extra) {
    if (b->len + extra <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra) cap *= 2;
    char *d = realloc(b->data, cap);
    if (!d) return -1;
    b->data = d;
    b->cap = cap;
    return 0;
}
static int buf_put(buf_t *b, const void *p, size_t n) {
    if (buf_reserve(b, n)) return -1;
    memcpy(b->data + b->len, p, n);
    b->len += n;
    return 0;
}
static int buf_u32(buf_t *b, uint32_t v) { return buf_put(b, &v, 4); }
static int buf_u64(buf_t *b, uint64_t v) { return buf_put(b, &v, 8); }
static int buf_f64(buf_t *b, double v) { return buf_put(b, &v, 8); }

/* ------------------------------------------------------------------ intern tables
 * strings, frames (code object, line) and stacks (thread id + frame ids). Guarded by
 * g_intern_lock. Ids are dense so a snapshot aggregates samples into plain arrays. */

typedef struct {
    uint64_t *hashes;
    uint32_t *slots; /* index + 1; 0 = empty */
    size_t cap, n;
} imap_t;

typedef int (*imap_eq)(uint32_t idx, const void *key);

static pthread_mutex_t g_intern_lock = PTHREAD_MUTEX_INITIALIZER;

static int64_t imap_find(imap_t *m, uint64_t h, imap_eq eq, const void *key) {
    if (!m->cap) return -1;
    size_t mask = m->cap - 1;
    for (size_t i = h & mask;; i = (i + 1) & mask) {
        uint32_t s = m->slots[i];
        if (!s) return -1;
        if (m->hashes[i] == h && eq(s - 1, key)) return s - 1;
    }
}

static int imap_insert(imap_t *m, uint64_t h, uint32_t idx) {
    if ((m->n + 1) * 2 > m->cap) {
        size_t ncap = m->cap ? m->cap * 2 : 1024;
        uint64_t *nh = calloc(ncap, sizeof(uint64_t));
        uint32_t *ns = calloc(ncap, sizeof(uint32_t));
        if (!nh || !ns) {
            free(nh);
            free(ns);
            return -1;
        }
        for (size_t i = 0; i < m->cap; i++) {
            if (!m->slots[i]) continue;
            size_t j = m->hashes[i] & (ncap - 1);
            while (ns[j]) j = (j + 1) & (ncap - 1);
            ns[j] = m->slots[i];
            nh[j] = m->hashes[i];
        }
        free(m->hashes);
        free(m->slots);
        m->hashes = nh;
        m->slots = ns;
        m->cap = ncap;
    }
    size_t mask = m->cap - 1;
    size_t i = h & mask;
    while (m->slots[i]) i = (i + 1) & mask;
    m->slots[i] = idx + 1;
    m->hashes[i] = h;
    m->n++;
    return 0;
}

static uint64_t hash_bytes(const void *p, size_t n, uint64_t h) {
    const unsigned char *c = p;
    h ^= 0xcbf29ce484222325ULL;
    for (size_t i = 0; i < n; i++) h = (h ^ c[i]) * 0x100000001b3ULL;
    return h ^ (h >> 29);
}

/* strings */
typedef struct {
    char *s;
    uint32_t len;
} str_t;
static str_t *g_strs;
static uint32_t g_nstrs, g_capstrs;
static imap_t g_str_map;
typedef struct {
    const char *s;
    size_t len;
} str_key;
static int str_eq(uint32_t idx, const void *k) {
    const str_key *key = k;
    return g_strs[idx].len == key->len && memcmp(g_strs[idx].s, key->s, key->len) == 0;
}
static int64_t intern_str(const char *s, size_t len) {
    str_key key = {s, len};
    uint64_t h = hash_bytes(s, len, 1);
    int64_t found = imap_find(&g_str_map, h, str_eq, &key);
    if (found >= 0) return found;
    if (g_nstrs == g_capstrs) {
        uint32_t nc = g_capstrs ? g_capstrs * 2 : 256;
        str_t *n = realloc(g_strs, nc * sizeof(str_t));
        if (!n) return -1;
        g_strs = n;
        g_capstrs = nc;
    }
    char *copy = malloc(len + 1);
    if (!copy) return -1;
    memcpy(copy, s, len);
    copy[len] = 0;
    g_strs[g_nstrs].s = copy;
    g_strs[g_nstrs].len = (uint32_t)len;
    if (imap_insert(&g_str_map, h, g_nstrs)) {
        free(copy);
        return -1;
    }
    return g_nstrs++;
}
/* UTF-8 of a str without the GIL where possible: compact ASCII (the usual case for file and
 * function names) and already-cached UTF-8 are read in place; anything else needs the GIL. */
static int64_t intern_pystr(PyObject *o, int have_gil) {
    Py_ssize_t n = 0;
    const char *s = NULL;
    if (o && PyUnicode_Check(o) && PyUnicode_IS_READY(o)) {
        if (PyUnicode_IS_COMPACT_ASCII(o)) {
            s = (const char *)PyUnicode_DATA(o);
            n = PyUnicode_GET_LENGTH(o);
        } else if (PyUnicode_IS_COMPACT(o) && ((PyCompactUnicodeObject *)o)->utf8) {
            s = ((PyCompactUnicodeObject *)o)->utf8;
            n = ((PyCompactUnicodeObject *)o)->utf8_length;
        } else if (have_gil) {
            s = PyUnicode_AsUTF8AndSize(o, &n);
            if (!s) PyErr_Clear();
        }
    }
    if (!s) {
        s = "?";
        n = 1;
    }
    return intern_str(s, (size_t)n);
}

/* frames: (code object, line), validated by the code's filename and qualname objects. No
 * reference is taken (that would need the GIL, and native-mode samples often come from
 * threads that released it): should a code object die and another take its address, the
 * key only matches if that one also has the same filename and qualname objects -- i.e. it
 * is the same function recompiled, and the attribution is still right. */
typedef struct {
    const void *code, *file_obj, *name_obj;
    int32_t line;
    uint32_t file, name;
} frame_t;
static frame_t *g_frames;
static uint32_t g_nframes, g_capframes;
static imap_t g_frame_map;
typedef struct {
    const void *code, *file_obj, *name_obj;
    int32_t line;
} frame_key;
static int frame_eq(uint32_t idx, const void *k) {
    const frame_key *key = k;
    const frame_t *f = &g_frames[idx];
    return f->code == key->code && f->line == key->line && f->file_obj == key->file_obj &&
           f->name_obj == key->name_obj;
}
static int64_t intern_frame(PyCodeObject *co, int line, int have_gil) {
    frame_key key = {co, co ? co->co_filename : NULL, co ? co->co_qualname : NULL, line};
    uint64_t h = ((uint64_t)(uintptr_t)co * 0x9E3779B97F4A7C15ULL) ^ ((uint64_t)(uint32_t)line * 0xC2B2AE3D27D4EB4FULL) ^
                 ((uint64_t)(uintptr_t)key.file_obj >> 4) ^ ((uint64_t)(uintptr_t)key.name_obj << 7);
    h ^= h >> 31;
    int64_t found = imap_find(&g_frame_map, h, frame_eq, &key);
    if (found >= 0) return found;
    if (g_nframes == g_capframes) {
        uint32_t nc = g_capframes ? g_capframes * 2 : 256;
        frame_t *n = realloc(g_frames, nc * sizeof(frame_t));
        if (!n) return -1;
        g_frames = n;
        g_capframes = nc;
    }
    int64_t file = -1, name = -1;
    if (co) {
        file = intern_pystr(co->co_filename, have_gil);
        name = intern_pystr(co->co_qualname, have_gil);
    } else {
        file = intern_str("<native>", 8);
        name = intern_str("<no Python stack>", 17);
    }
    if (file < 0 || name < 0) return -1;
    frame_t *f = &g_frames[g_nframes];
    f->code = key.code;
    f->file_obj = key.file_obj;
    f->name_obj = key.name_obj;
    f->line = line;
    f->file = (uint32_t)file;
    f->name = (uint32_t)name;
    if (imap_insert(&g_frame_map, h, g_nframes)) return -1;
    return g_nframes++;
}

/* sites: (code object, instruction offset) -> frame id, a cache in front of intern_frame.
 * The line number costs a scan of the code's line table (PyCode_Addr2Line: ~3K instructions,
 * most of what a sample cost); this way it is computed once per allocating instruction, not
 * once per sample. The key also holds what the line depends on (the line table object and
 * co_firstlineno) and the validating filename/qualname objects: a recycled code-object
 * address only hits if it maps this offset to the same line of the same function. */
typedef struct {
    const void *code, *linetable, *file_obj, *name_obj;
    int32_t firstlineno, lasti;
} site_key;
typedef struct {
    site_key key;
    uint32_t frame;
} site_t;
static site_t *g_sites;
static uint32_t g_nsites, g_capsites;
static imap_t g_site_map;
static int site_eq(uint32_t idx, const void *k) { return memcmp(&g_sites[idx].key, k, sizeof(site_key)) == 0; }
static int64_t intern_frame_at(PyCodeObject *co, int lasti, int have_gil) {
    site_key key;
    memset(&key, 0, sizeof(key)); /* compared with memcmp: no stray padding bytes */
    key.code = co;
    key.linetable = co->co_linetable;
    key.file_obj = co->co_filename;
    key.name_obj = co->co_qualname;
    key.firstlineno = co->co_firstlineno;
    key.lasti = lasti;
    uint64_t h = hash_bytes(&key, sizeof(key), 7);
    int64_t found = imap_find(&g_site_map, h, site_eq, &key);
    if (found >= 0) return g_sites[found].frame;
    int line = PyCode_Addr2Line(co, lasti * (int)sizeof(_Py_CODEUNIT));
    int64_t fid = intern_frame(co, line < 0 ? 0 : line, have_gil);
    if (fid < 0) return -1;
    if (g_nsites == g_capsites) {
        uint32_t nc = g_capsites ? g_capsites * 2 : 256;
        site_t *n = realloc(g_sites, nc * sizeof(site_t));
        if (!n) return fid; /* no cache entry: correct, just slower next time */
        g_sites = n;
        g_capsites = nc;
    }
    g_sites[g_nsites] = (site_t){key, (uint32_t)fid};
    if (imap_insert(&g_site_map, h, g_nsites) == 0) g_nsites++;
    return fid;
}

/* stacks: thread id + frame ids, innermost first */
typedef struct {
    uint32_t tid, n, off, flags;
} stack_t_;
static stack_t_ *g_stacks;
static uint32_t g_nstacks, g_capstacks;
static uint32_t *g_pool;
static size_t g_npool, g_cappool;
static imap_t g_stack_map;
typedef struct {
    uint32_t tid, n, flags;
    const uint32_t *ids;
} stack_key;
static int stack_eq(uint32_t idx, const void *k) {
    const stack_key *key = k;
    const stack_t_ *s = &g_stacks[idx];
    return s->tid == key->tid && s->n == key->n && s->flags == key->flags &&
           memcmp(g_pool + s->off, key->ids, key->n * sizeof(uint32_t)) == 0;
}
static int64_t intern_stack(uint32_t tid, const uint32_t *ids, uint32_t n, uint32_t flags) {
    stack_key key = {tid, n, flags, ids};
    uint64_t h = hash_bytes(ids, n * sizeof(uint32_t), tid ^ ((uint64_t)flags << 32));
    int64_t found = imap_find(&g_stack_map, h, stack_eq, &key);
    if (found >= 0) return found;
    if (g_nstacks == g_capstacks) {
        uint32_t nc = g_capstacks ? g_capstacks * 2 : 256;
        stack_t_ *ns = realloc(g_stacks, nc * sizeof(stack_t_));
        if (!ns) return -1;
        g_stacks = ns;
        g_capstacks = nc;
    }
    if (g_npool + n > g_cappool) {
        size_t nc = g_cappool ? g_cappool * 2 : 4096;
        while (nc < g_npool + n) nc *= 2;
        uint32_t *np = realloc(g_pool, nc * sizeof(uint32_t));
        if (!np) return -1;
        g_pool = np;
        g_cappool = nc;
    }
    memcpy(g_pool + g_npool, ids, n * sizeof(uint32_t));
    g_stacks[g_nstacks] = (stack_t_){tid, n, (uint32_t)g_npool, flags};
    if (imap_insert(&g_stack_map, h, g_nstacks)) return -1;
    g_npool += n;
    return g_nstacks++;
}

/* Capture the calling thread's Python stack and return its interned id (or -1).
 * Requires tls.busy == tls.internal == 1 (nested allocations pass straight through).
 * The frames walked are this thread's own, so they cannot change under us even when the
 * thread has released the GIL (it is inside a C call, e.g. ctypes or a numpy kernel): we
 * read them either way; the GIL only decides whether we may call into the C API for a
 * non-ASCII name. A thread without a Python thread state gets "<no Python stack>". */
/* The code object of importlib._bootstrap._find_and_load (a strong reference taken by
 * start()): every import statement, __import__ and importlib.import_module that has to load a
 * module runs its body below this frame, so an allocation with it on the stack was made while
 * importing. Compared by pointer during the (sampled-only) frame walk, which therefore goes on
 * past MAX_FRAMES: a deep stack under an import still gets its flag. */
static PyObject *g_find_and_load_code;

static int64_t capture_stack(void) {
    PyCodeObject *codes[MAX_FRAMES];
    int lastis[MAX_FRAMES];
    uint32_t ids[MAX_FRAMES];
    int n = 0;
    int have_gil = 0;
    uint32_t flags = 0;
    if (Py_IsInitialized() && !_Py_IsFinalizing()) {
        have_gil = PyGILState_Check();
        PyThreadState *ts = PyGILState_GetThisThreadState();
        _PyInterpreterFrame *f = ts && ts->cframe ? ts->cframe->current_frame : NULL;
        const void *import_code = g_find_and_load_code;
        for (; f; f = f->previous) {
            PyCodeObject *co = f->f_code;
            if (!co || _PyFrame_IsIncomplete(f)) continue;
            if ((const void *)co == import_code) flags |= STACK_IN_IMPORT;
            if (n == MAX_FRAMES) {
                flags |= STACK_TRUNCATED;
                if (!import_code || (flags & STACK_IN_IMPORT)) break;
                continue;
            }
            codes[n] = co;
            lastis[n] = _PyInterpreterFrame_LASTI(f); /* the line comes from intern_frame_at */
            n++;
        }
    }
    uint32_t tid = current_tid();
    PyObject *et = NULL, *ev = NULL, *tb = NULL;
    if (have_gil) PyErr_Fetch(&et, &ev, &tb);
    pthread_mutex_lock(&g_intern_lock);
    int64_t result = -1;
    if (n == 0) {
        int64_t fid = intern_frame(NULL, 0, have_gil);
        if (fid >= 0) {
            ids[0] = (uint32_t)fid;
            result = intern_stack(tid, ids, 1, flags);
        }
    } else {
        int ok = 1;
        for (int i = 0; i < n; i++) {
            int64_t fid = intern_frame_at(codes[i], lastis[i], have_gil);
            if (fid < 0) {
                ok = 0;
                break;
            }
            ids[i] = (uint32_t)fid;
        }
        if (ok) result = intern_stack(tid, ids, (uint32_t)n, flags);
    }
    pthread_mutex_unlock(&g_intern_lock);
    if (have_gil) PyErr_Restore(et, ev, tb);
    return result;
}

/* ------------------------------------------------------------------ sampled-pointer set
 * Counting filter: one byte per 64-byte granule of address space, direct-mapped (it wraps
 * every 64 MiB), counting the live samples whose pointer falls in it (saturating at 255: such
 * a byte stays set). A free reads one byte; non-zero (rare) sends it to the sharded
 * open-addressing table, each shard with its own mutex. No hashing on purpose: frees that
 * are close in memory read the same filter cache line (one line covers 4 KiB of heap, a
 * pymalloc pool), so the filter stays in cache; a hashed index missed cache on most frees. */

#define FILTER_BITS 20
#define GRANULE_SHIFT 6
static _Atomic uint8_t g_filter[1u << FILTER_BITS];

static inline size_t filter_index(const void *p) {
    return (size_t)(((uintptr_t)p >> GRANULE_SHIFT) & ((1u << FILTER_BITS) - 1));
}

typedef struct {
    uintptr_t ptr; /* 0 empty, 1 tombstone */
    uint64_t size;
    uint32_t stack;
    uint32_t _pad;
    double weight; /* 1 / P(sampled) for this size */
} sample_t;

#define NSHARDS 64
#define TOMB ((uintptr_t)1)
typedef struct {
    pthread_mutex_t lock;
    sample_t *slots;
    size_t cap, live, tombs;
    char _pad[64];
} shard_t;
static shard_t g_shards[NSHARDS];
static atomic_size_t g_live_samples;

static inline uint64_t ptr_hash(uintptr_t p) {
    uint64_t h = (uint64_t)(p >> 4) * 0xD6E8FEB86659FD93ULL;
    return h ^ (h >> 32);
}
static inline shard_t *shard_for(uint64_t h) { return &g_shards[(h >> 58) & (NSHARDS - 1)]; }

static int shard_grow(shard_t *s) {
    size_t ncap = s->live * 4 > s->cap ? (s->cap ? s->cap * 2 : 64) : (s->cap ? s->cap : 64);
    sample_t *ns = calloc(ncap, sizeof(sample_t));
    if (!ns) return -1;
    for (size_t i = 0; i < s->cap; i++) {
        uintptr_t p = s->slots[i].ptr;
        if (p <= TOMB) continue;
        size_t j = ptr_hash(p) & (ncap - 1);
        while (ns[j].ptr) j = (j + 1) & (ncap - 1);
        ns[j] = s->slots[i];
    }
    free(s->slots);
    s->slots = ns;
    s->cap = ncap;
    s->tombs = 0;
    return 0;
}

static void table_insert(void *p, uint64_t size, uint32_t stack, double weight) {
    uintptr_t key = (uintptr_t)p;
    uint64_t h = ptr_hash(key);
    shard_t *s = shard_for(h);
    pthread_mutex_lock(&s->lock);
    if ((s->live + s->tombs + 1) * 2 > s->cap && shard_grow(s)) {
        pthread_mutex_unlock(&s->lock);
        return; /* out of memory: drop the sample */
    }
    size_t mask = s->cap - 1;
    size_t i = h & mask, tomb = SIZE_MAX;
    for (;; i = (i + 1) & mask) {
        uintptr_t k = s->slots[i].ptr;
        if (k == 0) break;
        if (k == TOMB) {
            if (tomb == SIZE_MAX) tomb = i;
        } else if (k == key) {
            /* stale entry (freed behind our back, e.g. across stop/start): replace */
            s->slots[i] = (sample_t){key, size, stack, 0, weight};
            pthread_mutex_unlock(&s->lock);
            return;
        }
    }
    if (tomb != SIZE_MAX) {
        i = tomb;
        s->tombs--;
    }
    s->slots[i] = (sample_t){key, size, stack, 0, weight};
    s->live++;
    size_t fi = filter_index(p);
    uint8_t old = atomic_load_explicit(&g_filter[fi], memory_order_relaxed);
    while (old != 255 && !atomic_compare_exchange_weak_explicit(&g_filter[fi], &old, old + 1,
                                                               memory_order_release, memory_order_relaxed)) {
    }
    atomic_fetch_add_explicit(&g_live_samples, 1, memory_order_relaxed);
    pthread_mutex_unlock(&s->lock);
}

/* slow part of free/realloc: the filter said "maybe" */
static void __attribute__((noinline)) table_remove(void *p) {
    uintptr_t key = (uintptr_t)p;
    uint64_t h = ptr_hash(key);
    shard_t *s = shard_for(h);
    pthread_mutex_lock(&s->lock);
    if (s->cap) {
        size_t mask = s->cap - 1;
        for (size_t i = h & mask;; i = (i + 1) & mask) {
            uintptr_t k = s->slots[i].ptr;
            if (k == 0) break;
            if (k == key) {
                s->slots[i].ptr = TOMB;
                s->live--;
                s->tombs++;
                size_t fi = filter_index(p);
                uint8_t old = atomic_load_explicit(&g_filter[fi], memory_order_relaxed);
                while (old != 255 && old != 0 &&
                       !atomic_compare_exchange_weak_explicit(&g_filter[fi], &old, old - 1, memory_order_relaxed,
                                                              memory_order_relaxed)) {
                }
                atomic_fetch_sub_explicit(&g_live_samples, 1, memory_order_relaxed);
                break;
            }
        }
    }
    pthread_mutex_unlock(&s->lock);
}

static inline void forget_if_sampled(void *p) {
    if (UNLIKELY(atomic_load_explicit(&g_filter[filter_index(p)], memory_order_relaxed) != 0)) table_remove(p);
}

static void table_clear(void) {
    for (int i = 0; i < NSHARDS; i++) {
        shard_t *s = &g_shards[i];
        pthread_mutex_lock(&s->lock);
        free(s->slots);
        s->slots = NULL;
        s->cap = s->live = s->tombs = 0;
        pthread_mutex_unlock(&s->lock);
    }
    memset((void *)g_filter, 0, sizeof(g_filter));
    atomic_store(&g_live_samples, 0);
}

/* ------------------------------------------------------------------ the sampled path */

static void record_sample(void *p, size_t size);

/* a raw-domain countdown went negative (thread-local: the raw domain runs without the GIL) */
static void __attribute__((noinline)) sample_slow(void *p, size_t size) {
    if (!tls.initialized) {
        /* first allocation seen on this thread: draw its countdown, then decide fairly */
        tls_init();
        tls.countdown -= (int64_t)size;
        if (tls.countdown >= 0) return;
    }
    tls.countdown = draw_countdown();
    record_sample(p, size);
}

/* the shared countdown of the object/mem domains went negative (GIL held) */
static void __attribute__((noinline)) sample_slow_gil(void *p, size_t size) {
    g_gil.countdown = draw_countdown_from(&g_gil.rng);
    record_sample(p, size);
}

static void record_sample(void *p, size_t size) {
    if (!atomic_load_explicit(&g_sampling, memory_order_relaxed) || tls.internal) return;
    uint8_t was_busy = tls.busy;
    tls.busy = tls.internal = 1;
    int64_t stack = capture_stack();
    if (stack >= 0) {
        double prob = -expm1(-(double)size / g_mean);
        double weight = prob > 0 ? 1.0 / prob : 1.0;
        table_insert(p, size, (uint32_t)stack, weight);
    }
    tls.busy = was_busy;
    tls.internal = 0;
}

static inline void account(void *p, size_t size) {
    if (UNLIKELY((tls.countdown -= (int64_t)size) < 0) && p) sample_slow(p, size);
}
static inline void account_gil(void *p, size_t size) {
    if (UNLIKELY((g_gil.countdown -= (int64_t)size) < 0) && p) sample_slow_gil(p, size);
}
/* the countdown, slow path and accounting of a domain: shared under the GIL, else per thread */
#define COUNTDOWN(NESTS) (*((NESTS) ? &g_gil.countdown : &tls.countdown))
#define SAMPLE_SLOW(NESTS) ((NESTS) ? sample_slow_gil : sample_slow)
#define ACCOUNT(NESTS) ((NESTS) ? account_gil : account)

/* ------------------------------------------------------------------ allocator hooks
 * One set of functions per domain, each reading its own static `prev`: a thread that races
 * PyMem_SetAllocator (raw domain, no GIL) may see the new function with the old ctx, so
 * the hooks never look at ctx. Object/mem hooks mark the thread busy around the previous
 * allocator: pymalloc forwards big requests to the raw domain, which must not count them
 * a second time. */

enum { D_RAW, D_MEM, D_OBJ, D_COUNT };
static PyMemAllocatorEx g_prev[D_COUNT];
static PyMemAllocatorEx g_ours[D_COUNT];
static size_t g_small_limit[D_COUNT]; /* native mode: count only what pymalloc serves itself */
static int g_parked[D_COUNT];          /* stop() could not unhook: still in the chain, g_prev valid */
/* Plain pymalloc below us: object/mem frees are not hooked at all. A sampled small block is
 * then taken from the raw domain instead of pymalloc; pymalloc's free sees a pointer outside
 * its arenas and hands it to PyMem_RawFree -- our raw hook -- so every free of a sampled block
 * still reaches us, and the far more common free of an unsampled small block costs nothing. */
static int g_free_unhooked;

/* The common case -- a request pymalloc serves itself (<= 512 B) or any raw request, and no
 * sample due -- is a countdown decrement and a tail call into the previous allocator; the
 * rest lives in out-of-line functions so that the fast path needs no stack frame. The small
 * path needs no "busy" check: pymalloc does not re-enter the hooks for such sizes, and our own
 * allocations (tls.internal) are refused by sample_slow. */
#define DEFINE_ALLOC(NAME, D, NESTS, SUFFIX, PARAMS, ARGS, RAW_ARGS, SIZE_EXPR)                        \
    static __attribute__((noinline)) void *NAME##_##SUFFIX##_sampled PARAMS {                         \
        size_t size = SIZE_EXPR;                                                                      \
        void *p = (NESTS && g_free_unhooked) ? g_prev[D_RAW].SUFFIX RAW_ARGS : g_prev[D].SUFFIX ARGS;  \
        if (p) SAMPLE_SLOW(NESTS)(p, size);                                                           \
        return p;                                                                                     \
    }                                                                                                 \
    static __attribute__((noinline)) void *NAME##_##SUFFIX##_other PARAMS {                           \
        size_t size = SIZE_EXPR;                                                                      \
        if (tls.busy || size > g_small_limit[D]) return g_prev[D].SUFFIX ARGS;                        \
        if (!NESTS) {                                                                                 \
            if ((COUNTDOWN(NESTS) -= (int64_t)size) >= 0) return g_prev[D].SUFFIX ARGS;               \
            return NAME##_##SUFFIX##_sampled ARGS;                                                    \
        }                                                                                             \
        tls.busy = 1; /* pymalloc forwards this one to the raw domain: count it once, here */        \
        void *p = g_prev[D].SUFFIX ARGS;                                                              \
        tls.busy = 0;                                                                                 \
        ACCOUNT(NESTS)(p, size);                                                                      \
        return p;                                                                                     \
    }                                                                                                 \
    static void *NAME##_##SUFFIX PARAMS {                                                             \
        size_t size = SIZE_EXPR;                                                                      \
        if (NESTS && LIKELY(size <= PYMALLOC_SMALL_MAX)) {                                            \
            if (LIKELY((COUNTDOWN(NESTS) -= (int64_t)size) >= 0)) return g_prev[D].SUFFIX ARGS;       \
            return NAME##_##SUFFIX##_sampled ARGS;                                                    \
        }                                                                                             \
        return NAME##_##SUFFIX##_other ARGS;                                                          \
    }

#define DEFINE_HOOKS(NAME, D, NESTS)                                                                   \
    DEFINE_ALLOC(NAME, D, NESTS, malloc, (void *ctx, size_t n), (g_prev[D].ctx, n), (g_prev[D_RAW].ctx, n), n) \
    DEFINE_ALLOC(NAME, D, NESTS, calloc, (void *ctx, size_t nelem, size_t elsize),                    \
                 (g_prev[D].ctx, nelem, elsize), (g_prev[D_RAW].ctx, nelem, elsize), nelem * elsize)  \
    static void *NAME##_realloc(void *ctx, void *old, size_t size) {                                  \
        (void)ctx;                                                                                    \
        if (tls.busy) return g_prev[D].realloc(g_prev[D].ctx, old, size);                             \
        /* forget the old block before it can be freed and its address handed out again */          \
        if (old) forget_if_sampled(old);                                                              \
        if (NESTS) tls.busy = 1;                                                                      \
        void *p = g_prev[D].realloc(g_prev[D].ctx, old, size);                                        \
        if (NESTS) tls.busy = 0;                                                                      \
        if (size <= g_small_limit[D]) ACCOUNT(NESTS)(p, size);                                        \
        return p;                                                                                     \
    }                                                                                                 \
    static void NAME##_free(void *ctx, void *p) {                                                     \
        (void)ctx;                                                                                    \
        if (p) forget_if_sampled(p);                                                                  \
        g_prev[D].free(g_prev[D].ctx, p);                                                             \
    }

DEFINE_HOOKS(raw, D_RAW, 0)
DEFINE_HOOKS(mem, D_MEM, 1)
DEFINE_HOOKS(obj, D_OBJ, 1)

static const PyMemAllocatorDomain k_domains[D_COUNT] = {PYMEM_DOMAIN_RAW, PYMEM_DOMAIN_MEM, PYMEM_DOMAIN_OBJ};

/* ------------------------------------------------------------------ jemalloc (native mode) */

typedef int (*mallctl_fn)(const char *, void *, size_t *, void *, size_t);
typedef void (*prof_backtrace_hook_t)(void **, unsigned *, unsigned);
static mallctl_fn g_mallctl;
static prof_backtrace_hook_t g_prev_bt_hook;
static uint64_t g_native_mean;
static char g_dump_path[4096]; /* prefix of jemalloc dump files (a counter is appended) */

static void native_bt_hook(void **vec, unsigned *len, unsigned max_len) {
    /* Called by jemalloc for each allocation it samples (with its reentrancy guard up, so
     * allocating here is fine). Our own code (internal) gets a fixed, lock-free id. */
    if (max_len == 0) {
        *len = 0;
        return;
    }
    uint64_t id = 0xffffffffULL;
    if (!tls.internal && atomic_load_explicit(&g_sampling, memory_order_relaxed)) {
        uint8_t was_busy = tls.busy;
        tls.busy = tls.internal = 1;
        int64_t s = capture_stack();
        tls.busy = was_busy;
        tls.internal = 0;
        if (s >= 0) id = (uint64_t)s;
    }
    vec[0] = (void *)(uintptr_t)(NATIVE_TAG | id);
    *len = 1;
}

static const char *native_probe(void) {
    if (!g_mallctl) g_mallctl = (mallctl_fn)dlsym(RTLD_DEFAULT, "mallctl");
    if (!g_mallctl) return "jemalloc is not loaded in this process (run under `memprof run --native`, "
                           "which sets LD_PRELOAD=libjemalloc.so.2)";
    bool prof = false;
    size_t sz = sizeof(prof);
    if (g_mallctl("opt.prof", &prof, &sz, NULL, 0) != 0 || !prof)
        return "jemalloc is loaded but was not built with or started with profiling (MALLOC_CONF=prof:true)";
    return NULL;
}

static int native_install(void) {
    prof_backtrace_hook_t hook = native_bt_hook, old = NULL;
    size_t sz = sizeof(old);
    if (g_mallctl("experimental.hooks.prof_backtrace", &old, &sz, &hook, sizeof(hook)) != 0) return -1;
    if (old != native_bt_hook) g_prev_bt_hook = old;
    size_t lg = 0;
    sz = sizeof(lg);
    if (g_mallctl("prof.lg_sample", &lg, &sz, NULL, 0) == 0) g_native_mean = 1ULL << lg;
    bool active = true;
    g_mallctl("prof.active", NULL, NULL, &active, sizeof(active));
    return 0;
}

static void native_uninstall(void) {
    if (!g_mallctl || !g_prev_bt_hook) return;
    prof_backtrace_hook_t old = g_prev_bt_hook;
    g_mallctl("experimental.hooks.prof_backtrace", NULL, NULL, &old, sizeof(old));
}

/* Ask jemalloc to dump its live sampled allocations and
 * add them to per-stack arrays. jemalloc does the free accounting: 5.3 has no free hook. */
static int native_collect(const char *dump_path, double *objs, double *bytes, uint32_t nstacks, double *other) {
    const char *path = dump_path;
    if (g_mallctl("prof.dump", NULL, NULL, (void *)&path, sizeof(path)) != 0) return -1;
    FILE *f = fopen(dump_path, "r");
    if (!f) return -1;
    char line[4096];
    int64_t cur = -2; /* -2: before first backtrace */
    while (fgets(line, sizeof(line), f)) {
        if (line[0] == '@') {
            unsigned long long addr = strtoull(line + 1, NULL, 16);
            if ((addr & NATIVE_TAG_MASK) == NATIVE_TAG && (addr & 0xffffffffULL) < nstacks)
                cur = (int64_t)(addr & 0xffffffffULL);
            else
                cur = -1; /* captured before our hook, or by our own code */
        } else if (cur != -2 && strncmp(line, "  t*: ", 6) == 0) {
            char *e = NULL;
            double o = (double)strtoull(line + 6, &e, 10);
            double b = (e && *e == ':') ? (double)strtoull(e + 1, NULL, 10) : 0;
            /* this jemalloc build reports raw sampled counts (no opt.prof_unbias): scale them
             * back the way pprof does for heap_v2, using the mean object size of this stack */
            if (o > 0 && g_native_mean > 0) {
                double p = -expm1(-(b / o) / (double)g_native_mean);
                if (p > 0) {
                    o /= p;
                    b /= p;
                }
            }
            if (cur >= 0) {
                objs[cur] += o;
                bytes[cur] += b;
            } else {
                other[0] += o;
                other[1] += b;
            }
            cur = -2;
        } else if (strncmp(line, "MAPPED_LIBRARIES", 16) == 0) {
            break;
        }
    }
    fclose(f);
    if (getenv("MEMPROF_KEEP_JEMALLOC_DUMP")) { /* debugging aid: keep the last raw dump */
        char kept[4400];
        snprintf(kept, sizeof(kept), "%s.last", g_dump_path);
        rename(dump_path, kept);
    } else {
        unlink(dump_path);
    }
    return 0;
}

/* ------------------------------------------------------------------ snapshot encoding
 * Format v2, little endian (documented in README and parsed by memprof/snapfile.py):
 *   "MEMPROF\0" u32 version u32 flags u64 pid f64 unix_time f64 py_mean u64 native_mean
 *   u32 n_strings  { u32 len, bytes }
 *   u32 n_frames   { u32 file, u32 name, i32 line }
 *   u32 n_stacks   { u32 tid, u32 flags, u32 n, n * u32 frame }   (innermost frame first)
 *   u32 n_records  { u32 stack, u32 kind, u64 samples, u64 sampled_bytes, f64 est_objects, f64 est_bytes }
 *   "MPROFEND" u64 total_length_including_trailer
 */

static int encode_snapshot(buf_t *b) {
    int rc = -1;
    /* jemalloc's dump runs outside our intern lock (it takes a few ms); stacks only grow, so
     * ids it reports are all below the count read here */
    double *nobj = NULL, *nbytes = NULL;
    double nother[2] = {0, 0};
    int have_native = 0;
    uint32_t ns0 = 0;
    if (g_native && g_mallctl && g_dump_path[0]) {
        pthread_mutex_lock(&g_intern_lock);
        ns0 = g_nstacks;
        pthread_mutex_unlock(&g_intern_lock);
        /* one dump file per call: the writer and snapshot() may dump at the same time */
        static atomic_uint dump_seq;
        char path[4300];
        snprintf(path, sizeof(path), "%s.%u", g_dump_path, atomic_fetch_add(&dump_seq, 1));
        nobj = calloc(ns0 ? ns0 : 1, sizeof(double));
        nbytes = calloc(ns0 ? ns0 : 1, sizeof(double));
        if (nobj && nbytes && native_collect(path, nobj, nbytes, ns0, nother) == 0) have_native = 1;
    }
    pthread_mutex_lock(&g_intern_lock);
    uint32_t ns = g_nstacks;
    size_t arr = (size_t)(ns ? ns : 1);
    uint64_t *cnt = calloc(arr, sizeof(uint64_t));
    uint64_t *sbytes = calloc(arr, sizeof(uint64_t));
    double *eobj = calloc(arr, sizeof(double));
    double *ebytes = calloc(arr, sizeof(double));
    if (!cnt || !sbytes || !eobj || !ebytes) goto out;
    for (int i = 0; i < NSHARDS; i++) {
        shard_t *s = &g_shards[i];
        pthread_mutex_lock(&s->lock);
        for (size_t j = 0; j < s->cap; j++) {
            sample_t *r = &s->slots[j];
            if (r->ptr <= TOMB || r->stack >= ns) continue;
            cnt[r->stack]++;
            sbytes[r->stack] += r->size;
            eobj[r->stack] += r->weight;
            ebytes[r->stack] += r->weight * (double)r->size;
        }
        pthread_mutex_unlock(&s->lock);
    }
    struct timespec now;
    clock_gettime(CLOCK_REALTIME, &now);
    if (buf_put(b, SNAP_MAGIC, 8) || buf_u32(b, SNAP_VERSION) || buf_u32(b, have_native ? 1u : 0u) ||
        buf_u64(b, (uint64_t)getpid()) || buf_f64(b, (double)now.tv_sec + now.tv_nsec * 1e-9) || buf_f64(b, g_mean) ||
        buf_u64(b, have_native ? g_native_mean : 0))
        goto out;
    if (buf_u32(b, g_nstrs)) goto out;
    for (uint32_t i = 0; i < g_nstrs; i++)
        if (buf_u32(b, g_strs[i].len) || buf_put(b, g_strs[i].s, g_strs[i].len)) goto out;
    if (buf_u32(b, g_nframes)) goto out;
    for (uint32_t i = 0; i < g_nframes; i++)
        if (buf_u32(b, g_frames[i].file) || buf_u32(b, g_frames[i].name) || buf_u32(b, (uint32_t)g_frames[i].line))
            goto out;
    if (buf_u32(b, ns)) goto out;
    for (uint32_t i = 0; i < ns; i++)
        if (buf_u32(b, g_stacks[i].tid) || buf_u32(b, g_stacks[i].flags) || buf_u32(b, g_stacks[i].n) ||
            buf_put(b, g_pool + g_stacks[i].off, g_stacks[i].n * sizeof(uint32_t)))
            goto out;
    uint32_t nrec = 0;
    for (uint32_t i = 0; i < ns; i++) {
        nrec += cnt[i] ? 1 : 0;
        if (have_native && i < ns0) nrec += (nobj[i] > 0 || nbytes[i] > 0) ? 1 : 0;
    }
    if (buf_u32(b, nrec)) goto out;
    for (uint32_t i = 0; i < ns; i++) {
        if (cnt[i] && (buf_u32(b, i) || buf_u32(b, KIND_PYTHON) || buf_u64(b, cnt[i]) || buf_u64(b, sbytes[i]) ||
                       buf_f64(b, eobj[i]) || buf_f64(b, ebytes[i])))
            goto out;
        if (have_native && i < ns0 && (nobj[i] > 0 || nbytes[i] > 0) &&
            (buf_u32(b, i) || buf_u32(b, KIND_NATIVE) || buf_u64(b, 0) || buf_u64(b, 0) || buf_f64(b, nobj[i]) ||
             buf_f64(b, nbytes[i])))
            goto out;
    }
    if (buf_put(b, SNAP_TRAILER, 8) || buf_u64(b, (uint64_t)b->len + 8)) goto out;
    rc = 0;
out:
    pthread_mutex_unlock(&g_intern_lock);
    free(cnt);
    free(sbytes);
    free(eobj);
    free(ebytes);
    free(nobj);
    free(nbytes);
    return rc;
}

static int write_all(int fd, const char *p, size_t n) {
    while (n) {
        ssize_t w = write(fd, p, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            return -1;
        }
        p += w;
        n -= (size_t)w;
    }
    return 0;
}

/* write(tmp) + fsync + rename: a reader (or a post-mortem after kill -9) only ever sees
 * complete snapshots under the final name. */
static int write_snapshot_file(const char *final_path) {
    uint8_t was_busy = tls.busy, was_internal = tls.internal;
    tls.busy = tls.internal = 1;
    buf_t b = {0};
    int rc = -1;
    char tmp[4200];
    snprintf(tmp, sizeof(tmp), "%s.tmp", final_path);
    if (encode_snapshot(&b) == 0) {
        int fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            int ok = write_all(fd, b.data, b.len) == 0 && fsync(fd) == 0;
            ok = close(fd) == 0 && ok;
            if (ok && rename(tmp, final_path) == 0)
                rc = 0;
            else
                unlink(tmp);
        }
    }
    free(b.data);
    tls.busy = was_busy;
    tls.internal = was_internal;
    return rc;
}

/* ------------------------------------------------------------------ background writer */

static pthread_mutex_t g_writer_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_written_cond = PTHREAD_COND_INITIALIZER;
static pthread_t g_writer;
static int g_writer_running;
static int g_wake[2] = {-1, -1};
static atomic_int g_writer_stop;
static char g_out_dir[4000];
static double g_interval = 60.0;
static int g_keep = 5;
static uint64_t g_seq;
static uint64_t g_written;
static uint64_t g_write_errors;
static int g_last_errno;
static double g_last_write_s;
static char g_last_path[4096];
static int g_signum;
static struct sigaction g_old_sigaction;
static int g_sig_installed;

static void on_signal(int sig) {
    (void)sig;
    int saved = errno;
    if (g_wake[1] >= 0) {
        ssize_t r = write(g_wake[1], "s", 1);
        (void)r;
    }
    errno = saved;
}

static double mono_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + t.tv_nsec * 1e-9;
}

static void writer_write_one(void) {
    char path[4096];
    pid_t pid = getpid();
    uint64_t seq = ++g_seq;
    snprintf(path, sizeof(path), "%s/memprof-%d-%06llu.mprof", g_out_dir, (int)pid, (unsigned long long)seq);
    double t0 = mono_s();
    if (write_snapshot_file(path) == 0) {
        g_last_write_s = mono_s() - t0;
        if (g_keep > 0 && seq > (uint64_t)g_keep) {
            char old[4096];
            snprintf(old, sizeof(old), "%s/memprof-%d-%06llu.mprof", g_out_dir, (int)pid,
                     (unsigned long long)(seq - (uint64_t)g_keep));
            unlink(old);
        }
        pthread_mutex_lock(&g_writer_lock);
        g_written++;
        memcpy(g_last_path, path, sizeof(path));
        pthread_cond_broadcast(&g_written_cond);
        pthread_mutex_unlock(&g_writer_lock);
    } else {
        /* disk full, directory removed...: counted and reported by writer_info(); the next
         * interval tries again */
        int err = errno ? errno : EIO;
        pthread_mutex_lock(&g_writer_lock);
        g_write_errors++;
        g_last_errno = err;
        pthread_cond_broadcast(&g_written_cond);
        pthread_mutex_unlock(&g_writer_lock);
    }
}

static void *writer_main(void *arg) {
    (void)arg;
    tls.busy = tls.internal = 1; /* the writer's own allocations are never sampled */
    pthread_setname_np(pthread_self(), "memprof-writer");
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the application's threads */
    int timeout_ms = g_interval > 0 ? (int)(g_interval * 1000.0) : -1;
    double next = mono_s() + g_interval;
    for (;;) {
        struct pollfd pfd = {g_wake[0], POLLIN, 0};
        int wait_ms = timeout_ms;
        if (timeout_ms >= 0) {
            double left = next - mono_s();
            wait_ms = left > 0 ? (int)(left * 1000.0) + 1 : 0;
        }
        int r = poll(&pfd, 1, wait_ms);
        if (r < 0 && errno == EINTR) continue;
        if (r > 0) {
            char drain[64];
            while (read(g_wake[0], drain, sizeof(drain)) > 0) {
            }
        }
        int stopping = atomic_load(&g_writer_stop);
        writer_write_one();
        if (timeout_ms >= 0) next = mono_s() + g_interval;
        if (stopping) break;
    }
    return NULL;
}

static void close_wake(void) {
    for (int i = 0; i < 2; i++)
        if (g_wake[i] >= 0) {
            close(g_wake[i]);
            g_wake[i] = -1;
        }
}

/* ------------------------------------------------------------------ fork safety */

static int g_atfork_registered;

static void atfork_prepare(void) {
    pthread_mutex_lock(&g_intern_lock);
    for (int i = 0; i < NSHARDS; i++) pthread_mutex_lock(&g_shards[i].lock);
    pthread_mutex_lock(&g_writer_lock);
}
static void atfork_parent(void) {
    pthread_mutex_unlock(&g_writer_lock);
    for (int i = NSHARDS - 1; i >= 0; i--) pthread_mutex_unlock(&g_shards[i].lock);
    pthread_mutex_unlock(&g_intern_lock);
}
static void atfork_child(void) {
    /* only the forking thread survives: fresh locks, no writer thread, a new wake pipe */
    pthread_mutex_init(&g_writer_lock, NULL);
    pthread_cond_init(&g_written_cond, NULL);
    for (int i = 0; i < NSHARDS; i++) pthread_mutex_init(&g_shards[i].lock, NULL);
    pthread_mutex_init(&g_intern_lock, NULL);
    tls.tid = 0;
    if (g_writer_running) {
        g_writer_running = 0;
        close_wake();
        g_seq = 0;
        g_written = 0;
        g_last_path[0] = 0;
    }
    if (g_native && g_out_dir[0])
        snprintf(g_dump_path, sizeof(g_dump_path), "%s/.jemalloc-%d.heap", g_out_dir, (int)getpid());
}

/* ------------------------------------------------------------------ Python API */

static PyObject *py_start(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"mean", "seed", "native", "native_dump_dir", NULL};
    double mean = 512.0 * 1024.0;
    unsigned long long seed = 0;
    int native = 0;
    const char *dump_dir = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|dKpz", kwlist, &mean, &seed, &native, &dump_dir)) return NULL;
    if (!(mean >= 1.0)) {
        PyErr_SetString(PyExc_ValueError, "mean must be >= 1 byte");
        return NULL;
    }
    if (g_installed) {
        PyErr_SetString(PyExc_RuntimeError, "memprof is already started");
        return NULL;
    }
    if (native) {
        const char *why = native_probe();
        if (why) {
            PyErr_SetString(PyExc_RuntimeError, why);
            return NULL;
        }
    }
    if (!g_atfork_registered) {
        pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
        g_atfork_registered = 1;
    }
    g_mean = mean;
    g_seed = seed ? (uint64_t)seed : ((uint64_t)time(NULL) * 0x9E3779B97F4A7C15ULL) ^ (uint64_t)getpid();
    atomic_store(&g_thread_counter, 0);
    /* existing threads re-draw their countdown with the new mean on their next allocation */
    tls.initialized = 0;
    tls.countdown = 0;
    {
        uint64_t s = g_seed ^ 0x676c6f62616cULL;
        g_gil.rng = splitmix64(&s);
        g_gil.countdown = draw_countdown_from(&g_gil.rng);
    }
    g_native = native;
    for (int d = 0; d < D_COUNT; d++) g_small_limit[d] = SIZE_MAX;
    if (native) {
        /* jemalloc sees everything that reaches malloc; we sample what pymalloc keeps */
        g_small_limit[D_RAW] = 0;
        g_small_limit[D_MEM] = PYMALLOC_SMALL_MAX;
        g_small_limit[D_OBJ] = PYMALLOC_SMALL_MAX;
        if (dump_dir)
            snprintf(g_dump_path, sizeof(g_dump_path), "%s/.jemalloc-%d.heap", dump_dir, (int)getpid());
        else
            snprintf(g_dump_path, sizeof(g_dump_path), "/tmp/.memprof-jemalloc-%d.heap", (int)getpid());
        if (native_install() != 0) {
            PyErr_SetString(PyExc_RuntimeError, "jemalloc refused experimental.hooks.prof_backtrace");
            return NULL;
        }
    }
    if (!g_find_and_load_code) {
        /* importlib's bootstrap is frozen into the interpreter: always importable */
        PyObject *mod = PyImport_ImportModule("_frozen_importlib");
        PyObject *fn = mod ? PyObject_GetAttrString(mod, "_find_and_load") : NULL;
        PyObject *code = fn ? PyObject_GetAttrString(fn, "__code__") : NULL;
        Py_XDECREF(fn);
        Py_XDECREF(mod);
        if (code && PyCode_Check(code))
            g_find_and_load_code = code; /* kept for the life of the process */
        else
            Py_XDECREF(code);
        PyErr_Clear(); /* without it, import-time allocations are just not flagged */
    }
    g_ours[D_RAW] = (PyMemAllocatorEx){NULL, raw_malloc, raw_calloc, raw_realloc, raw_free};
    g_ours[D_MEM] = (PyMemAllocatorEx){NULL, mem_malloc, mem_calloc, mem_realloc, mem_free};
    g_ours[D_OBJ] = (PyMemAllocatorEx){NULL, obj_malloc, obj_calloc, obj_realloc, obj_free};
    int any_parked = g_parked[D_RAW] || g_parked[D_MEM] || g_parked[D_OBJ];
    if (!any_parked) {
        const char *name = _PyMem_GetCurrentAllocatorName();
        g_free_unhooked = name && strcmp(name, "pymalloc") == 0 && !getenv("MEMPROF_HOOK_ALL_FREES");
    }
    for (int d = 0; d < D_COUNT; d++)
        if (!g_parked[d]) PyMem_GetAllocator(k_domains[d], &g_prev[d]);
    if (g_free_unhooked) {
        for (int d = D_MEM; d <= D_OBJ; d++) {
            g_ours[d].ctx = g_prev[d].ctx; /* our hooks ignore ctx; pymalloc's free gets its own */
            g_ours[d].free = g_prev[d].free;
        }
    }
    /* g_prev and g_small_limit must be visible before any thread can enter a hook */
    atomic_thread_fence(memory_order_seq_cst);
    atomic_store(&g_sampling, 1);
    for (int d = 0; d < D_COUNT; d++)
        if (!g_parked[d]) PyMem_SetAllocator(k_domains[d], &g_ours[d]);
    g_installed = 1;
    Py_RETURN_NONE;
}

static PyObject *py_stop(PyObject *self, PyObject *unused) {
    if (!g_installed) Py_RETURN_NONE;
    atomic_store(&g_sampling, 0);
    for (int d = 0; d < D_COUNT; d++) {
        PyMemAllocatorEx cur;
        PyMem_GetAllocator(k_domains[d], &cur);
        /* someone hooked on top of us (e.g. tracemalloc): leave the chain intact, we just stop
         * sampling (our hooks stay as pass-throughs, and start() reuses them) */
        if (cur.malloc == g_ours[d].malloc) {
            PyMem_SetAllocator(k_domains[d], &g_prev[d]);
            g_parked[d] = 0;
        } else {
            g_parked[d] = 1;
        }
    }
    if (g_native) native_uninstall();
    g_native = 0;
    g_installed = 0;
    table_clear();
    Py_RETURN_NONE;
}

static PyObject *py_snapshot_bytes(PyObject *self, PyObject *unused) {
    buf_t b = {0};
    uint8_t was_busy = tls.busy, was_internal = tls.internal;
    tls.busy = tls.internal = 1;
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = encode_snapshot(&b);
    Py_END_ALLOW_THREADS tls.busy = was_busy;
    tls.internal = was_internal;
    if (rc) {
        free(b.data);
        return PyErr_NoMemory();
    }
    PyObject *r = PyBytes_FromStringAndSize(b.data, (Py_ssize_t)b.len);
    free(b.data);
    return r;
}

static PyObject *py_write_snapshot(PyObject *self, PyObject *arg) {
    PyObject *bytes = NULL;
    if (!PyUnicode_FSConverter(arg, &bytes)) return NULL;
    const char *path = PyBytes_AS_STRING(bytes);
    int rc;
    double t0 = mono_s();
    Py_BEGIN_ALLOW_THREADS rc = write_snapshot_file(path);
    Py_END_ALLOW_THREADS double dt = mono_s() - t0;
    if (rc) {
        PyErr_SetFromErrnoWithFilenameObject(PyExc_OSError, arg);
        Py_DECREF(bytes);
        return NULL;
    }
    Py_DECREF(bytes);
    return PyFloat_FromDouble(dt);
}

static PyObject *py_writer_start(PyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"out_dir", "interval", "keep", "signum", NULL};
    const char *dir;
    double interval;
    int keep, signum;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sdii", kwlist, &dir, &interval, &keep, &signum)) return NULL;
    if (g_writer_running) {
        PyErr_SetString(PyExc_RuntimeError, "snapshot writer already running");
        return NULL;
    }
    if (strlen(dir) >= sizeof(g_out_dir) - 64) {
        PyErr_SetString(PyExc_ValueError, "out_dir too long");
        return NULL;
    }
    snprintf(g_out_dir, sizeof(g_out_dir), "%s", dir);
    g_interval = interval;
    g_keep = keep;
    g_seq = 0;
    atomic_store(&g_writer_stop, 0);
    if (pipe2(g_wake, O_CLOEXEC | O_NONBLOCK) != 0) return PyErr_SetFromErrno(PyExc_OSError);
    int err = pthread_create(&g_writer, NULL, writer_main, NULL);
    if (err) {
        close_wake();
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    g_writer_running = 1;
    pthread_setname_np(g_writer, "memprof-writer"); /* visible in /proc, top -H, py-spy */
    if (signum > 0) {
        struct sigaction sa;
        memset(&sa, 0, sizeof(sa));
        sa.sa_handler = on_signal;
        sa.sa_flags = SA_RESTART;
        sigemptyset(&sa.sa_mask);
        if (sigaction(signum, &sa, &g_old_sigaction) == 0) {
            g_sig_installed = 1;
            g_signum = signum;
        }
    }
    Py_RETURN_NONE;
}

static PyObject *py_writer_request(PyObject *self, PyObject *unused) {
    if (g_writer_running && g_wake[1] >= 0) {
        ssize_t r = write(g_wake[1], "r", 1);
        (void)r;
    }
    Py_RETURN_NONE;
}

/* wait_written(n, timeout): block (GIL released) until the writer has written n snapshots */
static PyObject *py_wait_written(PyObject *self, PyObject *args) {
    unsigned long long target, errors_seen = ULLONG_MAX;
    double timeout;
    if (!PyArg_ParseTuple(args, "Kd|K", &target, &timeout, &errors_seen)) return NULL;
    int ok;
    Py_BEGIN_ALLOW_THREADS struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    double end = (double)dl.tv_sec + dl.tv_nsec * 1e-9 + (timeout > 0 ? timeout : 0);
    dl.tv_sec = (time_t)end;
    dl.tv_nsec = (long)((end - (double)dl.tv_sec) * 1e9);
    pthread_mutex_lock(&g_writer_lock);
    /* stop early when a write failed after the caller looked (errors_seen) */
    while (g_written < target && g_writer_running && (errors_seen == ULLONG_MAX || g_write_errors <= errors_seen)) {
        if (pthread_cond_timedwait(&g_written_cond, &g_writer_lock, &dl) == ETIMEDOUT) break;
    }
    ok = g_written >= target;
    pthread_mutex_unlock(&g_writer_lock);
    Py_END_ALLOW_THREADS return PyBool_FromLong(ok);
}

static PyObject *py_writer_stop(PyObject *self, PyObject *unused) {
    if (g_sig_installed) {
        sigaction(g_signum, &g_old_sigaction, NULL);
        g_sig_installed = 0;
    }
    if (!g_writer_running) Py_RETURN_NONE;
    atomic_store(&g_writer_stop, 1);
    ssize_t r = write(g_wake[1], "x", 1);
    (void)r;
    Py_BEGIN_ALLOW_THREADS pthread_join(g_writer, NULL);
    Py_END_ALLOW_THREADS g_writer_running = 0;
    close_wake();
    Py_RETURN_NONE;
}

static PyObject *py_writer_info(PyObject *self, PyObject *unused) {
    pthread_mutex_lock(&g_writer_lock);
    PyObject *r = Py_BuildValue("{s:i,s:K,s:s,s:d,s:K,s:s}", "running", g_writer_running, "written",
                                (unsigned long long)g_written, "last_path", g_last_path, "last_write_s",
                                g_last_write_s, "errors", (unsigned long long)g_write_errors, "last_error",
                                g_last_errno ? strerror(g_last_errno) : "");
    pthread_mutex_unlock(&g_writer_lock);
    return r;
}

static PyObject *py_stats(PyObject *self, PyObject *unused) {
    return Py_BuildValue("{s:i,s:i,s:d,s:K,s:I,s:I,s:i}", "active", g_installed, "native", g_native, "mean", g_mean,
                         "live_samples", (unsigned long long)atomic_load(&g_live_samples), "stacks", g_nstacks,
                         "frames", g_nframes, "small_frees_hooked", !g_free_unhooked);
}

static PyObject *py_native_available(PyObject *self, PyObject *unused) {
    const char *why = native_probe();
    if (why) return PyUnicode_FromString(why);
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"start", (PyCFunction)(void (*)(void))py_start, METH_VARARGS | METH_KEYWORDS,
     "start(mean=524288.0, seed=0, native=False, native_dump_dir=None): install the allocator hooks"},
    {"stop", py_stop, METH_NOARGS, "restore the previous allocators and drop all live samples"},
    {"snapshot_bytes", py_snapshot_bytes, METH_NOARGS, "encode the current live samples (format v2)"},
    {"write_snapshot", py_write_snapshot, METH_O, "write a snapshot to path (tmp+fsync+rename); returns seconds"},
    {"writer_start", (PyCFunction)(void (*)(void))py_writer_start, METH_VARARGS | METH_KEYWORDS,
     "start the background snapshot writer thread"},
    {"writer_request", py_writer_request, METH_NOARGS, "ask the writer for a snapshot now"},
    {"writer_stop", py_writer_stop, METH_NOARGS, "write a final snapshot and join the writer thread"},
    {"writer_info", py_writer_info, METH_NOARGS, "writer state"},
    {"wait_written", py_wait_written, METH_VARARGS, "wait_written(n, timeout, errors_seen=None) -> True once n snapshots are written"},
    {"stats", py_stats, METH_NOARGS, "profiler counters"},
    {"native_available", py_native_available, METH_NOARGS, "None if native mode can start, else the reason"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef core_module = {PyModuleDef_HEAD_INIT, "_core", "memprof C core", -1, core_methods};

PyMODINIT_FUNC PyInit__core(void) {
    for (int i = 0; i < NSHARDS; i++) pthread_mutex_init(&g_shards[i].lock, NULL);
    return PyModule_Create(&core_module);
}
