/* Allocation hooks: every allocation of the project passes here so tests can fail any one. */
#include "alloc.h"
#include "common.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define TS__HUGE_MIN     ((size_t)4 << 20) /* bytes; from here on aligned buffers are mmapped */
#define TS__SMALL_ZEROED ((size_t)1024)    /* bytes; ts__calloc up to here is malloc + memset */
#define TS__SMALL_ALIGNED                                                                          \
    ((size_t)960) /* bytes; up to here aligned buffers are carved from malloc (see below) */

static atomic_long fail_countdown = -1;
/*
 * The allocation count is kept only once a program asks for it (tensord, for STATS): one
 * counter written by every allocation of every thread would move its cache line between the
 * cores of a multi-threaded client (a batcher's replica and its answer helpers, each
 * allocating per batch or per request) on every allocation. Unwritten, both words stay shared
 * in every core's cache.
 */
static atomic_int counting;
static atomic_ulong alloc_count;

/* Returns 1 when this allocation must fail (testing), 0 otherwise. */
static int should_fail(void)
{
    if (atomic_load_explicit(&counting, memory_order_relaxed))
        atomic_fetch_add_explicit(&alloc_count, 1, memory_order_relaxed);
    long n = atomic_load_explicit(&fail_countdown, memory_order_relaxed);
    if (n < 0)
        return 0;
    n = atomic_fetch_sub(&fail_countdown, 1);
    return n == 1;
}

void ts__alloc_fail_after(long n)
{
    atomic_store(&fail_countdown, n <= 0 ? -1 : n);
}

void ts__alloc_count_enable(void)
{
    atomic_store(&counting, 1);
}

unsigned long ts__alloc_count(void)
{
    return atomic_load(&alloc_count);
}

void *ts__malloc(size_t n)
{
    if (should_fail())
        return NULL;
    return malloc(n ? n : 1);
}

void *ts__calloc(size_t n, size_t size)
{
    if (should_fail())
        return NULL;
    size_t bytes;
    if (!__builtin_mul_overflow(n, size, &bytes) && bytes > 0 && bytes <= TS__SMALL_ZEROED) {
        /*
         * glibc's calloc never takes from the per-thread cache, so small blocks freed into it
         * would overflow it into the slow path; malloc plus memset uses it both ways.
         */
        void *p = malloc(bytes);
        if (p == NULL)
            return NULL;
        /* Keeps the compiler from folding malloc + memset back into calloc. */
        __asm__ volatile("" : : "r"(p) : "memory");
        memset(p, 0, bytes);
        return p;
    }
    return calloc(n ? n : 1, size ? size : 1);
}

void *ts__realloc(void *p, size_t n)
{
    if (should_fail())
        return NULL;
    return realloc(p, n ? n : 1);
}

void ts__free(void *p)
{
    free(p);
}

char *ts__strndup(const char *s, size_t n)
{
    char *r = ts__malloc(n + 1);
    if (r == NULL)
        return NULL;
    memcpy(r, s, n);
    r[n] = '\0';
    return r;
}

/*
 * A few freed large buffers kept for the next allocation of the same size, when a part of the
 * program enables it (the client does, for the bodies it receives). A fresh buffer costs a page
 * fault and the zeroing of every page: measured with tsbench, receiving a 64 MiB GET into a new
 * buffer spent as much time clearing pages as copying the data. A client that pulls the same
 * parameters again and again gets the buffer it released last time instead.
 */
#define TS__CACHE_SLOTS 2
static struct {
    pthread_mutex_t mu;
    size_t max_bytes; /* 0 = disabled */
    size_t bytes;
    void *p[TS__CACHE_SLOTS];
    size_t n[TS__CACHE_SLOTS];
} cache = {.mu = PTHREAD_MUTEX_INITIALIZER};

void ts__alloc_cache_enable(size_t max_bytes)
{
    pthread_mutex_lock(&cache.mu);
    if (max_bytes > cache.max_bytes)
        cache.max_bytes = max_bytes;
    pthread_mutex_unlock(&cache.mu);
}

