/*
 * The bin store: refcounted items, the name hash table, bins and memory accounting. Pure data
 * structures: nothing here touches a socket or the loop, so the unit tests drive it directly.
 */
#include "server.h"
#include "names.h"

#include <stdlib.h>
#include <sys/mman.h>
#include <sys/random.h>

#define TSD_HTAB_MIN 64 /* buckets; the table never shrinks below this */

/* ---------------------------------------------------------------------------------------------
 * Items and the buffer pool
 */

/*
 * Large item buffers are recycled: filling a fresh multi-megabyte mapping costs a page fault
 * per page (about 20 ms for 64 MiB even with huge pages), while rewriting a mapped one costs a
 * few. The typical load, a trainer putting parameters of the same size again and again, then
 * finds the buffer it freed last time. Sizes are rounded up to TSD_POOL_ROUND so that similar
 * sizes share buffers. The pool lives on the loop thread, like every item release today.
 */
static struct {
    uint8_t *buf[TSD_POOL_MAX_BUFS];
    size_t len[TSD_POOL_MAX_BUFS];
    size_t n;
    uint64_t bytes;
} pool;

/*
 * Record bytes of it counted against --max-memory: all of them, but for an item in a data-dir
 * file, which --max-disk counts instead (its pages are the file's, written back by the kernel).
 */
uint64_t tsd_item_mem(const tsd_item *it)
{
    if (it->slot == TSD_ITEM_OWN &&
        ((const tsd_item_own *)(const void *)it)->backing == TSD_BACK_FILE)
        return 0;
    return tsd_item_len(it);
}

/* The allocation size for a record of len bytes. */
static size_t alloc_size(size_t len)
{
    if (len < TSD_POOL_MIN)
        return len;
    return ts__align_up(len, TSD_POOL_ROUND);
}

static uint8_t *buf_get(size_t alloc_len)
{
    for (size_t i = 0; i < pool.n; i++) {
        if (pool.len[i] == alloc_len) {
            uint8_t *b = pool.buf[i];
            pool.n--;
            pool.buf[i] = pool.buf[pool.n];
            pool.len[i] = pool.len[pool.n];
            pool.bytes -= alloc_len;
            return b;
        }
    }
    return ts__malloc_aligned(alloc_len);
}

static void buf_put(uint8_t *b, size_t alloc_len)
{
    if (alloc_len < TSD_POOL_MIN || alloc_len > TSD_POOL_MAX_BYTES) {
        tsd_reclaim_free_aligned(b, alloc_len);
        return;
    }
    /* Make room by dropping the oldest entries; the newest size is the likeliest to recur. */
    while (pool.n > 0 &&
           (pool.n == TSD_POOL_MAX_BUFS || pool.bytes + alloc_len > TSD_POOL_MAX_BYTES)) {
        tsd_reclaim_free_aligned(pool.buf[0], pool.len[0]);
        pool.bytes -= pool.len[0];
        memmove(pool.buf, pool.buf + 1, (pool.n - 1) * sizeof(pool.buf[0]));
        memmove(pool.len, pool.len + 1, (pool.n - 1) * sizeof(pool.len[0]));
        pool.n--;
    }
    pool.buf[pool.n] = b;
    pool.len[pool.n] = alloc_len;
    pool.n++;
    pool.bytes += alloc_len;
}

void tsd_pool_drain(void)
{
    tsd_slab_drain();
    tsd_shm_drain();
    for (size_t i = 0; i < pool.n; i++)
        ts__free_aligned(pool.buf[i], pool.len[i]);
    pool.n = 0;
    pool.bytes = 0;
}

uint64_t tsd_pool_bytes(void)
{
    return pool.bytes;
}

/*
 * Keep the unused tail of a rounded-up buffer out of huge pages. A record of 64 MiB + 64 bytes
 * sits in a 66 MiB buffer; with huge pages, its last 64 bytes would make a whole 2 MiB page
 * resident (measured: 1 GiB stored as 64 MiB items took 1056 MiB). With small pages there, the
 * tail costs one 4 KiB page.
 */
