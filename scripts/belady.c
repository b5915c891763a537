/* Belady's optimal row cache, offline, for scripts/bench_row_cache.py.
 *
 * x[i]: dense row id of access i; nxt[i]: the next access to the same row (or INT32_MAX).
 * A cache of `cap` rows. On a miss the row is inserted and, when full, the row whose next use is
 * farthest is evicted (MIN). With `bypass` the missed row is not inserted when its own next use is
 * farther than every cached row's (the optimum for a cache that may decline to admit a row).
 * miss[i] is set to 1 for every access that misses; returns the number of misses.
 * An indexed max-heap keyed by next use: O(log cap) per access.
 */
#include <stdint.h>
#include <stdlib.h>

typedef struct {
    int32_t *key, *item, *pos; /* heap arrays of cap; pos per dense row (-1: not cached) */
    int64_t size;
} heap_t;

static void swap(heap_t *h, int64_t a, int64_t b) {
    int32_t k = h->key[a], it = h->item[a];
    h->key[a] = h->key[b];
    h->item[a] = h->item[b];
    h->key[b] = k;
    h->item[b] = it;
    h->pos[h->item[a]] = (int32_t)a;
    h->pos[h->item[b]] = (int32_t)b;
}

static void up(heap_t *h, int64_t i) {
    while (i > 0) {
        const int64_t p = (i - 1) / 2;
        if (h->key[p] >= h->key[i]) break;
        swap(h, p, i);
        i = p;
    }
}

static void down(heap_t *h, int64_t i) {
    for (;;) {
        const int64_t l = 2 * i + 1, r = l + 1;
        int64_t m = i;
        if (l < h->size && h->key[l] > h->key[m]) m = l;
        if (r < h->size && h->key[r] > h->key[m]) m = r;
        if (m == i) return;
        swap(h, i, m);
        i = m;
    }
}

int64_t belady(const int32_t *x, const int32_t *nxt, int64_t n, int64_t distinct, int64_t cap, int bypass,
               uint8_t *miss) {
    heap_t h = {malloc((size_t)cap * 4), malloc((size_t)cap * 4), malloc((size_t)distinct * 4), 0};
    if (!h.key || !h.item || !h.pos) return -1;
    for (int64_t d = 0; d < distinct; d++) h.pos[d] = -1;
    int64_t misses = 0;
    for (int64_t i = 0; i < n; i++) {
        const int32_t it = x[i], nx = nxt[i];
        if (h.pos[it] >= 0) { /* hit: its next use moves later */
            miss[i] = 0;
            h.key[h.pos[it]] = nx;
            up(&h, h.pos[it]);
            continue;
        }
        miss[i] = 1;
        misses++;
        if (bypass && nx == INT32_MAX) continue; /* never used again */
        if (h.size < cap) {
            h.key[h.size] = nx;
            h.item[h.size] = it;
            h.pos[it] = (int32_t)h.size;
            h.size++;
            up(&h, h.size - 1);
            continue;
        }
        if (bypass && nx >= h.key[0]) continue; /* farther than every cached row: do not admit */
        h.pos[h.item[0]] = -1; /* evict the farthest */
        h.key[0] = nx;
        h.item[0] = it;
        h.pos[it] = 0;
        down(&h, 0);
    }
    free(h.key);
    free(h.item);
    free(h.pos);
    return misses;
}
