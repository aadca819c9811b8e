/*
 * The one internal header the modules built on the public API (rl/, batcher/) may include: the
 * allocation hooks, the error-message setters, the monotonic clock and condition variables on
 * that clock. Everything else they use is in include/tensorshare/. It lives alone in its folder so
 * that a module's include path can name it without exposing the rest of src/ (common.h, record.h,
 * proto.h).
 *
 * The hooks exist so that all heap memory of the project is counted and can be made to fail
 * (tests fail the N-th allocation); a module allocating with plain malloc would escape them.
 */
#ifndef TS_HOOKS_H
#define TS_HOOKS_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>

#include "tensorshare/tensorshare.h"

/* All heap memory goes through these (src/alloc.c); free what they return with ts__free. */
void *ts__malloc(size_t n);
void *ts__calloc(size_t n, size_t size);
void *ts__realloc(void *p, size_t n);
void ts__free(void *p);
/* A NUL-terminated copy of the first n bytes of s (s need not be terminated within n), or NULL. */
char *ts__strndup(const char *s, size_t n);

/*
 * The calling thread's ts_last_error() message (src/last_error.c), printf-style; cut at
 * TS_MAX_ERROR_LEN bytes.
 */
void ts__set_errorf(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
/*
 * Set the calling thread's message and return code, for "return ts__fail(TS_EINVAL, ...)" at a
 * public function's failure. fmt NULL sets ts_strerror(code).
 */
int ts__fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* Monotonic clock in nanoseconds (CLOCK_MONOTONIC). */
uint64_t ts__now_ns(void);

/* A monotonic time in nanoseconds as the absolute timespec pthread_cond_timedwait expects. */
static inline struct timespec ts__abs_timespec(uint64_t ns)
{
    struct timespec ts;
    ts.tv_sec = (time_t)(ns / 1000000000u);
    ts.tv_nsec = (long)(ns % 1000000000u);
    return ts;
}

/*
 * Make a condition variable whose timed waits use CLOCK_MONOTONIC, so that a change of the wall
 * clock neither shortens nor stretches a timeout. 0 or TS_ENOMEM.
 */
static inline int ts__cond_init_monotonic(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    if (pthread_condattr_init(&a) != 0)
        return TS_ENOMEM;
    int rc = pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    if (rc == 0)
        rc = pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
    return rc == 0 ? 0 : TS_ENOMEM;
}

/*
 * Wait on cv (made by ts__cond_init_monotonic) until woken or until deadline_ns on the monotonic
 * clock; UINT64_MAX waits without a deadline. 0 when woken (perhaps spuriously: recheck the
 * condition), ETIMEDOUT when the deadline passed.
 */
static inline int ts__cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns)
{
    if (deadline_ns == UINT64_MAX)
        return pthread_cond_wait(cv, mu);
    struct timespec ts = ts__abs_timespec(deadline_ns);
    return pthread_cond_timedwait(cv, mu, &ts);
}

#endif /* TS_HOOKS_H */
