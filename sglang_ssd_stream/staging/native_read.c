/* The captured PLE sidecar read as a native CUDA host function: no Python, no GIL, no CUDA call.
 *
 * A host node of a replayed CUDA graph runs on a CUDA driver thread and must not call CUDA.
 * Written in Python (a ctypes callback) it broke both rules: it waited for the GIL behind any
 * thread running Python (1.0-4.1 ms per replay on the H200 at a 500 us switch interval), and a
 * garbage collection that ran inside it freed a CUDA tensor, whose destructor called CUDA: the
 * process aborted with "operation not permitted" (benchmarks/sidecar/ple_native_sleep_h200.log).
 * This function does the work in C: check the table, then copy the rows of `ids` into the pinned
 * slot, from this rank's read-only mappings (io=mmap) or with pread (io=pread). This rank's rows come
 * as segments, one per region of the table (a copied table: one; an in-place table: one per shard
 * tensor), each with its mapping or its file and byte, as the caller's manifest gives them.
 *
 * Contract (the same as the Python readers' read_rows): every id is checked before anything is
 * written; rows of other tensor-parallel ranks are zero; a row of this rank is never returned as
 * zeros. A failure cannot travel back through the driver, so it prints what failed and ends the
 * process with exit code 70 (EX_SOFTWARE): continuing would hand the model rows that were never
 * read. With io=pread every I/O error is such a message; with io=mmap a media error under the
 * mapping is a SIGBUS, as for the mapped Python reader.
 *
 * Copying: warm rows cost a memcpy (or a pread from the page cache) each, so rows are copied on
 * the driver thread in chunks; the first chunk slower than `slow_row_s` per row is waiting for the
 * disk, and the rest is split over `workers` threads so that many reads are in flight (the disk's
 * queue depth).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SSD_ABI 3
#define SSD_EXIT_CODE 70 /* EX_SOFTWARE */
#define SSD_PROBE_ROWS 64
#define SSD_MAX_WORKERS 256

enum { SSD_IO_MMAP = 0, SSD_IO_PREAD = 1 };

/* Mirrored field by field by staging/native_read.py (_Read); ssd_read_layout() guards the layout. */
typedef struct {
    const int64_t *seg_start;       /* nsegs + 1 row ids: segment s holds this rank's rows [seg_start[s], seg_start[s + 1]) */
    const uint8_t *const *seg_rows; /* io=mmap: the mapping of each segment's first row */
    const int64_t *seg_offset;      /* io=pread: the byte of each segment's first row in its file */
    const int32_t *seg_file;        /* each segment's file */
    const int32_t *file_fd;         /* every file of the table (ours: duplicates of the reader's) */
    const char *const *file_path;   /* each file's name, for the messages */
    const int64_t *file_bytes;      /* each file's least size: a shorter one is refused before copying */
    const int64_t *base_ino;        /* each file when its reader opened it: a write in place changes size or mtime */
    const int64_t *base_size;
    const int64_t *base_mtime_ns;
    int32_t nsegs;
    int32_t nfiles;
    int64_t vocab_start;
    int64_t vocab_end;
    int64_t total_rows;   /* every id must lie in [0, total_rows) */
    int64_t row_bytes;
    const int64_t *ids;   /* pinned: written by the captured D2H copy before this node runs */
    uint8_t *out;         /* pinned staging slot, n x row_bytes */
    int64_t n;
    int64_t inline_rows;  /* rows per inline chunk while warm; 0: always threads */
    double slow_row_s;
    int32_t workers;
    int32_t closed;       /* set by the owner before the mapping goes away */
    int32_t io;           /* SSD_IO_MMAP or SSD_IO_PREAD */
    int64_t calls;        /* statistics, written only here */
    int64_t threaded_rows;
    char what[128];       /* what the error message calls this read */
} ssd_read_t;

typedef struct {
    const ssd_read_t *r;
    int64_t a, b;
} ssd_span_t;

