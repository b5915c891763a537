/* A bounded cache of PLE sidecar rows: lookups, admission/eviction and the miss path's reads in C.
 *
 * Rows live in a buffer the caller hands in (capacity x row_bytes; pinned or CUDA-registered host
 * memory, so a GPU can read them); the metadata below is allocated here and counted by
 * rc_metadata_bytes(). Row ids are the table's global row ids; rows outside this rank's range
 * [vocab_start, vocab_end) come back as zeros and are never cached.
 *
 * Correctness rules (each has a test in tests/sidecar/test_row_cache*.py):
 * - A hit compares the full 64-bit row id stored with the slot: a row is never returned for
 *   another id, whatever the hash does (the tests run with every id colliding).
 * - A slot being filled is FILLING: invisible to hits and never evicted; lookups that want it wait
 *   for it (no second read of the same row); it becomes VALID only after its bytes are written.
 * - Hits copy under the cache lock (large lookups on several threads, all joined before it is
 *   released), so no eviction can overwrite a slot while it is copied out.
 * - Fail-closed: after an I/O error or a short read the cache refuses every later call; a row of
 *   this rank is never returned as zeros.
 *
 * Policies (measured in benchmarks/row_cache/): RC_S3FIFO (default: small FIFO of new rows, main
 * FIFO with up to 3 second chances, a ghost of rows evicted from the small queue kept as two
 * rotating Bloom filters), RC_CLOCK (second chance, new rows enter unreferenced), RC_LRU.
 *
 * Miss path: unique missing rows, sorted by id, read as runs of whole 4 KiB pages into an aligned
 * bounce buffer by up to `workers` threads with pread, on O_DIRECT descriptors when the caller opened
 * them (the page cache never holds the table), else on buffered ones followed by POSIX_FADV_DONTNEED
 * of the pages read ("drop the page after copying").
 *
 * Where rows lie: the table is `nregions` regions, region r holding rows [rstart[r], rstart[r + 1])
 * row-major from byte roff[r] of file rfile[r] (a copied table: one region, its own file at byte 0; an
 * in-place table: the checkpoint shards' tensors). The caller's manifest gives them; this file only
 * looks them up (region_of, row_offset). Rows sorted by id run through one region after another, and
 * within a region in file order, so a run of pages never crosses a region.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#define RC_ABI 3
#define RC_PAGE 4096
#define RC_NIL (-1)
#define RC_MAX_WORKERS 256
#define RC_EXIT_CODE 70 /* EX_SOFTWARE, as native_read.c */

enum { RC_LRU = 0, RC_CLOCK = 1, RC_S3FIFO = 2 };
enum { RC_FREE = 0, RC_FILLING = 1, RC_VALID = 2 };
#define RC_STATE_MASK 3
#define RC_IN_MAIN 4      /* S3-FIFO: slot is in the main queue (else the small one) */
#define RC_PREFETCHED 8   /* filled by a prefetch and not yet looked up */
#define RC_FREQ_SHIFT 4   /* bits 4-5: CLOCK's reference bit, S3-FIFO's count (0-3) */
#define RC_FREQ_MASK (3 << RC_FREQ_SHIFT)

/* rc_read flags */
#define RC_F_PREFETCH 1 /* fill the cache only: no output, present rows are left alone */
#define RC_F_NODATA 2   /* simulation: every decision and counter, no read and no copy */

enum {
    ST_CALLS, ST_LOOKUPS, ST_HITS, ST_WAITS, ST_MISS_LOOKUPS, ST_ROWS_READ, ST_PAGES_READ, ST_READS, ST_BYTES_READ,
    ST_INSERTS, ST_EVICTIONS, ST_BYPASS, ST_OUT_OF_RANK, ST_PREFETCH_CALLS, ST_PREFETCH_ROWS, ST_PREFETCH_HITS,
    ST_PREFETCH_EVICTED_UNUSED, ST_GHOST_HITS, ST_PARALLEL_PASSES, ST_N
};

typedef struct rc_cache {
    int64_t capacity, row_bytes;
    int64_t vocab_start, vocab_end, total_rows;
    int32_t nregions, nfiles; /* nfiles 0: a simulation (no file, no read) */
    int64_t *rstart, *roff;   /* nregions + 1 row starts (the last: the table's end), byte of each region's first row */
    int32_t *rfile;           /* each region's file */
    int32_t *ffd;             /* each file's descriptor (the caller's) */
    int64_t *fbytes;          /* each file's size: a shorter one is refused, reads stop at its end */
    struct stat *fbase;       /* each file's identity when the cache was made: any writer changes it */
    int32_t direct, workers, policy, debug_hash, debug_delay_us;
    int64_t wave_pages, max_read_pages;
    uint8_t *rows; /* the caller's; NULL in simulation */
    uint32_t *keys; /* this rank's row (id - vocab_start): every id of the range fits, so this is the full id */
    uint8_t *state; /* RC_STATE_MASK | RC_IN_MAIN | RC_PREFETCHED | the policy's count (RC_FREQ_*) */
    uint16_t *hits; /* lookups of the slot's row since it was cached (saturating; halved by rc_hottest's aging):
                     * the hot file's ranking, 2 bytes a slot inside the budget (rc_metadata_bytes) */
    int32_t *next, *prev; /* queue links; prev only for LRU */
    int32_t *index;
    int64_t index_cap;
    uint64_t seed;
    int32_t head[2], tail[2];
    int64_t qlen[2];
    int32_t free_head;
    int64_t hand;
    int64_t s_target;
    int32_t s3_threshold, s3_keep_freq;
    uint64_t *ghost[2];
    int64_t ghost_bits, ghost_count, ghost_gen;
    int32_t ghost_cur;
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int32_t closed, failed, inflight;
    char error[512];
    int64_t stats[ST_N];
} rc_cache_t;

/* ------------------------------------------------------------------ hashing and the index */

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

static inline int64_t home(const rc_cache_t *c, uint32_t key) {
    if (c->debug_hash == 1) return (int64_t)((uint64_t)key % (uint64_t)c->index_cap); /* tests: craftable collisions */
    if (c->debug_hash == 2) return 0;                                                  /* tests: every key collides */
    return (int64_t)(((unsigned __int128)mix64((uint64_t)key ^ c->seed) * (uint64_t)c->index_cap) >> 64);
}

static inline int64_t step(const rc_cache_t *c, int64_t i) { return i + 1 == c->index_cap ? 0 : i + 1; }

static int32_t find(const rc_cache_t *c, uint32_t key) {
    for (int64_t i = home(c, key);; i = step(c, i)) {
        const int32_t s = c->index[i];
        if (s == RC_NIL) return RC_NIL;
        if (c->keys[s] == key) return s;
    }
}

static void index_insert(rc_cache_t *c, uint32_t key, int32_t slot) {
    int64_t i = home(c, key);
    while (c->index[i] != RC_NIL) i = step(c, i);
    c->index[i] = slot;
}

/* Backward-shift deletion: no tombstones, probe chains stay as short as on insertion. */
static void index_erase(rc_cache_t *c, uint32_t key) {
    int64_t i = home(c, key);
    while (c->index[i] != RC_NIL && c->keys[c->index[i]] != key) i = step(c, i);
    if (c->index[i] == RC_NIL) return;
    for (int64_t j = step(c, i);; j = step(c, j)) {
        const int32_t s = c->index[j];
        if (s == RC_NIL) break;
        const int64_t k = home(c, c->keys[s]);
        const int64_t dist_kj = (j - k + c->index_cap) % c->index_cap, dist_ij = (j - i + c->index_cap) % c->index_cap;
        if (dist_kj >= dist_ij) { /* s may move back to i without leaving its probe chain */
            c->index[i] = s;
            i = j;
        }
    }
    c->index[i] = RC_NIL;
}

