/*
 * Internal definitions shared by the daemon and the client: allocation hooks, little-endian
 * helpers and small utilities. Not installed; names here use the ts__ prefix.
 */
#ifndef TS_COMMON_H
#define TS_COMMON_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "tensorshare/tensorshare.h"

#include "hooks/hooks.h"

/* Mark internal functions that the test library and other parts of the project use. */
#define TS__INTERNAL

#define TS__ALIGN 64 /* bytes; tensor data alignment inside records and receive buffers */
/* TS_MAX_DEPTH and TS_MAX_NAME_LEN are public (tensorshare.h). */

/*
 * The messages of the client's own timeouts (ts_last_error_no_reply): a request whose deadline
 * passed with no reply, and one that waited in vain for a connection ("PREFIX reason SUFFIX").
 */
#define TS__NO_REPLY_MSG       "no reply within the request timeout"
#define TS__NO_CONN_MSG_PREFIX "no connection to tensord ("
#define TS__NO_CONN_MSG_SUFFIX ") within the request timeout"

#define TS__ARRAY_SIZE(a) (sizeof(a) / sizeof((a)[0]))

static inline size_t ts__align_up(size_t n, size_t a)
{
    return (n + (a - 1)) & ~(a - 1);
}

/* Overflow-checked align_up: 0 on success, -1 when it would wrap. */
static inline int ts__align_up_checked(uint64_t n, uint64_t a, uint64_t *out)
{
    uint64_t r;
    if (__builtin_add_overflow(n, a - 1, &r))
        return -1;
    *out = r & ~(a - 1);
    return 0;
}

/*
 * All heap memory of the project goes through the allocation hooks, so tests can count
 * allocations and fail the N-th one (see ts__alloc_fail_after). ts__malloc, ts__calloc,
 * ts__realloc, ts__free, ts__strndup and ts__now_ns are declared in hooks/hooks.h, the one
 * internal header the modules on the public API (rl/, batcher/) may see; the rest is here.
 */
/*
 * 64-byte aligned memory; free with ts__free_aligned, giving the same n (how the buffer was
 * obtained depends on n). Large sizes are advised huge pages.
 */
void *ts__malloc_aligned(size_t n);
void ts__free_aligned(void *p, size_t n);
/*
 * Keep up to max_bytes of freed large aligned buffers (at most two) for reuse by the next
 * ts__malloc_aligned of the same size, process-wide. Off until enabled; enabling twice keeps
 * the larger limit. Thread-safe.
 */
void ts__alloc_cache_enable(size_t max_bytes);

/*
 * Testing hooks. ts__alloc_fail_after(n): the n-th allocation from now fails (n = 1: the next
 * one); n < 0 disables failures. ts__alloc_count(): allocations made since
 * ts__alloc_count_enable() (0 without it: counting is off until a program turns it on).
 */
void ts__alloc_fail_after(long n);
void ts__alloc_count_enable(void);
unsigned long ts__alloc_count(void);

/* Little-endian field access; never cast a struct over wire bytes. */
static inline void ts__put_u16le(uint8_t *p, uint16_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
}
static inline void ts__put_u32le(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline void ts__put_u64le(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static inline uint16_t ts__get_u16le(const uint8_t *p)
{
    return (uint16_t)(p[0] | (p[1] << 8));
}
static inline uint32_t ts__get_u32le(const uint8_t *p)
{
    return (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) | ((uint32_t)p[3] << 24);
}
static inline uint64_t ts__get_u64le(const uint8_t *p)
{
    return (uint64_t)ts__get_u32le(p) | ((uint64_t)ts__get_u32le(p + 4) << 32);
}
/*
 * An IEEE 754 binary64 travels as the u64 of its bits; memcpy moves the bits without the
 * aliasing a pointer cast would break.
 */
_Static_assert(sizeof(double) == 8, "doubles are IEEE 754 binary64");
static inline void ts__put_f64le(uint8_t *p, double v)
{
    uint64_t u;
    memcpy(&u, &v, sizeof(u));
    ts__put_u64le(p, u);
}
static inline double ts__get_f64le(const uint8_t *p)
{
    uint64_t u = ts__get_u64le(p);
    double v;
    memcpy(&v, &u, sizeof(v));
    return v;
}

#endif /* TS_COMMON_H */