static void die(const ssd_read_t *r, const char *fmt, ...) {
    static int dying = 0;
    if (__atomic_exchange_n(&dying, 1, __ATOMIC_ACQ_REL))
        for (;;)
            pause(); /* another copy thread is already ending the process: one message, not interleaved ones */
    char msg[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fprintf(stderr,
            "sglang-ssd-stream: %s failed inside a CUDA stream/graph: %s\n"
            "stopping this process: the step's rows were not read.\n",
            r->what, msg);
    fflush(stderr);
    _exit(SSD_EXIT_CODE);
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* The segment holding row id of this rank (the last whose first row is <= id). */
static int32_t segment_of(const ssd_read_t *r, int64_t id) {
    int32_t lo = 0, hi = r->nsegs - 1;
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo + 1) / 2;
        if (r->seg_start[mid] <= id) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static void pread_row(const ssd_read_t *r, int32_t s, int64_t id, uint8_t *dst) {
    const int64_t rb = r->row_bytes;
    const int64_t off = r->seg_offset[s] + (id - r->seg_start[s]) * rb;
    const int fd = r->file_fd[r->seg_file[s]];
    int64_t got = 0;
    while (got < rb) {
        const ssize_t k = pread(fd, dst + got, (size_t)(rb - got), (off_t)(off + got));
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0)
            die(r, "SidecarIOError: reading row %lld (byte %lld) of the PLE table failed: %s", (long long)id,
                (long long)(off + got), strerror(errno));
        if (k == 0)
            die(r, "SidecarTruncated: short read of row %lld at byte %lld: the PLE table ends there "
                   "(was it rewritten while the server runs?)", (long long)id, (long long)(off + got));
        got += k;
    }
}

static void copy_span(const ssd_read_t *r, int64_t a, int64_t b) {
    const int64_t rb = r->row_bytes;
    for (int64_t i = a; i < b; i++) {
        const int64_t id = r->ids[i];
        uint8_t *dst = r->out + i * rb;
        if (id < r->vocab_start || id >= r->vocab_end) {
            memset(dst, 0, (size_t)rb); /* another rank's row */
            continue;
        }
        const int32_t s = r->nsegs == 1 ? 0 : segment_of(r, id);
        if (r->io == SSD_IO_PREAD)
            pread_row(r, s, id, dst);
        else
            memcpy(dst, r->seg_rows[s] + (id - r->seg_start[s]) * rb, (size_t)rb);
    }
}

static void *copy_span_thread(void *arg) {
    const ssd_span_t *s = (const ssd_span_t *)arg;
    copy_span(s->r, s->a, s->b);
    return NULL;
}

/* Split [a, n) over the workers; the calling thread copies the last span itself. */
static void copy_threaded(const ssd_read_t *r, int64_t a, int64_t n) {
    int64_t parts = r->workers < SSD_MAX_WORKERS ? r->workers : SSD_MAX_WORKERS;
    if (parts > n - a) parts = n - a;
    ssd_span_t spans[SSD_MAX_WORKERS];
    pthread_t threads[SSD_MAX_WORKERS];
    int started[SSD_MAX_WORKERS];
    const int64_t step = (n - a + parts - 1) / parts;
    int64_t k = 0;
    for (int64_t lo = a; lo < n; lo += step, k++) {
        spans[k].r = r;
        spans[k].a = lo;
        spans[k].b = lo + step < n ? lo + step : n;
        started[k] = 0;
    }
    for (int64_t i = 0; i + 1 < k; i++) /* a thread that cannot start leaves its span to the loop below */
        started[i] = pthread_create(&threads[i], NULL, copy_span_thread, &spans[i]) == 0;
    copy_span(r, spans[k - 1].a, spans[k - 1].b);
    for (int64_t i = 0; i + 1 < k; i++) {
        if (started[i])
            pthread_join(threads[i], NULL);
        else
            copy_span(r, spans[i].a, spans[i].b);
    }
}

/* The host function: cuLaunchHostFunc(stream, ssd_read_rows, &read). */
/* Every file of the table is still the file its reader opened (sidecar/reader.file_identity: inode, size,
   mtime). */
static void check_unchanged(const ssd_read_t *r) {
    for (int32_t f = 0; f < r->nfiles; f++) {
        struct stat st;
        if (fstat(r->file_fd[f], &st) != 0)
            die(r, "cannot stat the PLE table: %s: %s", strerror(errno), r->file_path[f]);
        if ((int64_t)st.st_size < r->file_bytes[f])
            die(r, "SidecarTruncated: the PLE table is truncated: it has %lld bytes, expected %lld "
                   "(was it rewritten while the server runs?): %s",
                (long long)st.st_size, (long long)r->file_bytes[f], r->file_path[f]);
        const int64_t mtime_ns = (int64_t)st.st_mtim.tv_sec * 1000000000LL + (int64_t)st.st_mtim.tv_nsec;
        if ((int64_t)st.st_ino != r->base_ino[f] || (int64_t)st.st_size != r->base_size[f] ||
            mtime_ns != r->base_mtime_ns[f])
            die(r, "SidecarChanged: the PLE table was written while it is served (its size or mtime changed since "
                   "it was opened): %s", r->file_path[f]);
    }
}

void ssd_read_rows(void *arg) {
    ssd_read_t *r = (ssd_read_t *)arg;
    if (__atomic_load_n(&r->closed, __ATOMIC_ACQUIRE))
        die(r, "the sidecar reader was closed while a graph that reads it can still replay");
    check_unchanged(r);
    const int64_t n = r->n;
    for (int64_t i = 0; i < n; i++) /* every id before any row is written */
        if (r->ids[i] < 0 || r->ids[i] >= r->total_rows)
            die(r, "SidecarRowOutOfRange: row id %lld at position %lld is outside the table [0, %lld)",
                (long long)r->ids[i], (long long)i, (long long)r->total_rows);
    int64_t a = 0;
    if (r->workers <= 1) {
        copy_span(r, 0, n);
        a = n;
    }
    while (a < n && r->inline_rows > 0) {
        const int64_t chunk = a == 0 && r->inline_rows > SSD_PROBE_ROWS ? SSD_PROBE_ROWS : r->inline_rows;
        const int64_t b = a + chunk < n ? a + chunk : n;
        const double t = now_s();
        copy_span(r, a, b);
        const int slow = now_s() - t > (double)(b - a) * r->slow_row_s;
        a = b;
        if (slow)
            break; /* faulting: the rest goes to the threads, so the faults overlap */
    }
    if (a < n) {
        copy_threaded(r, a, n);
        __atomic_fetch_add(&r->threaded_rows, n - a, __ATOMIC_RELAXED);
    }
    check_unchanged(r); /* rows copied across a write are never used: the process stops */
    __atomic_fetch_add(&r->calls, 1, __ATOMIC_RELAXED);
}

int ssd_abi(void) { return SSD_ABI; }

/* sizeof, then the offset of every field in declaration order; returns how many values it wrote. */
int ssd_read_layout(size_t *out, int cap) {
    const size_t v[] = {
        sizeof(ssd_read_t),
        offsetof(ssd_read_t, seg_start), offsetof(ssd_read_t, seg_rows), offsetof(ssd_read_t, seg_offset),
        offsetof(ssd_read_t, seg_file), offsetof(ssd_read_t, file_fd), offsetof(ssd_read_t, file_path),
        offsetof(ssd_read_t, file_bytes),
        offsetof(ssd_read_t, base_ino), offsetof(ssd_read_t, base_size), offsetof(ssd_read_t, base_mtime_ns),
        offsetof(ssd_read_t, nsegs), offsetof(ssd_read_t, nfiles), offsetof(ssd_read_t, vocab_start),
        offsetof(ssd_read_t, vocab_end), offsetof(ssd_read_t, total_rows), offsetof(ssd_read_t, row_bytes),
        offsetof(ssd_read_t, ids), offsetof(ssd_read_t, out), offsetof(ssd_read_t, n),
        offsetof(ssd_read_t, inline_rows), offsetof(ssd_read_t, slow_row_s), offsetof(ssd_read_t, workers),
        offsetof(ssd_read_t, closed), offsetof(ssd_read_t, io), offsetof(ssd_read_t, calls),
        offsetof(ssd_read_t, threaded_rows), offsetof(ssd_read_t, what),
    };
    const int n = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < cap; i++)
        out[i] = v[i];
    return n;
}

/* Tests: run fn(arg) on a new thread, as the CUDA driver runs a host node, and set *done after. */
typedef struct {
    void (*fn)(void *);
    void *arg;
    int32_t *done;
    pthread_t thread;
} ssd_test_thread_t;

static void *test_thread_main(void *p) {
    ssd_test_thread_t *t = (ssd_test_thread_t *)p;
    t->fn(t->arg);
    __atomic_store_n(t->done, 1, __ATOMIC_RELEASE);
    return NULL;
}

void *ssd_test_start(void (*fn)(void *), void *arg, int32_t *done) {
    ssd_test_thread_t *t = (ssd_test_thread_t *)calloc(1, sizeof *t);
    if (!t) return NULL;
    t->fn = fn;
    t->arg = arg;
    t->done = done;
    if (pthread_create(&t->thread, NULL, test_thread_main, t) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

int ssd_test_join(void *p) {
    ssd_test_thread_t *t = (ssd_test_thread_t *)p;
    const int rc = pthread_join(t->thread, NULL);
    free(t);
    return rc;
}