/* A cached buffer of exactly n bytes, or NULL. */
static void *cache_take(size_t n)
{
    void *p = NULL;
    pthread_mutex_lock(&cache.mu);
    for (int i = 0; i < TS__CACHE_SLOTS; i++) {
        if (cache.p[i] != NULL && cache.n[i] == n) {
            p = cache.p[i];
            cache.p[i] = NULL;
            cache.bytes -= n;
            break;
        }
    }
    pthread_mutex_unlock(&cache.mu);
    return p;
}

/* Keep p (n bytes) for reuse; 0 when kept, -1 when the caller must unmap it. */
static int cache_put(void *p, size_t n)
{
    int rc = -1;
    pthread_mutex_lock(&cache.mu);
    if (cache.max_bytes > 0 && n <= cache.max_bytes) {
        /* Evict until it fits: the newest buffer is the likeliest to be asked for again. */
        for (int i = 0; i < TS__CACHE_SLOTS && rc != 0; i++) {
            if (cache.p[i] == NULL && cache.bytes + n <= cache.max_bytes) {
                cache.p[i] = p;
                cache.n[i] = n;
                cache.bytes += n;
                rc = 0;
            }
        }
        for (int i = 0; i < TS__CACHE_SLOTS && rc != 0; i++) {
            if (cache.p[i] != NULL) {
                (void)munmap(cache.p[i], cache.n[i]);
                cache.bytes -= cache.n[i];
                cache.p[i] = NULL;
            }
            if (cache.bytes + n <= cache.max_bytes) {
                cache.p[i] = p;
                cache.n[i] = n;
                cache.bytes += n;
                rc = 0;
            }
        }
    }
    pthread_mutex_unlock(&cache.mu);
    return rc;
}

/*
 * Large buffers come from mmap with MADV_HUGEPAGE: page faults, not copying, dominate the cost of
 * filling a fresh multi-megabyte buffer, and huge pages cut their number by 512.
 */
void *ts__malloc_aligned(size_t n)
{
    if (n >= TS__HUGE_MIN) {
        if (should_fail())
            return NULL;
        void *p = cache_take(n);
        if (p != NULL)
            return p;
        p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (p == MAP_FAILED)
            return NULL;
#ifdef MADV_HUGEPAGE
        (void)madvise(p, n, MADV_HUGEPAGE);
#endif
        return p;
    }
    if (should_fail())
        return NULL;
    if (n <= TS__SMALL_ALIGNED) {
        /*
         * Carved from a plain malloc block, which comes from the allocator's per-thread cache;
         * posix_memalign takes its slow path every time. The byte before the buffer says how
         * far into the block it starts (1 to 64).
         */
        uint8_t *raw = malloc(ts__align_up(n ? n : 1, TS__ALIGN) + TS__ALIGN);
        if (raw == NULL)
            return NULL;
        uint8_t *p = (uint8_t *)(((uintptr_t)raw + TS__ALIGN) & ~(uintptr_t)(TS__ALIGN - 1));
        p[-1] = (uint8_t)(p - raw);
        return p;
    }
    void *p = NULL;
    if (posix_memalign(&p, TS__ALIGN, ts__align_up(n, TS__ALIGN)) != 0)
        return NULL;
    return p;
}

void ts__free_aligned(void *p, size_t n)
{
    if (p == NULL)
        return;
    if (n >= TS__HUGE_MIN) {
        if (cache_put(p, n) != 0)
            (void)munmap(p, n);
    } else if (n <= TS__SMALL_ALIGNED) {
        uint8_t *q = p;
        free(q - q[-1]);
    } else {
        free(p);
    }
}

void *ts__pages_alloc(size_t n)
{
    if (should_fail())
        return NULL;
    void *p = mmap(NULL, n ? n : 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
}

void ts__pages_free(void *p, size_t n)
{
    if (p != NULL)
        (void)munmap(p, n ? n : 1);
}

uint64_t ts__now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}