/* ------------------------------------------------------------------ queues (intrusive, by slot) */

static void q_push(rc_cache_t *c, int q, int32_t s) {
    c->next[s] = RC_NIL;
    if (c->prev) c->prev[s] = c->tail[q];
    if (c->tail[q] == RC_NIL) c->head[q] = s;
    else c->next[c->tail[q]] = s;
    c->tail[q] = s;
    c->qlen[q]++;
}

static int32_t q_pop(rc_cache_t *c, int q) {
    const int32_t s = c->head[q];
    if (s == RC_NIL) return RC_NIL;
    c->head[q] = c->next[s];
    if (c->head[q] == RC_NIL) c->tail[q] = RC_NIL;
    else if (c->prev) c->prev[c->head[q]] = RC_NIL;
    c->qlen[q]--;
    return s;
}

static void q_unlink(rc_cache_t *c, int q, int32_t s) { /* LRU only (doubly linked) */
    const int32_t p = c->prev[s], n = c->next[s];
    if (p == RC_NIL) c->head[q] = n;
    else c->next[p] = n;
    if (n == RC_NIL) c->tail[q] = p;
    else c->prev[n] = p;
    c->qlen[q]--;
}

/* ------------------------------------------------------------------ S3-FIFO ghost: two Bloom filters */

#define GHOST_K 4
static void ghost_bits_of(const rc_cache_t *c, uint32_t key, uint64_t *bits) {
    const uint64_t h = mix64((uint64_t)key ^ (c->seed * 0x9E3779B97F4A7C15ULL + 1));
    const uint64_t h1 = h, h2 = mix64(h) | 1;
    for (int k = 0; k < GHOST_K; k++) bits[k] = (h1 + (uint64_t)k * h2) % (uint64_t)c->ghost_bits;
}

static int ghost_contains(const rc_cache_t *c, uint32_t key) {
    if (!c->ghost[0]) return 0;
    uint64_t b[GHOST_K];
    ghost_bits_of(c, key, b);
    for (int g = 0; g < 2; g++) {
        int all = 1;
        for (int k = 0; k < GHOST_K && all; k++) all = (c->ghost[g][b[k] >> 6] >> (b[k] & 63)) & 1;
        if (all) return 1;
    }
    return 0;
}

static void ghost_add(rc_cache_t *c, uint32_t key) {
    if (!c->ghost[0]) return;
    if (c->ghost_count >= c->ghost_gen) { /* rotate: forget the older generation */
        c->ghost_cur ^= 1;
        memset(c->ghost[c->ghost_cur], 0, (size_t)((c->ghost_bits + 63) / 64) * 8);
        c->ghost_count = 0;
    }
    uint64_t b[GHOST_K];
    ghost_bits_of(c, key, b);
    for (int k = 0; k < GHOST_K; k++) c->ghost[c->ghost_cur][b[k] >> 6] |= 1ULL << (b[k] & 63);
    c->ghost_count++;
}

/* ------------------------------------------------------------------ policies */

static inline int st(const rc_cache_t *c, int32_t s) { return c->state[s] & RC_STATE_MASK; }
static inline int freq(const rc_cache_t *c, int32_t s) { return (c->state[s] & RC_FREQ_MASK) >> RC_FREQ_SHIFT; }
static inline void set_freq(rc_cache_t *c, int32_t s, int f) {
    c->state[s] = (uint8_t)((c->state[s] & ~RC_FREQ_MASK) | (f << RC_FREQ_SHIFT));
}
/* The slot of this rank's row `id` (the caller has checked vocab_start <= id < vocab_end). */
static inline uint32_t local_key(const rc_cache_t *c, int64_t id) { return (uint32_t)(id - c->vocab_start); }

/* The region holding row id (the last whose first row is <= id). */
static inline int32_t region_of(const rc_cache_t *c, int64_t id) {
    int32_t lo = 0, hi = c->nregions - 1;
    while (lo < hi) {
        const int32_t mid = lo + (hi - lo + 1) / 2;
        if (c->rstart[mid] <= id) lo = mid;
        else hi = mid - 1;
    }
    return lo;
}

static inline int64_t row_offset(const rc_cache_t *c, int32_t r, int64_t id) {
    return c->roff[r] + (id - c->rstart[r]) * c->row_bytes;
}

static void policy_insert(rc_cache_t *c, int32_t s, uint32_t key) {
    set_freq(c, s, 0);
    if (c->policy == RC_LRU) {
        q_push(c, 0, s);
    } else if (c->policy == RC_S3FIFO) {
        if (ghost_contains(c, key)) {
            c->state[s] |= RC_IN_MAIN;
            c->stats[ST_GHOST_HITS]++;
            q_push(c, 1, s);
        } else {
            q_push(c, 0, s);
        }
    } /* CLOCK: slots are the clock; a new row starts unreferenced */
}

static void policy_hit(rc_cache_t *c, int32_t s) {
    if (c->policy == RC_LRU) {
        q_unlink(c, 0, s);
        q_push(c, 0, s);
    } else if (c->policy == RC_CLOCK) {
        set_freq(c, s, 1);
    } else if (freq(c, s) < 3) {
        set_freq(c, s, freq(c, s) + 1);
    }
}

/* A victim (VALID, already out of every queue), or RC_NIL when every row is being filled. */
static int32_t evict_lru(rc_cache_t *c) {
    for (int64_t tries = c->qlen[0]; tries > 0; tries--) {
        const int32_t s = q_pop(c, 0);
        if (st(c, s) == RC_VALID) return s;
        q_push(c, 0, s); /* being filled: keep it */
    }
    return RC_NIL;
}

static int32_t evict_clock(rc_cache_t *c) {
    for (int64_t tries = 2 * c->capacity + 1; tries > 0; tries--) {
        const int32_t s = (int32_t)c->hand;
        c->hand = c->hand + 1 == c->capacity ? 0 : c->hand + 1;
        if (st(c, s) != RC_VALID) continue;
        if (freq(c, s)) set_freq(c, s, 0);
        else return s;
    }
    return RC_NIL;
}

static int32_t evict_main(rc_cache_t *c) {
    for (int64_t tries = 4 * c->qlen[1] + 1; tries > 0 && c->qlen[1]; tries--) {
        const int32_t s = q_pop(c, 1);
        if (st(c, s) != RC_VALID) {
            q_push(c, 1, s);
        } else if (freq(c, s)) {
            set_freq(c, s, freq(c, s) - 1);
            q_push(c, 1, s);
        } else {
            return s;
        }
    }
    return RC_NIL;
}

/* New rows live in the small queue; the main queue is evicted only while the small one is below its
 * share. When every new row is still being filled (one lookup missing more rows than the small queue
 * holds), a further new row is read without being cached rather than pushing out main rows: a scan
 * larger than the cache passes through without flushing it. */
static int32_t evict_s3fifo(rc_cache_t *c) {
    if (c->qlen[0] && (c->qlen[0] >= c->s_target || !c->qlen[1])) {
        for (int64_t tries = c->qlen[0]; tries > 0 && c->qlen[0]; tries--) {
            const int32_t s = q_pop(c, 0);
            if (st(c, s) != RC_VALID) {
                q_push(c, 0, s);
            } else if (freq(c, s) >= c->s3_threshold) { /* looked up again while new: promote */
                if (!c->s3_keep_freq) set_freq(c, s, 0);
                c->state[s] |= RC_IN_MAIN;
                q_push(c, 1, s);
            } else {
                ghost_add(c, c->keys[s]);
                return s;
            }
        }
        if (c->qlen[0] >= c->s_target) return RC_NIL; /* all of the small queue is being filled: bypass */
    }
    return evict_main(c);
}