static void tail_small_pages(uint8_t *data, size_t len, size_t alloc_len)
{
#ifdef MADV_NOHUGEPAGE
    const uintptr_t huge = (uintptr_t)2 << 20;
    uintptr_t start = ((uintptr_t)data + len) & ~(huge - 1);
    if (start < (uintptr_t)data)
        start = (uintptr_t)data;
    uintptr_t end = (uintptr_t)data + alloc_len;
    if (end > start)
        (void)madvise((void *)start, end - start, MADV_NOHUGEPAGE);
#else
    (void)data;
    (void)len;
    (void)alloc_len;
#endif
}

tsd_item *tsd_item_new_sized(size_t len)
{
    tsd_item *it;
    if (len <= TSD_SLAB_MAX) {
        it = tsd_slab_alloc(len);
        if (it == NULL)
            return NULL;
        it->slen = (uint16_t)len;
    } else {
        tsd_item_own *own = ts__calloc(1, sizeof(*own));
        if (own == NULL)
            return NULL;
        own->fd = -1;
        size_t alloc_len = alloc_size(len);
        own->data = buf_get(alloc_len);
        if (own->data == NULL) {
            ts__free(own);
            return NULL;
        }
        if (alloc_len >= TSD_POOL_MIN && alloc_len > len)
            tail_small_pages(own->data, len, alloc_len);
        own->alloc_len = alloc_len;
        own->len = len;
        it = &own->it;
        it->slot = TSD_ITEM_OWN;
        it->slen = 0;
        it->next = NULL;
    }
    atomic_init(&it->refs, 1);
    return it;
}

tsd_item *tsd_item_new(size_t len)
{
    return tsd_item_new_sized(len);
}

void tsd_item_ref(tsd_item *it)
{
    atomic_fetch_add_explicit(&it->refs, 1, memory_order_relaxed);
}

void tsd_item_unref(tsd_item *it)
{
    if (it == NULL)
        return;
    unsigned old = atomic_fetch_sub_explicit(&it->refs, 1, memory_order_acq_rel);
    if ((old & ~TSD_ITEM_ORPHANED) != 1)
        return;
    if (old & TSD_ITEM_ORPHANED) {
        tsd_store *s = it->orphan_of;
        s->orphaned_bytes -= tsd_item_mem(it);
        it->next = NULL;
    }
    if (it->slot != TSD_ITEM_OWN) {
        tsd_slab_free(it);
        return;
    }
    tsd_item_own *own = (tsd_item_own *)(void *)it;
    if (own->backing != TSD_BACK_HEAP) {
        tsd_shm_release(own); /* memfds and files (shm.c) */
        return;
    }
    buf_put(own->data, own->alloc_len);
    ts__free(own);
}

/* ---------------------------------------------------------------------------------------------
 * Name hash table
 *
 * Clients choose the names, so an unkeyed hash would let one choose names that all land in one
 * chain and turn every lookup into a walk of the whole table. The hash is SipHash-1-3 (one
 * compression round per 8 bytes, three finalization rounds) under a key drawn from getrandom
 * once per process: names are at most 255 bytes, so it stays cheap.
 */

static uint64_t hash_k0, hash_k1;
static int hash_seeded;

void tsd_hash_seed(const uint8_t key[16])
{
    hash_k0 = ts__get_u64le(key);
    hash_k1 = ts__get_u64le(key + 8);
    hash_seeded = 1;
}