/* A free slot for `key`, reserved FILLING and indexed; RC_NIL: read it without caching (bypass). */
static int32_t reserve(rc_cache_t *c, uint32_t key, int prefetch) {
    int32_t s = c->free_head;
    if (s != RC_NIL) {
        c->free_head = c->next[s];
    } else {
        s = c->policy == RC_LRU ? evict_lru(c) : c->policy == RC_CLOCK ? evict_clock(c) : evict_s3fifo(c);
        if (s == RC_NIL) {
            c->stats[ST_BYPASS]++;
            return RC_NIL;
        }
        if (c->state[s] & RC_PREFETCHED) c->stats[ST_PREFETCH_EVICTED_UNUSED]++;
        index_erase(c, c->keys[s]);
        c->stats[ST_EVICTIONS]++;
    }
    c->keys[s] = key;
    c->state[s] = RC_FILLING | (prefetch ? RC_PREFETCHED : 0);
    c->hits[s] = prefetch ? 0 : 1; /* a demand miss is a lookup of the row too */
    index_insert(c, key, s);
    policy_insert(c, s, key);
    c->stats[ST_INSERTS]++;
    return s;
}

/* ------------------------------------------------------------------ errors */

/* Called without the lock held: the message and the flag are read by other calls under it. */
static void set_error(rc_cache_t *c, int fatal, const char *fmt, ...) {
    char msg[sizeof c->error];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    pthread_mutex_lock(&c->lock);
    if (!c->failed) memcpy(c->error, msg, sizeof msg); /* the first failure is the cause */
    if (fatal) c->failed = 1;
    pthread_mutex_unlock(&c->lock);
}

/* ------------------------------------------------------------------ reads */

typedef struct {
    rc_cache_t *c;
    const int64_t *page; /* first page of each run */
    const int64_t *len;  /* pages in each run */
    const int64_t *at;   /* page index in the bounce buffer */
    const int32_t *file; /* the file of each run */
    uint8_t *bounce;
    int64_t a, b;
    int err;
    int32_t err_file;
    int64_t err_off, err_got, err_want;
} rc_job_t;

static void *read_runs(void *arg) {
    rc_job_t *j = (rc_job_t *)arg;
    const rc_cache_t *c = j->c;
    if (c->debug_delay_us) usleep((useconds_t)c->debug_delay_us); /* tests: a slow disk, deterministic races */
    for (int64_t r = j->a; r < j->b && !j->err; r++) {
        const int32_t f = j->file[r];
        const int64_t off = j->page[r] * RC_PAGE, want_full = j->len[r] * RC_PAGE, size = c->fbytes[f];
        const int64_t want = off + want_full <= size ? want_full : size - off;
        uint8_t *dst = j->bounce + j->at[r] * RC_PAGE;
        int64_t got = 0;
        while (got < want) {
            /* O_DIRECT: whole pages at page offsets into a page-aligned buffer (the tail page too) */
            const ssize_t k = pread(c->ffd[f], dst + got, (size_t)(want_full - got), (off_t)(off + got));
            if (k < 0 && errno == EINTR) continue;
            if (k <= 0) {
                j->err = k < 0 ? errno : -1;
                j->err_file = f;
                j->err_off = off;
                j->err_got = got;
                j->err_want = want;
                break;
            }
            got += k;
        }
    }
    return NULL;
}

/* Read runs [0, nruns) into the bounce buffer with up to `workers` threads; 0 or fatal error. */
static int read_wave(rc_cache_t *c, const int64_t *page, const int64_t *len, const int64_t *at, const int32_t *file,
                     int64_t nruns, uint8_t *bounce) {
    int64_t parts = c->workers < RC_MAX_WORKERS ? c->workers : RC_MAX_WORKERS;
    if (parts > (nruns + 3) / 4) parts = (nruns + 3) / 4; /* a thread gets at least 4 reads */
    if (parts < 1) parts = 1;
    rc_job_t jobs[RC_MAX_WORKERS];
    pthread_t threads[RC_MAX_WORKERS];
    int started[RC_MAX_WORKERS];
    const int64_t per = (nruns + parts - 1) / parts;
    int64_t k = 0;
    for (int64_t a = 0; a < nruns; a += per, k++) {
        jobs[k] = (rc_job_t){c, page, len, at, file, bounce, a, a + per < nruns ? a + per : nruns, 0, 0, 0, 0, 0};
        started[k] = 0;
    }
    for (int64_t i = 0; i + 1 < k; i++) started[i] = pthread_create(&threads[i], NULL, read_runs, &jobs[i]) == 0;
    read_runs(&jobs[k - 1]);
    for (int64_t i = 0; i + 1 < k; i++) {
        if (started[i]) pthread_join(threads[i], NULL);
        else read_runs(&jobs[i]);
    }
    for (int64_t i = 0; i < k; i++) {
        if (!jobs[i].err) continue;
        if (jobs[i].err > 0)
            set_error(c, 1, "SidecarIOError: I/O error reading the PLE table (file %d) at byte %lld: %s",
                      jobs[i].err_file, (long long)jobs[i].err_off, strerror(jobs[i].err));
        else
            set_error(c, 1, "SidecarTruncated: short read of the PLE table (file %d): %lld of %lld bytes at byte %lld "
                            "(was it truncated or replaced?)", jobs[i].err_file,
                      (long long)jobs[i].err_got, (long long)jobs[i].err_want, (long long)jobs[i].err_off);
        return -1;
    }
    if (!c->direct) /* buffered reads: drop the pages we just copied from */
        for (int64_t r = 0; r < nruns; r++)
            posix_fadvise(c->ffd[file[r]], (off_t)(page[r] * RC_PAGE), (off_t)(len[r] * RC_PAGE), POSIX_FADV_DONTNEED);
    return 0;
}

/* ------------------------------------------------------------------ lookups */

static __thread const int64_t *t_sort_ids; /* qsort has no context argument: per thread, for concurrent lookups */
static int by_id(const void *a, const void *b) {
    const int64_t i = *(const int64_t *)a, j = *(const int64_t *)b, x = t_sort_ids[i], y = t_sort_ids[j];
    return x < y ? -1 : x > y ? 1 : (i > j) - (i < j);
}

/* Before and after every lookup that reads: a table file written in place (cp over it, truncate and regrow)
   changes its mtime, so no row read across such a write is served (reader.file_identity says why ctime is
   not compared). Every file of the table, each time. */
static int stat_file(rc_cache_t *c) {
    for (int32_t f = 0; f < c->nfiles; f++) { /* none in a simulation */
        struct stat sb;
        const struct stat *base = &c->fbase[f];
        if (fstat(c->ffd[f], &sb) != 0) {
            set_error(c, 1, "SidecarIOError: cannot stat the PLE table (file %d): %s", f, strerror(errno));
            return -1;
        }
        if ((int64_t)sb.st_size < c->fbytes[f]) {
            set_error(c, 1, "SidecarTruncated: the PLE table (file %d) is truncated: it has %lld bytes, expected %lld "
                            "(was it rewritten while the server runs?)",
                      f, (long long)sb.st_size, (long long)c->fbytes[f]);
            return -1;
        }
        if (sb.st_dev != base->st_dev || sb.st_ino != base->st_ino || sb.st_size != base->st_size ||
            sb.st_mtim.tv_sec != base->st_mtim.tv_sec || sb.st_mtim.tv_nsec != base->st_mtim.tv_nsec) {
            set_error(c, 1, "SidecarChanged: the PLE table (file %d) was written while it is served (its size or mtime "
                            "changed since it was opened); none of its rows is served any more", f);
            return -1;
        }
    }
    return 0;
}

/* Under the lock: the bookkeeping of a hit on valid slot s (its row already copied out). */
static void count_hit(rc_cache_t *c, int32_t s) {
    if (c->state[s] & RC_PREFETCHED) {
        c->state[s] &= (uint8_t)~RC_PREFETCHED;
        c->stats[ST_PREFETCH_HITS]++;
    }
    policy_hit(c, s);
    if (c->hits[s] != UINT16_MAX) c->hits[s]++;
    c->stats[ST_HITS]++;
}

/* Under the lock: a valid slot serves position i. */
static void serve(rc_cache_t *c, int32_t s, uint8_t *out, int64_t i, int nodata) {
    if (!nodata) memcpy(out + i * c->row_bytes, c->rows + (int64_t)s * c->row_bytes, (size_t)c->row_bytes);
    count_hit(c, s);
}

/* A prefill chunk's lookup (32,768 rows for 2,048 tokens) is mostly hits once warm: one thread
 * probing the index and copying the scattered rows took 1.05-1.34 ms on the H200 box, 8 threads
 * 0.63-0.92 ms (benchmarks/row_cache/h200/warm_*.json). Large first passes probe and copy on several threads while
 * the caller holds the cache lock (nothing can change the index or evict a slot meanwhile; the
 * threads only read metadata and write disjoint rows of `out`); the hits' policy updates and counters
 * then run on the caller's thread in position order, so every decision is the serial pass's. */
#define RC_PAR_MIN 8192 /* positions at which the first pass goes parallel */
#define RC_PAR_PER 4096 /* positions per thread at least */
#define RC_PAR_MAX 8
#define RC_WAITING (-2)

typedef struct {
    const rc_cache_t *c;
    const int64_t *ids, *pos;
    uint8_t *out;
    int32_t *slot; /* per position: the valid slot copied out, RC_NIL (miss) or RC_WAITING (being filled) */
    int64_t a, b;
} rc_scan_t;

static void *scan_part(void *arg) {
    const rc_scan_t *j = (const rc_scan_t *)arg;
    const rc_cache_t *c = j->c;
    const int64_t rb = c->row_bytes;
    for (int64_t q = j->a; q < j->b; q++) {
        const int64_t i = j->pos[q];
        const int32_t s = find(c, local_key(c, j->ids[i]));
        if (s != RC_NIL && st(c, s) == RC_VALID) memcpy(j->out + i * rb, c->rows + (int64_t)s * rb, (size_t)rb);
        j->slot[q] = s == RC_NIL ? RC_NIL : st(c, s) == RC_VALID ? s : RC_WAITING;
    }
    return NULL;
}

/* Under the lock: the first pass over npos positions on `parts` threads (the caller's included). */
static void scan_parallel(const rc_cache_t *c, const int64_t *ids, uint8_t *out, const int64_t *pos, int64_t npos,
                          int32_t *slot, int64_t parts) {
    rc_scan_t jobs[RC_PAR_MAX];
    pthread_t threads[RC_PAR_MAX];
    int started[RC_PAR_MAX];
    const int64_t per = (npos + parts - 1) / parts;
    int64_t k = 0;
    for (int64_t a = 0; a < npos; a += per, k++) jobs[k] = (rc_scan_t){c, ids, pos, out, slot, a, a + per < npos ? a + per : npos};
    for (int64_t t = 0; t + 1 < k; t++) started[t] = pthread_create(&threads[t], NULL, scan_part, &jobs[t]) == 0;
    scan_part(&jobs[k - 1]);
    for (int64_t t = 0; t + 1 < k; t++) {
        if (started[t]) pthread_join(threads[t], NULL);
        else scan_part(&jobs[t]);
    }
}

/* One round over `pos` (positions into ids/out). Positions whose row was being filled by another
 * call and vanished before it became valid (evicted, or that call failed) are put back in `pos`;
 * returns how many, or -1 on a fatal error. */