/* Seed from the kernel's random source once; a failure leaves a fixed key (logged). */
static void hash_seed_once(void)
{
    if (hash_seeded)
        return;
    uint8_t key[16] = {0};
    size_t got = 0;
    while (got < sizeof(key)) {
        ssize_t n = getrandom(key + got, sizeof(key) - got, 0);
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    if (got < sizeof(key))
        tsd_log(TSD_LOG_WARN, "getrandom failed: the name hash uses a fixed key");
    tsd_hash_seed(key);
}

static inline uint64_t rotl64(uint64_t x, int b)
{
    return (x << b) | (x >> (64 - b));
}

/* One SipHash round over the state v[0..3]. */
static inline void sip_round(uint64_t v[4])
{
    v[0] += v[1];
    v[1] = rotl64(v[1], 13);
    v[1] ^= v[0];
    v[0] = rotl64(v[0], 32);
    v[2] += v[3];
    v[3] = rotl64(v[3], 16);
    v[3] ^= v[2];
    v[0] += v[3];
    v[3] = rotl64(v[3], 21);
    v[3] ^= v[0];
    v[2] += v[1];
    v[1] = rotl64(v[1], 17);
    v[1] ^= v[2];
    v[2] = rotl64(v[2], 32);
}

uint32_t tsd_hash(const uint8_t *name, size_t len)
{
    uint64_t v[4] = {hash_k0 ^ 0x736f6d6570736575ull, hash_k1 ^ 0x646f72616e646f6dull,
                     hash_k0 ^ 0x6c7967656e657261ull, hash_k1 ^ 0x7465646279746573ull};
    size_t i = 0;
    for (; i + 8 <= len; i += 8) {
        uint64_t m = ts__get_u64le(name + i);
        v[3] ^= m;
        sip_round(v);
        v[0] ^= m;
    }
    /* The last 0..7 bytes, with the length in the top byte. */
    uint64_t last = (uint64_t)(len & 0xff) << 56;
    for (size_t k = 0; i + k < len; k++)
        last |= (uint64_t)name[i + k] << (8 * k);
    v[3] ^= last;
    sip_round(v);
    v[0] ^= last;
    v[2] ^= 0xff;
    sip_round(v);
    sip_round(v);
    sip_round(v);
    uint64_t h = v[0] ^ v[1] ^ v[2] ^ v[3];
    return (uint32_t)(h ^ (h >> 32));
}

int tsd_htab_init(tsd_htab *t)
{
    t->buckets = ts__calloc(TSD_HTAB_MIN, sizeof(*t->buckets));
    if (t->buckets == NULL)
        return TS_ENOMEM;
    t->mask = TSD_HTAB_MIN - 1;
    t->count = 0;
    return 0;
}

void tsd_htab_free(tsd_htab *t)
{
    ts__free(t->buckets);
    t->buckets = NULL;
    t->mask = 0;
    t->count = 0;
}

tsd_hnode *tsd_htab_find(const tsd_htab *t, const uint8_t *name, size_t len)
{
    uint32_t h = tsd_hash(name, len);
    for (tsd_hnode *n = t->buckets[h & t->mask]; n != NULL; n = n->next)
        if (n->hash == h && n->name_len == len && (len == 0 || memcmp(n->name, name, len) == 0))
            return n;
    return NULL;
}

/* Double the bucket array; on allocation failure keep the old one (lookups just get slower). */
static void htab_grow(tsd_htab *t)
{
    size_t nb = (t->mask + 1) * 2;
    tsd_hnode **b = ts__calloc(nb, sizeof(*b));
    if (b == NULL)
        return;
    for (size_t i = 0; i <= t->mask; i++) {
        tsd_hnode *n = t->buckets[i];
        while (n != NULL) {
            tsd_hnode *next = n->next;
            n->next = b[n->hash & (nb - 1)];
            b[n->hash & (nb - 1)] = n;
            n = next;
        }
    }
    ts__free(t->buckets);
    t->buckets = b;
    t->mask = nb - 1;
}

void tsd_htab_insert(tsd_htab *t, tsd_hnode *n)
{
    if (t->count >= t->mask + 1)
        htab_grow(t);
    tsd_hnode **slot = &t->buckets[n->hash & t->mask];
    n->next = *slot;
    *slot = n;
    t->count++;
}

void tsd_htab_remove(tsd_htab *t, tsd_hnode *n)
{
    for (tsd_hnode **p = &t->buckets[n->hash & t->mask]; *p != NULL; p = &(*p)->next) {
        if (*p == n) {
            *p = n->next;
            n->next = NULL;
            t->count--;
            return;
        }
    }
}

/* ---------------------------------------------------------------------------------------------
 * Bins
 */

static void pass_capture(tsd_store *s, tsd_bin *b);

int tsd_store_init(tsd_store *s, uint64_t max_memory)
{
    hash_seed_once();
    memset(s, 0, sizeof(*s));
    s->max_memory = max_memory;
    return tsd_htab_init(&s->bins);
}

uint64_t tsd_heap_block(size_t n)
{
    size_t b = (n + 8 + 15) & ~(size_t)15;
    return b < 32 ? 32 : b;
}

/*
 * What a bin costs beyond its items: its block (struct and name) and its share of the bucket
 * array, which holds up to one pointer per bin and doubles when full (two pointers at worst).
 */
static uint64_t bin_cost(size_t name_len)
{
    return tsd_heap_block(sizeof(tsd_bin) + name_len) + 2 * sizeof(tsd_hnode *);
}

uint64_t tsd_item_overhead(const tsd_item *it)
{
    if (it->slot != TSD_ITEM_OWN)
        return sizeof(tsd_item) + tsd_slab_slot_size(it) - it->slen;
    const tsd_item_own *own = (const tsd_item_own *)(const void *)it;
    if (own->backing == TSD_BACK_FILE)
        return tsd_heap_block(sizeof(*own)); /* its pages count against --max-disk */
    return tsd_heap_block(sizeof(*own)) + own->alloc_len - own->len;
}

int tsd_store_charge(tsd_server *srv, uint64_t *cost, uint64_t n)
{
    if (n == 0)
        return 0;
    if (tsd_store_reserve(&srv->store, n) != 0) {
        srv->stats.oom_rejections++;
        return TS_EOOM;
    }
    tsd_store_unreserve(&srv->store, n);
    srv->store.overhead += n;
    if (cost != NULL)
        *cost += n;
    return 0;
}

void tsd_store_uncharge(tsd_server *srv, uint64_t *cost, uint64_t n)
{
    srv->store.overhead -= n;
    if (cost != NULL)
        *cost -= n;
}

void tsd_store_item_take(tsd_store *s, tsd_item *it)
{
    tsd_store_unreserve(s, tsd_item_len(it));
    s->held += tsd_item_mem(it);
    s->overhead += tsd_item_overhead(it);
    it->next = NULL;
}

void tsd_store_item_drop(tsd_store *s, tsd_item *it, int orphan)
{
    s->held -= tsd_item_mem(it);
    s->overhead -= tsd_item_overhead(it);
    if (orphan)
        tsd_store_item_release(s, it);
    tsd_item_unref(it);
}

uint64_t tsd_store_used(const tsd_store *s)
{
    return s->held + s->reserved + s->overhead + s->output + s->conns + s->orphaned_bytes;
}

void tsd_store_item_release(tsd_store *s, tsd_item *it)
{
    if (atomic_load_explicit(&it->refs, memory_order_acquire) > 1) {
        it->orphan_of = s;
        atomic_fetch_or_explicit(&it->refs, TSD_ITEM_ORPHANED, memory_order_acq_rel);
        s->orphaned_bytes += tsd_item_mem(it);
    }
}

/*
 * Unref every item of b and leave it empty. count_orphans is 0 only when the store itself goes:
 * items still referenced then must not point at it.
 */
static void bin_empty(tsd_store *s, tsd_bin *b, int count_orphans)
{
    tsd_item *it = b->head;
    while (it != NULL) {
        tsd_item *next = it->next;
        it->next = NULL;
        s->held -= tsd_item_mem(it);
        s->overhead -= tsd_item_overhead(it);
        s->n_items--;
        if (count_orphans) {
            tsd_datadir_drop(NULL, it); /* a data-dir file: it must not come back */
            tsd_store_item_release(s, it);
        }
        tsd_item_unref(it);
        it = next;
    }
    b->head = b->tail = NULL;
    b->n_items = 0;
    b->bytes = 0;
}

/* Empty b (bin_empty) and free it; it must already be unlinked. */
static void bin_destroy(tsd_store *s, tsd_bin *b, int count_orphans)
{
    bin_empty(s, b, count_orphans);
    s->overhead -= bin_cost(b->node.name_len);
    s->name_bytes -= b->node.name_len;
    ts__free(b);
}

void tsd_store_free(tsd_store *s)
{
    if (s->bins.buckets == NULL)
        return;
    /* Passes still walking end with the store; their owners learn it at their next step. */
    for (tsd_pass *p = s->passes; p != NULL; p = p->next)
        if (p->err == 0)
            p->err = TS_ECANCELED;
    for (size_t i = 0; i <= s->bins.mask; i++) {
        tsd_hnode *n = s->bins.buckets[i];
        while (n != NULL) {
            tsd_hnode *next = n->next;
            bin_destroy(s, (tsd_bin *)n, 0);
            n = next;
        }
        s->bins.buckets[i] = NULL;
    }
    tsd_htab_free(&s->bins);
}

int tsd_store_reserve(tsd_store *s, uint64_t len)
{
    uint64_t total;
    if (__builtin_add_overflow(tsd_store_used(s), len, &total))
        return TS_EOOM;
    if (s->max_memory != 0 && total > s->max_memory)
        return TS_EOOM;
    s->reserved += len;
    return 0;
}

void tsd_store_unreserve(tsd_store *s, uint64_t len)
{
    s->reserved = len > s->reserved ? 0 : s->reserved - len;
}

tsd_bin *tsd_store_find(tsd_store *s, const uint8_t *name, size_t len)
{
    return (tsd_bin *)tsd_htab_find(&s->bins, name, len);
}

/*
 * A new, empty, unlinked bin; NULL on allocation failure. The name is stored after the struct,
 * in the same allocation and without a terminator (names are counted bytes): with one bin per
 * small item, every byte of a bin shows in the memory per item.
 */
static tsd_bin *bin_new(const uint8_t *name, size_t len)
{
    tsd_bin *b = ts__calloc(1, sizeof(*b) + len);
    if (b == NULL)
        return NULL;
    b->node.name = (uint8_t *)(b + 1);
    memcpy(b->node.name, name, len);
    b->node.name_len = (uint8_t)len;
    b->node.hash = tsd_hash(name, len);
    return b;
}

tsd_bin *tsd_store_add(tsd_store *s, const uint8_t *name, size_t len, tsd_item *item, int replace,
                       uint64_t version)
{
    tsd_bin *b = tsd_store_find(s, name, len);
    if (b == NULL) {
        b = bin_new(name, len);
        if (b == NULL)
            return NULL;
        /* Passes begun so far did not see it, so none of them shows it. */
        b->view_mark = s->pass_gen;
        tsd_htab_insert(&s->bins, &b->node);
        s->overhead += bin_cost(len);
        s->name_bytes += len;
    } else {
        pass_capture(s, b);
    }
    if (replace)
        bin_empty(s, b, 1);
    item->next = NULL;
    if (b->tail != NULL)
        b->tail->next = item;
    else
        b->head = item;
    b->tail = item;
    b->n_items++;
    b->bytes += tsd_item_len(item);
    b->version = version;
    tsd_store_unreserve(s, tsd_item_len(item));
    s->held += tsd_item_mem(item);
    s->overhead += tsd_item_overhead(item);
    s->n_items++;
    return b;
}

tsd_item *tsd_store_pop(tsd_store *s, tsd_bin *b)
{
    tsd_item *it = b->head;
    if (it == NULL)
        return NULL;
    pass_capture(s, b);
    b->head = it->next;
    if (b->head == NULL)
        b->tail = NULL;
    it->next = NULL;
    b->n_items--;
    b->bytes -= tsd_item_len(it);
    s->held -= tsd_item_mem(it);
    s->overhead -= tsd_item_overhead(it);
    s->n_items--;
    tsd_datadir_drop(NULL, it);
    /* The caller's reference is the store's; any other one keeps the item alive beyond it. */
    tsd_store_item_release(s, it);
    return it;
}

void tsd_store_remove(tsd_store *s, tsd_bin *b)
{
    pass_capture(s, b);
    tsd_htab_remove(&s->bins, &b->node);
    bin_destroy(s, b, 1);
}

void tsd_store_touch(tsd_store *s, tsd_bin *b)
{
    pass_capture(s, b);
}

/* ---------------------------------------------------------------------------------------------
 * Point-in-time passes
 *
 * A pass needs each bin that existed when it began, once, in that moment's state. Two facts
 * decide what to do with a bin b for a pass p, with no per-pass state in the bin:
 *   - b->view_mark < p->gen: p still needs b. A bin created while p runs gets the newest gen
 *     (so p, and every older pass, skip it); a bin handed to the passes ahead of a change gets
 *     it too (so no pass takes it twice). Passes begun later have greater gens and need it.
 *   - rev32(b->hash) < p->cur: p's walk is past b. The walk takes whole buckets in the order of
 *     their bit-reversed index. With 2^k buckets, bucket i holds the hashes whose bit-reversed
 *     value begins with the k bits of i reversed, so walking that order is walking the
 *     bit-reversed hashes upwards, and cur (a multiple of 2^(32-k)) is the first one not yet
 *     walked. Doubling the table (the only way it ever changes: it never shrinks) splits each
 *     bucket into two whose hashes stay on the same side of cur, so the test stays exact.
 * A change to b that p still needs and has not walked yet therefore hands b to p first
 * (pass_capture); the walk hands p every other bin it still needs.
 */

/* The 32 bits of x in reverse order. */
static inline uint32_t rev32(uint32_t x)
{
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}

/*
 * b is about to change or go: hand it, as it is now, to every pass that still needs it and has
 * not walked it yet, then mark it as taken by them all. Costs nothing without passes.
 */
static void pass_capture(tsd_store *s, tsd_bin *b)
{
    if (s->passes == NULL || b->view_mark == s->pass_gen)
        return;
    uint32_t key = rev32(b->node.hash);
    for (tsd_pass *p = s->passes; p != NULL; p = p->next) {
        if (p->err != 0 || b->view_mark >= p->gen || key < p->cur)
            continue;
        int rc = p->emit(p, b);
        if (rc != 0) {
            p->err = rc;
            continue;
        }
        p->emitted++;
        s->captures++;
    }
    b->view_mark = s->pass_gen;
}

int tsd_store_pass_begin(tsd_store *s, tsd_pass *p)
{
    if (s->pass_gen == UINT32_MAX) {
        if (s->passes != NULL)
            return TS_EAGAIN;
        /*
         * Every gen has been used (after 2^32 passes): with no pass running, no mark means
         * anything any more, so they all start again from 0 (one walk of the table).
         */
        for (size_t i = 0; s->bins.buckets != NULL && i <= s->bins.mask; i++)
            for (tsd_hnode *h = s->bins.buckets[i]; h != NULL; h = h->next)
                ((tsd_bin *)h)->view_mark = 0;
        s->pass_gen = 0;
    }
    p->gen = ++s->pass_gen;
    p->cur = 0;
    p->err = 0;
    p->emitted = 0;
    p->work = 0;
    p->turns = 0;
    p->loop_ns = 0;
    p->prev = NULL;
    p->next = s->passes;
    if (s->passes != NULL)
        s->passes->prev = p;
    s->passes = p;
    s->n_passes++;
    return 0;
}

void tsd_store_pass_end(tsd_store *s, tsd_pass *p)
{
    if (p->prev != NULL)
        p->prev->next = p->next;
    else
        s->passes = p->next;
    if (p->next != NULL)
        p->next->prev = p->prev;
    p->prev = p->next = NULL;
    s->n_passes--;
}

/* Buckets ahead of the walk whose memory is fetched early (the walk is bound by cache misses). */
#define TSD_PASS_PREFETCH 16u

int tsd_store_pass_step(tsd_store *s, tsd_pass *p, size_t *budget)
{
    const tsd_htab *t = &s->bins;
    if (p->err != 0 || t->buckets == NULL) {
        p->cur = TSD_PASS_END;
        return 1;
    }
    /* One bucket in the bit-reversed space: 2^32 / 2^k. */
    const uint64_t step = TSD_PASS_END / ((uint64_t)t->mask + 1);
    const uint64_t limit = *budget;
    uint64_t used = 0;
    int over = 0;
    while (p->cur < TSD_PASS_END && used < limit) {
        /*
         * Buckets are visited far apart in memory: fetch the bucket slot TSD_PASS_PREFETCH
         * buckets on, the bin half as far on (its slot is in cache by now), and the first item
         * of the bin a quarter as far on.
         */
        uint64_t far = p->cur + TSD_PASS_PREFETCH * step;
        if (far < TSD_PASS_END)
            __builtin_prefetch(&t->buckets[rev32((uint32_t)far)]);
        uint64_t mid = p->cur + TSD_PASS_PREFETCH / 2 * step;
        if (mid < TSD_PASS_END && t->buckets[rev32((uint32_t)mid)] != NULL)
            __builtin_prefetch(t->buckets[rev32((uint32_t)mid)]);
        uint64_t near = p->cur + TSD_PASS_PREFETCH / 4 * step;
        if (near < TSD_PASS_END && t->buckets[rev32((uint32_t)near)] != NULL)
            __builtin_prefetch(((const tsd_bin *)t->buckets[rev32((uint32_t)near)])->head);
        used++;
        for (tsd_hnode *h = t->buckets[rev32((uint32_t)p->cur)]; h != NULL; h = h->next) {
            const tsd_bin *b = (const tsd_bin *)h;
            used++;
            if (b->view_mark >= p->gen)
                continue;
            /* A snapshot's emit visits every item: they are its work, not the bin alone. */
            used += (uint64_t)p->per_item * b->n_items;
            int rc = p->emit(p, b);
            if (rc != 0) {
                p->err = rc;
                p->cur = TSD_PASS_END;
                over = 1;
                break;
            }
            p->emitted++;
        }
        if (over)
            break;
        p->cur += step;
    }
    *budget = used >= limit ? 0 : (size_t)(limit - used);
    p->work += used;
    return p->cur >= TSD_PASS_END;
}

int tsd_store_pass_run(tsd_store *s, tsd_pass *p)
{
    p->err = 0;
    p->emitted = 0;
    for (size_t i = 0; s->bins.buckets != NULL && i <= s->bins.mask; i++) {
        if (i + TSD_PASS_PREFETCH <= s->bins.mask && s->bins.buckets[i + TSD_PASS_PREFETCH])
            __builtin_prefetch(s->bins.buckets[i + TSD_PASS_PREFETCH]);
        for (tsd_hnode *h = s->bins.buckets[i]; h != NULL; h = h->next) {
            int rc = p->emit(p, (const tsd_bin *)h);
            if (rc != 0) {
                p->err = rc;
                return rc;
            }
            p->emitted++;
        }
    }
    return 0;
}

/* Order bins by name bytes; a name sorts before any longer name it prefixes. */
static int bin_cmp(const void *a, const void *b)
{
    const tsd_bin *x = *(const tsd_bin *const *)a;
    const tsd_bin *y = *(const tsd_bin *const *)b;
    return tsd_name_cmp(x->node.name, x->node.name_len, y->node.name, y->node.name_len);
}

int tsd_store_sorted(tsd_store *s, tsd_bin ***out, size_t *n)
{
    size_t count = s->bins.count;
    tsd_bin **arr = ts__malloc((count > 0 ? count : 1) * sizeof(*arr));
    if (arr == NULL)
        return TS_ENOMEM;
    size_t k = 0;
    for (size_t i = 0; i <= s->bins.mask; i++)
        for (tsd_hnode *h = s->bins.buckets[i]; h != NULL; h = h->next)
            arr[k++] = (tsd_bin *)h;
    qsort(arr, k, sizeof(*arr), bin_cmp);
    *out = arr;
    *n = k;
    return 0;
}