static int64_t round_(rc_cache_t *c, const int64_t *ids, uint8_t *out, int flags, int64_t *pos, int64_t npos,
                      int64_t *miss, int64_t *wait) {
    const int64_t rb = c->row_bytes;
    const int prefetch = flags & RC_F_PREFETCH, nodata = flags & RC_F_NODATA;
    int64_t nmiss = 0, nwait = 0, nu = 0, ret = 0;
    int64_t *ufirst = NULL, *uend = NULL, *uslot = NULL, *upage = NULL, *ulen = NULL, *uat = NULL, *usrc = NULL;
    int32_t *ufile = NULL;
    uint8_t *bounce = NULL;

    int64_t parts = c->workers < RC_PAR_MAX ? c->workers : RC_PAR_MAX;
    if (parts > npos / RC_PAR_PER) parts = npos / RC_PAR_PER;
    int32_t *slot = !prefetch && !nodata && npos >= RC_PAR_MIN && parts > 1 ? malloc((size_t)npos * sizeof *slot) : NULL;
    pthread_mutex_lock(&c->lock);
    if (slot) {
        scan_parallel(c, ids, out, pos, npos, slot, parts);
        c->stats[ST_PARALLEL_PASSES]++;
        for (int64_t q = 0; q < npos; q++) {
            if (slot[q] == RC_NIL) miss[nmiss++] = pos[q];
            else if (slot[q] == RC_WAITING) wait[nwait++] = pos[q];
            else count_hit(c, slot[q]);
        }
    } else { /* small lookups (decode), prefetches, simulation; or no memory for the parallel pass */
        for (int64_t q = 0; q < npos; q++) {
            const int64_t i = pos[q];
            const int32_t s = find(c, local_key(c, ids[i]));
            if (s == RC_NIL) miss[nmiss++] = i;
            else if (prefetch) continue; /* present or on its way: nothing to do */
            else if (st(c, s) == RC_VALID) serve(c, s, out, i, nodata);
            else wait[nwait++] = i;
        }
    }
    pthread_mutex_unlock(&c->lock);
    free(slot);

    if (nmiss) {
        /* unique rows by id (region by region, file order in each); each row's positions are adjacent in `miss` */
        t_sort_ids = ids;
        qsort(miss, (size_t)nmiss, sizeof *miss, by_id);
        ufirst = malloc((size_t)nmiss * sizeof *ufirst);
        uend = malloc((size_t)nmiss * sizeof *uend);
        uslot = malloc((size_t)nmiss * sizeof *uslot);
        usrc = malloc((size_t)nmiss * sizeof *usrc);
        if (!ufirst || !uend || !uslot || !usrc) {
            set_error(c, 0, "out of memory planning %lld row reads", (long long)nmiss);
            ret = -1;
            goto done;
        }
        pthread_mutex_lock(&c->lock);
        for (int64_t q = 0, e; q < nmiss; q = e) {
            const int64_t id = ids[miss[q]];
            for (e = q + 1; e < nmiss && ids[miss[e]] == id; e++) {
            }
            const int32_t s = find(c, local_key(c, id)); /* another call may have brought it since the first pass */
            if (s != RC_NIL) {
                for (int64_t k = q; k < e && !prefetch; k++) {
                    if (st(c, s) == RC_VALID) serve(c, s, out, miss[k], nodata);
                    else wait[nwait++] = miss[k];
                }
                continue;
            }
            uslot[nu] = reserve(c, local_key(c, id), prefetch);
            ufirst[nu] = q;
            uend[nu] = e;
            nu++;
            if (!prefetch) c->stats[ST_MISS_LOOKUPS] += e - q;
        }
        pthread_mutex_unlock(&c->lock);
    }
    if (nu) {
        const int64_t spill = (rb + RC_PAGE - 2) / RC_PAGE + 1; /* most pages one row touches */
        const int64_t wave = c->wave_pages > spill ? c->wave_pages : spill;
        upage = malloc((size_t)wave * sizeof *upage);
        ulen = malloc((size_t)wave * sizeof *ulen);
        uat = malloc((size_t)wave * sizeof *uat);
        ufile = malloc((size_t)wave * sizeof *ufile);
        if (!nodata && posix_memalign((void **)&bounce, RC_PAGE, (size_t)wave * RC_PAGE)) bounce = NULL;
        if (!upage || !ulen || !uat || !ufile || (!nodata && !bounce)) {
            set_error(c, 0, "out of memory for the row-read buffer (%lld pages)", (long long)wave);
            ret = -1;
            goto release;
        }
        for (int64_t u0 = 0, u1; u0 < nu; u0 = u1) {
            /* a wave: whole rows whose pages fit the bounce buffer; pages deduplicated within a region (its rows
             * come in file order), runs coalesced within a file; each row's first byte in the bounce buffer noted */
            int64_t npages = 0, nruns = 0, last = -1;
            int32_t last_region = -1;
            for (u1 = u0; u1 < nu; u1++) {
                const int64_t id = ids[miss[ufirst[u1]]];
                /* a simulation has no regions: its rows lie as one table's from byte 0 */
                const int32_t reg = c->nfiles ? region_of(c, id) : 0, f = c->nfiles ? c->rfile[reg] : 0;
                const int64_t off = c->nfiles ? row_offset(c, reg, id) : id * rb;
                if (reg != last_region) last = -1; /* another region: its pages may lie anywhere in its file */
                const int64_t p0 = off / RC_PAGE, p1 = (off + rb - 1) / RC_PAGE, from = p0 > last ? p0 : last + 1;
                if (npages + (p1 >= from ? p1 - from + 1 : 0) > wave) break;
                usrc[u1] = (from == p0 ? npages : npages - 1) * RC_PAGE + (off - p0 * RC_PAGE);
                for (int64_t p = from; p <= p1; p++) {
                    if (nruns && ufile[nruns - 1] == f && p == upage[nruns - 1] + ulen[nruns - 1] &&
                        ulen[nruns - 1] < c->max_read_pages) {
                        ulen[nruns - 1]++;
                    } else {
                        upage[nruns] = p;
                        ulen[nruns] = 1;
                        uat[nruns] = npages;
                        ufile[nruns] = f;
                        nruns++;
                    }
                    npages++;
                    last = p;
                }
                last_region = reg;
            }
            if (!nodata) {
                if (read_wave(c, upage, ulen, uat, ufile, nruns, bounce) != 0) {
                    ret = -1;
                    goto release;
                }
                /* scatter: bounce -> slot (FILLING: nobody reads or evicts it) and -> every position.
                 * A row's pages were placed one after another in the bounce buffer, so a row spilling
                 * into the next page finds it right after its first. */
                for (int64_t u = u0; u < u1; u++) {
                    const uint8_t *src = bounce + usrc[u];
                    if (uslot[u] != RC_NIL) memcpy(c->rows + uslot[u] * rb, src, (size_t)rb);
                    for (int64_t k = ufirst[u]; k < uend[u] && !prefetch; k++)
                        memcpy(out + miss[k] * rb, src, (size_t)rb);
                }
            }
            pthread_mutex_lock(&c->lock);
            for (int64_t u = u0; u < u1; u++)
                if (uslot[u] != RC_NIL) {
                    c->state[uslot[u]] = (uint8_t)((c->state[uslot[u]] & ~RC_STATE_MASK) | RC_VALID);
                    uslot[u] = RC_NIL; /* published: no longer ours to release */
                }
            c->stats[ST_PAGES_READ] += npages;
            c->stats[ST_READS] += nruns;
            c->stats[ST_ROWS_READ] += u1 - u0;
            if (!nodata) c->stats[ST_BYTES_READ] += npages * RC_PAGE;
            if (prefetch) c->stats[ST_PREFETCH_ROWS] += u1 - u0;
            pthread_cond_broadcast(&c->cond);
            pthread_mutex_unlock(&c->lock);
        }
    }
release:
    if (ret < 0) { /* leave no half-filled slot visible; the cache refuses all later calls */
        pthread_mutex_lock(&c->lock);
        for (int64_t u = 0; u < nu; u++)
            if (uslot[u] != RC_NIL) {
                index_erase(c, local_key(c, ids[miss[ufirst[u]]]));
                c->state[uslot[u]] = RC_FREE;
            }
        c->failed = 1;
        pthread_cond_broadcast(&c->cond);
        pthread_mutex_unlock(&c->lock);
    }
done:
    free(ufirst);
    free(uend);
    free(uslot);
    free(usrc);
    free(upage);
    free(ulen);
    free(uat);
    free(ufile);
    free(bounce);
    if (ret < 0) return -1;

    /* Rows another call is filling: wait for them (no second read of the same row). */
    int64_t left = 0;
    if (nwait) {
        pthread_mutex_lock(&c->lock);
        for (int64_t q = 0; q < nwait; q++) {
            const int64_t i = wait[q];
            c->stats[ST_WAITS]++;
            for (;;) {
                if (c->failed) {
                    pthread_mutex_unlock(&c->lock);
                    return -1;
                }
                const int32_t s = find(c, local_key(c, ids[i]));
                if (s == RC_NIL) { /* gone before we saw it valid: look it up again next round */
                    pos[left++] = i;
                    break;
                }
                if (st(c, s) == RC_VALID) {
                    serve(c, s, out, i, nodata);
                    break;
                }
                pthread_cond_wait(&c->cond, &c->lock);
            }
        }
        pthread_mutex_unlock(&c->lock);
    }
    return left;
}

/* Fill out[i] with row ids[i] (zeros for other ranks' rows). Returns 0; -1: fatal (message in err;
 * the cache is unusable); -2: an id outside [0, total_rows) (nothing written; still usable);
 * -3: closed or failed before. With RC_F_PREFETCH, `out` is unused and present rows are left alone. */
int rc_read(rc_cache_t *c, const int64_t *ids, int64_t n, uint8_t *out, int32_t flags, char *err, int64_t errlen) {
    pthread_mutex_lock(&c->lock);
    if (c->closed || c->failed) {
        snprintf(err, (size_t)errlen, "%s", c->closed ? "the PLE row cache is closed" : c->error);
        pthread_mutex_unlock(&c->lock);
        return -3;
    }
    c->inflight++;
    c->stats[(flags & RC_F_PREFETCH) ? ST_PREFETCH_CALLS : ST_CALLS]++;
    pthread_mutex_unlock(&c->lock);

    int rc = 0;
    int64_t *pos = NULL, *miss = NULL, *wait = NULL;
    for (int64_t i = 0; i < n; i++) /* every id before anything is written */
        if (ids[i] < 0 || ids[i] >= c->total_rows) {
            snprintf(err, (size_t)errlen, "PLE row id %lld (position %lld) is outside the table, expected 0 <= id < %lld",
                     (long long)ids[i], (long long)i, (long long)c->total_rows);
            rc = -2;
            goto out;
        }
    if (!(flags & RC_F_NODATA) && stat_file(c) != 0) {
        pthread_mutex_lock(&c->lock);
        pthread_cond_broadcast(&c->cond);
        pthread_mutex_unlock(&c->lock);
        snprintf(err, (size_t)errlen, "%s", c->error);
        rc = -1;
        goto out;
    }
    pos = malloc((size_t)(n ? n : 1) * sizeof *pos);
    miss = malloc((size_t)(n ? n : 1) * sizeof *miss);
    wait = malloc((size_t)(n ? n : 1) * sizeof *wait);
    if (!pos || !miss || !wait) {
        snprintf(err, (size_t)errlen, "out of memory for a lookup of %lld rows", (long long)n);
        rc = -1;
        goto out;
    }
    int64_t npos = 0, in_rank = 0;
    const int64_t rb = c->row_bytes;
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] >= c->vocab_start && ids[i] < c->vocab_end) {
            pos[npos++] = i;
            in_rank++;
        } else if (!(flags & (RC_F_PREFETCH | RC_F_NODATA))) {
            memset(out + i * rb, 0, (size_t)rb); /* another rank's row */
        }
    }
    pthread_mutex_lock(&c->lock);
    if (!(flags & RC_F_PREFETCH)) c->stats[ST_LOOKUPS] += in_rank;
    c->stats[ST_OUT_OF_RANK] += n - in_rank;
    pthread_mutex_unlock(&c->lock);
    while (npos > 0) {
        const int64_t left = round_(c, ids, out, flags, pos, npos, miss, wait);
        if (left < 0) {
            pthread_mutex_lock(&c->lock);
            snprintf(err, (size_t)errlen, "%s", c->error);
            pthread_mutex_unlock(&c->lock);
            rc = -1;
            goto out;
        }
        npos = left;
    }
    if (!(flags & RC_F_NODATA) && stat_file(c) != 0) { /* rows read across a write are not served */
        pthread_mutex_lock(&c->lock);
        pthread_cond_broadcast(&c->cond);
        snprintf(err, (size_t)errlen, "%s", c->error);
        pthread_mutex_unlock(&c->lock);
        rc = -1;
    }
out:
    free(pos);
    free(miss);
    free(wait);
    pthread_mutex_lock(&c->lock);
    c->inflight--;
    pthread_cond_broadcast(&c->cond);
    pthread_mutex_unlock(&c->lock);
    return rc;
}

/* ------------------------------------------------------------------ lifecycle */

int64_t rc_metadata_bytes(int64_t capacity, int32_t policy, double s3_ghost_fraction) {
    const int64_t index_cap = capacity + capacity / 2 + 1;
    int64_t b = (int64_t)sizeof(rc_cache_t) + capacity * (4 + 1 + 4 + 2) + index_cap * 4;
    if (policy == RC_LRU) b += capacity * 4;
    if (policy == RC_S3FIFO) {
        const int64_t gen = (int64_t)(s3_ghost_fraction * (double)capacity) + 1, bits = gen * 8 + 64;
        b += 2 * ((bits + 63) / 64) * 8;
    }
    return b;
}

int64_t rc_bounce_bytes(int64_t wave_pages) { return wave_pages * RC_PAGE; }

int rc_abi(void) { return RC_ABI; }

void rc_free(rc_cache_t *c);

/* Mirrored by row_cache.py (_Config); rc_config_layout lets it check the layout before the first call. */
typedef struct {
    int64_t capacity, row_bytes, vocab_start, vocab_end, total_rows, wave_pages, max_read_pages;
    uint64_t seed;
    double s3_small_fraction, s3_ghost_fraction;
    const int64_t *region_row_start; /* nregions + 1: region r holds rows [start[r], start[r + 1]) */
    const int64_t *region_offset;    /* the byte of each region's first row in its file */
    const int32_t *region_file;      /* each region's file (an index into file_fd and file_bytes) */
    const int32_t *file_fd;          /* the caller's descriptors, open while the cache is */
    const int64_t *file_bytes;       /* each file's size */
    int32_t nregions, nfiles;        /* nfiles 0: a simulation (no region, no read) */
    int32_t policy, direct, workers, debug_hash, s3_threshold, s3_keep_freq, debug_delay_us;
} rc_config_t;

int rc_config_layout(size_t *out, int cap) {
    const size_t v[] = {sizeof(rc_config_t), offsetof(rc_config_t, capacity), offsetof(rc_config_t, row_bytes),
                        offsetof(rc_config_t, vocab_start), offsetof(rc_config_t, vocab_end),
                        offsetof(rc_config_t, total_rows), offsetof(rc_config_t, wave_pages),
                        offsetof(rc_config_t, max_read_pages), offsetof(rc_config_t, seed),
                        offsetof(rc_config_t, s3_small_fraction), offsetof(rc_config_t, s3_ghost_fraction),
                        offsetof(rc_config_t, region_row_start), offsetof(rc_config_t, region_offset),
                        offsetof(rc_config_t, region_file), offsetof(rc_config_t, file_fd),
                        offsetof(rc_config_t, file_bytes), offsetof(rc_config_t, nregions),
                        offsetof(rc_config_t, nfiles), offsetof(rc_config_t, policy), offsetof(rc_config_t, direct),
                        offsetof(rc_config_t, workers), offsetof(rc_config_t, debug_hash),
                        offsetof(rc_config_t, s3_threshold), offsetof(rc_config_t, s3_keep_freq),
                        offsetof(rc_config_t, debug_delay_us)};
    const int n = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

/* Why the regions cannot hold this rank's rows [vocab_start, vocab_end), or NULL: they must run on without gap or
 * overlap from a row at or below vocab_start to one at or above vocab_end, each inside its file. */
static const char *bad_regions(const rc_config_t *cfg) {
    if (cfg->nfiles == 0) return cfg->nregions == 0 ? NULL : "regions without files";
    if (cfg->nregions < 1 || !cfg->region_row_start || !cfg->region_offset || !cfg->region_file || !cfg->file_fd ||
        !cfg->file_bytes)
        return "no regions";
    const int64_t *start = cfg->region_row_start;
    if (start[0] > cfg->vocab_start || start[cfg->nregions] < cfg->vocab_end) return "regions miss rows of the rank";
    for (int32_t r = 0; r < cfg->nregions; r++) {
        const int32_t f = cfg->region_file[r];
        if (start[r + 1] <= start[r]) return "regions out of row order";
        if (f < 0 || f >= cfg->nfiles) return "a region names no file";
        if (cfg->region_offset[r] < 0 ||
            cfg->region_offset[r] + (start[r + 1] - start[r]) * cfg->row_bytes > cfg->file_bytes[f])
            return "a region ends past its file";
    }
    return NULL;
}

rc_cache_t *rc_create(uint8_t *rows, const rc_config_t *cfg, char *err, int64_t errlen) {
    const int64_t capacity = cfg->capacity, row_bytes = cfg->row_bytes, vocab_start = cfg->vocab_start,
                  vocab_end = cfg->vocab_end, total_rows = cfg->total_rows, wave_pages = cfg->wave_pages,
                  max_read_pages = cfg->max_read_pages;
    const int32_t policy = cfg->policy, direct = cfg->direct, workers = cfg->workers, debug_hash = cfg->debug_hash,
                  s3_threshold = cfg->s3_threshold, s3_keep_freq = cfg->s3_keep_freq,
                  debug_delay_us = cfg->debug_delay_us, nregions = cfg->nregions, nfiles = cfg->nfiles;
    const uint64_t seed = cfg->seed;
    const double s3_small_fraction = cfg->s3_small_fraction, s3_ghost_fraction = cfg->s3_ghost_fraction;
    const char *why = NULL;
    if (capacity < 1 || capacity > INT32_MAX / 2 || row_bytes < 1 || policy < 0 || policy > 2 || workers < 1 ||
        wave_pages < 1 || max_read_pages < 1 || vocab_end <= vocab_start || vocab_start < 0 ||
        total_rows < vocab_end || vocab_end - vocab_start > (int64_t)UINT32_MAX || nregions < 0 || nfiles < 0 ||
        (why = bad_regions(cfg)) != NULL) {
        snprintf(err, (size_t)errlen, "invalid row cache geometry (capacity %lld, row_bytes %lld, policy %d, "
                 "rows [%lld, %lld) of %lld (at most 2^32 - 1 per rank), %d region(s) in %d file(s)%s%s)",
                 (long long)capacity, (long long)row_bytes, policy, (long long)vocab_start, (long long)vocab_end,
                 (long long)total_rows, nregions, nfiles, why ? ": " : "", why ? why : "");
        return NULL;
    }
    rc_cache_t *c = calloc(1, sizeof *c);
    if (!c) goto oom;
    *c = (rc_cache_t){.capacity = capacity, .row_bytes = row_bytes, .vocab_start = vocab_start, .vocab_end = vocab_end,
                      .total_rows = total_rows, .nregions = nregions, .nfiles = nfiles,
                      .direct = direct, .workers = workers, .policy = policy, .debug_hash = debug_hash,
                      .wave_pages = wave_pages, .max_read_pages = max_read_pages, .rows = rows,
                      .index_cap = capacity + capacity / 2 + 1, .seed = seed, .free_head = RC_NIL, .s3_threshold = s3_threshold,
                      .s3_keep_freq = s3_keep_freq, .debug_delay_us = debug_delay_us};
    if (nfiles) { /* the regions and files are copied: the caller's arrays may go */
        c->rstart = malloc((size_t)(nregions + 1) * sizeof *c->rstart);
        c->roff = malloc((size_t)nregions * sizeof *c->roff);
        c->rfile = malloc((size_t)nregions * sizeof *c->rfile);
        c->ffd = malloc((size_t)nfiles * sizeof *c->ffd);
        c->fbytes = malloc((size_t)nfiles * sizeof *c->fbytes);
        c->fbase = calloc((size_t)nfiles, sizeof *c->fbase);
        if (!c->rstart || !c->roff || !c->rfile || !c->ffd || !c->fbytes || !c->fbase) goto oom;
        memcpy(c->rstart, cfg->region_row_start, (size_t)(nregions + 1) * sizeof *c->rstart);
        memcpy(c->roff, cfg->region_offset, (size_t)nregions * sizeof *c->roff);
        memcpy(c->rfile, cfg->region_file, (size_t)nregions * sizeof *c->rfile);
        memcpy(c->ffd, cfg->file_fd, (size_t)nfiles * sizeof *c->ffd);
        memcpy(c->fbytes, cfg->file_bytes, (size_t)nfiles * sizeof *c->fbytes);
        for (int32_t f = 0; f < nfiles; f++)
            if (fstat(c->ffd[f], &c->fbase[f]) != 0) {
                snprintf(err, (size_t)errlen, "SidecarIOError: cannot stat the PLE table (file %d): %s", f,
                         strerror(errno));
                rc_free(c);
                return NULL;
            }
    }
    c->head[0] = c->head[1] = c->tail[0] = c->tail[1] = RC_NIL;
    c->s_target = (int64_t)(s3_small_fraction * (double)capacity);
    if (c->s_target < 1) c->s_target = 1;
    c->keys = malloc((size_t)capacity * 4);
    c->state = calloc((size_t)capacity, 1);
    c->hits = calloc((size_t)capacity, 2);
    c->next = malloc((size_t)capacity * 4);
    c->index = malloc((size_t)c->index_cap * 4);
    if (policy == RC_LRU) c->prev = malloc((size_t)capacity * 4);
    if (!c->keys || !c->state || !c->hits || !c->next || !c->index || (policy == RC_LRU && !c->prev)) goto oom;
    if (policy == RC_S3FIFO) {
        /* two generations of ghost_fraction x capacity: they remember the last 1-2 x that many evictions */
        c->ghost_gen = (int64_t)(s3_ghost_fraction * (double)capacity) + 1;
        c->ghost_bits = c->ghost_gen * 8 + 64;
        for (int g = 0; g < 2; g++)
            if (!(c->ghost[g] = calloc((size_t)((c->ghost_bits + 63) / 64), 8))) goto oom;
    }
    for (int64_t i = 0; i < c->index_cap; i++) c->index[i] = RC_NIL;
    for (int64_t s = capacity - 1; s >= 0; s--) { /* free list in slot order */
        c->keys[s] = UINT32_MAX;
        c->next[s] = c->free_head;
        c->free_head = (int32_t)s;
    }
    pthread_mutex_init(&c->lock, NULL);
    pthread_cond_init(&c->cond, NULL);
    return c;
oom:
    snprintf(err, (size_t)errlen, "out of memory for the row cache metadata (%lld bytes)",
             (long long)rc_metadata_bytes(capacity, policy, s3_ghost_fraction));
    if (c) rc_free(c);
    return NULL;
}

/* Refuse new calls and wait for the ones in flight; memory stays (rc_free releases it). */
void rc_close(rc_cache_t *c) {
    pthread_mutex_lock(&c->lock);
    c->closed = 1;
    while (c->inflight) pthread_cond_wait(&c->cond, &c->lock);
    pthread_mutex_unlock(&c->lock);
}

void rc_free(rc_cache_t *c) {
    if (!c) return;
    free(c->keys);
    free(c->state);
    free(c->hits);
    free(c->next);
    free(c->prev);
    free(c->index);
    free(c->ghost[0]);
    free(c->ghost[1]);
    free(c->rstart);
    free(c->roff);
    free(c->rfile);
    free(c->ffd);
    free(c->fbytes);
    free(c->fbase);
    free(c);
}

int rc_nstats(void) { return ST_N; }

void rc_stats(rc_cache_t *c, int64_t *out) {
    pthread_mutex_lock(&c->lock);
    memcpy(out, c->stats, sizeof c->stats);
    pthread_mutex_unlock(&c->lock);
}

/* How many rows are cached (VALID) and being filled; for tests and the startup log. */
void rc_occupancy(rc_cache_t *c, int64_t *valid, int64_t *filling) {
    int64_t v = 0, f = 0;
    pthread_mutex_lock(&c->lock);
    for (int64_t s = 0; s < c->capacity; s++) {
        v += st(c, (int32_t)s) == RC_VALID;
        f += st(c, (int32_t)s) == RC_FILLING;
    }
    pthread_mutex_unlock(&c->lock);
    *valid = v;
    *filling = f;
}

/* res[i] = 1 when row ids[i] is cached and valid (no policy update). */
void rc_contains(rc_cache_t *c, const int64_t *ids, int64_t n, uint8_t *res) {
    pthread_mutex_lock(&c->lock);
    for (int64_t i = 0; i < n; i++) {
        const int32_t s = ids[i] >= c->vocab_start && ids[i] < c->vocab_end ? find(c, local_key(c, ids[i])) : RC_NIL;
        res[i] = s != RC_NIL && st(c, s) == RC_VALID;
    }
    pthread_mutex_unlock(&c->lock);
}

/* ------------------------------------------------------------------ the hot set */

/* The hot set is ranked off the lock: rc_snapshot copies the slots' keys, counts and validity (three memcpy-like
 * passes, ~10 ms for 6.7M slots), the caller ranks them, then rc_copy_slots copies the chosen rows in batches,
 * each under the lock for a moment and only where the slot still holds the same valid row. Ranking 1M slots under
 * the lock took 0.7 s on this box: a serving cache must not stall its lookups that long. */
void rc_snapshot(rc_cache_t *c, uint32_t *keys_out, uint16_t *hits_out, uint8_t *valid_out) {
    pthread_mutex_lock(&c->lock);
    memcpy(keys_out, c->keys, (size_t)c->capacity * sizeof *keys_out);
    memcpy(hits_out, c->hits, (size_t)c->capacity * sizeof *hits_out);
    for (int64_t s = 0; s < c->capacity; s++) valid_out[s] = st(c, (int32_t)s) == RC_VALID;
    pthread_mutex_unlock(&c->lock);
}

typedef struct {
    uint64_t order; /* (65535 - count) << 32 | key: ascending = most looked up first, then the lower id */
    int64_t slot;
} rc_rank_t;

static int by_order(const void *a, const void *b) {
    const uint64_t x = ((const rc_rank_t *)a)->order, y = ((const rc_rank_t *)b)->order;
    return x < y ? -1 : x > y;
}

/* On a snapshot (no lock, no cache): the (at most) k valid slots with a count, most looked up first, ties by
 * the lower key, into slots_out; returns how many, -1 without memory. A histogram of the counts finds the lowest
 * count that makes the cut, so only the candidates (k plus that count's ties) are sorted. */
int64_t rc_rank(const uint32_t *keys, const uint16_t *hits, const uint8_t *valid, int64_t capacity, int64_t k,
                int64_t *slots_out) {
    int64_t *hist = calloc(65536, sizeof *hist), m = 0, cut = 1, n = 0;
    if (!hist) return -1;
    for (int64_t s = 0; s < capacity; s++)
        if (valid[s] && hits[s]) hist[hits[s]]++;
    for (int64_t f = 65535, have = 0; f >= 1; f--) {
        have += hist[f];
        if (have >= k) {
            cut = f;
            break;
        }
    }
    for (int64_t f = cut; f <= 65535; f++) m += hist[f];
    free(hist);
    rc_rank_t *r = m ? malloc((size_t)m * sizeof *r) : NULL;
    if (m && !r) return -1;
    int64_t j = 0;
    for (int64_t s = 0; s < capacity && j < m; s++)
        if (valid[s] && hits[s] >= cut) r[j++] = (rc_rank_t){((uint64_t)(65535 - hits[s]) << 32) | keys[s], s};
    qsort(r, (size_t)j, sizeof *r, by_order);
    for (n = 0; n < j && n < k; n++) slots_out[n] = r[n].slot;
    free(r);
    return n;
}

/* Copy slot slots[i]'s row into rows_out[i] when it still holds key keys[i] and is valid (ok_out[i] = 1), else
 * ok_out[i] = 0. Returns how many were copied. */
int64_t rc_copy_slots(rc_cache_t *c, const int64_t *slots, const uint32_t *keys, int64_t n, uint8_t *rows_out,
                      uint8_t *ok_out) {
    int64_t copied = 0;
    pthread_mutex_lock(&c->lock);
    for (int64_t i = 0; i < n; i++) {
        const int64_t s = slots[i];
        const int ok = s >= 0 && s < c->capacity && c->keys[s] == keys[i] && st(c, (int32_t)s) == RC_VALID;
        if (ok && c->rows) memcpy(rows_out + i * c->row_bytes, c->rows + s * c->row_bytes, (size_t)c->row_bytes);
        ok_out[i] = (uint8_t)ok;
        copied += ok;
    }
    pthread_mutex_unlock(&c->lock);
    return copied;
}

/* Halve every slot's lookup count: recent lookups outrank old ones in the next ranking. */
void rc_age(rc_cache_t *c) {
    pthread_mutex_lock(&c->lock);
    for (int64_t s = 0; s < c->capacity; s++) c->hits[s] >>= 1;
    pthread_mutex_unlock(&c->lock);
}

/* Put rows the caller has already checked (a verified hot file) into the cache without reading the disk:
 * each id of this rank not cached yet takes a slot as a prefetch would (same policy and eviction), its bytes
 * copied from `rows`, its count from `counts` (NULL: 0). Stops at the first row the cache cannot place (every
 * slot busy). Returns how many were placed, or -1 when the cache is closed or failed. */
int64_t rc_admit(rc_cache_t *c, const int64_t *ids, const uint8_t *rows, const uint16_t *counts, int64_t n) {
    int64_t placed = 0;
    pthread_mutex_lock(&c->lock);
    if (c->closed || c->failed) {
        pthread_mutex_unlock(&c->lock);
        return -1;
    }
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < c->vocab_start || ids[i] >= c->vocab_end) continue;
        const uint32_t key = local_key(c, ids[i]);
        if (find(c, key) != RC_NIL) continue;
        const int32_t s = reserve(c, key, 1);
        if (s == RC_NIL) break;
        if (c->rows) memcpy(c->rows + (int64_t)s * c->row_bytes, rows + i * c->row_bytes, (size_t)c->row_bytes);
        c->hits[s] = counts ? counts[i] : 0;
        c->state[s] = (uint8_t)((c->state[s] & ~RC_STATE_MASK) | RC_VALID);
        placed++;
    }
    pthread_mutex_unlock(&c->lock);
    return placed;
}

/* ------------------------------------------------------------------ as a CUDA host function */

/* Mirrored by row_cache.py (_HostRead). A host node cannot raise: a failure prints and ends the
 * process, as staging/native_read.c does (the step's rows would be wrong). */
typedef struct {
    rc_cache_t *cache;
    const int64_t *ids;
    uint8_t *out;
    int64_t n;
    int64_t calls;
    int32_t closed; /* set by the owner (the gather) when it is closed: a later replay ends the process */
    char what[128];
} rc_host_t;

void rc_host_read(void *arg) {
    rc_host_t *h = (rc_host_t *)arg;
    char err[512];
    int rc = -3;
    if (__atomic_load_n(&h->closed, __ATOMIC_ACQUIRE))
        snprintf(err, sizeof err, "the PLE row cache read was closed while a graph that replays it can still run");
    else
        rc = rc_read(h->cache, h->ids, h->n, h->out, 0, err, sizeof err);
    if (rc != 0) {
        fprintf(stderr,
                "sglang-ssd-stream: %s failed inside a CUDA stream/graph: %s\n"
                "stopping this process: the step's rows were not read.\n",
                h->what, err);
        fflush(stderr);
        _exit(RC_EXIT_CODE);
    }
    __atomic_fetch_add(&h->calls, 1, __ATOMIC_RELAXED);
}

int rc_host_layout(size_t *out, int cap) {
    const size_t v[] = {sizeof(rc_host_t), offsetof(rc_host_t, cache), offsetof(rc_host_t, ids),
                        offsetof(rc_host_t, out), offsetof(rc_host_t, n), offsetof(rc_host_t, calls),
                        offsetof(rc_host_t, closed), offsetof(rc_host_t, what)};
    const int n = (int)(sizeof v / sizeof v[0]);
    for (int i = 0; i < n && i < cap; i++) out[i] = v[i];
    return n;
}

/* Tests: run fn(arg) on a new thread, as the CUDA driver runs a host node. */
typedef struct {
    void (*fn)(void *);
    void *arg;
    pthread_t thread;
} rc_test_thread_t;

static void *test_main(void *p) {
    rc_test_thread_t *t = (rc_test_thread_t *)p;
    t->fn(t->arg);
    return NULL;
}

void *rc_test_start(void (*fn)(void *), void *arg) {
    rc_test_thread_t *t = calloc(1, sizeof *t);
    if (!t) return NULL;
    t->fn = fn;
    t->arg = arg;
    if (pthread_create(&t->thread, NULL, test_main, t) != 0) {
        free(t);
        return NULL;
    }
    return t;
}

int rc_test_join(void *p) {
    rc_test_thread_t *t = (rc_test_thread_t *)p;
    const int rc = pthread_join(t->thread, NULL);
    free(t);
    return rc;
}
