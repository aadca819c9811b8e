/*
 * Helpers shared by the client integration tests: a latch for waiting on callbacks (every wait
 * bounded), a clock, a STATS reader, and builders for test records.
 */
#ifndef TS_TEST_CLIENT_UTIL_H
#define TS_TEST_CLIENT_UTIL_H

#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "tensorshare/tensorshare.h"

/* Generous bounds: the tests share two cores with sanitizers and other builds. */
#define TC_WAIT_MS 20000

static inline uint64_t tc_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static inline void tc_sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* The STATS value key of c's server (cmocka's asserts: include <cmocka.h> before this file). */
static inline int64_t tc_stat_int(ts_client_t *c, const char *key)
{
    ts_value_t *v = NULL;
    assert_int_equal(ts_stats(c, &v), 0);
    int64_t x = -1;
    assert_int_equal(ts_map_get_int(v, key, &x), 0);
    ts_value_free(v);
    return x;
}

/* A counter that threads wait on until it reaches a target. */
typedef struct tc_latch {
    pthread_mutex_t mu;
    pthread_cond_t cond;
    long count;
} tc_latch;

static inline void tc_latch_init(tc_latch *l)
{
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cond, NULL);
    l->count = 0;
}

static inline void tc_latch_destroy(tc_latch *l)
{
    pthread_mutex_destroy(&l->mu);
    pthread_cond_destroy(&l->cond);
}

static inline void tc_latch_add(tc_latch *l, long n)
{
    pthread_mutex_lock(&l->mu);
    l->count += n;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mu);
}

static inline long tc_latch_get(tc_latch *l)
{
    pthread_mutex_lock(&l->mu);
    long n = l->count;
    pthread_mutex_unlock(&l->mu);
    return n;
}

/* Wait until count >= target, at most timeout_ms. Returns the count. */
static inline long tc_latch_wait(tc_latch *l, long target, int timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&l->mu);
    while (l->count < target)
        if (pthread_cond_timedwait(&l->cond, &l->mu, &ts) != 0)
            break;
    long n = l->count;
    pthread_mutex_unlock(&l->mu);
    return n;
}

/* A float32 vector tensor of n values start, start+1, ... (copied into the value). */
static inline ts_value_t *tc_vec(int64_t n, float start)
{
    float *v = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    for (int64_t i = 0; i < n; i++)
        v[i] = start + (float)i;
    ts_value_t *t = ts_tensor_new(TS_FLOAT32, 1, &n, v, TS_COPY);
    free(v);
    return t;
}

/* {"x": tc_vec(n, start), "tag": tag}. */
static inline ts_value_t *tc_item(int64_t n, float start, int64_t tag)
{
    ts_value_t *m = ts_map_new();
    if (ts_map_set(m, "x", tc_vec(n, start)) != 0 || ts_map_set(m, "tag", ts_int_new(tag)) != 0) {
        ts_value_free(m);
        return NULL;
    }
    return m;
}

/* The "tag" of an item made by tc_item, or -1. */
static inline int64_t tc_tag(const ts_value_t *item)
{
    int64_t tag;
    return ts_map_get_int(item, "tag", &tag) == 0 ? tag : -1;
}

/* 1 when the item's "x" is tc_vec(n, start). */
static inline int tc_check_vec(const ts_value_t *item, int64_t n, float start)
{
    const ts_tensor_t *t = ts_map_get_tensor(item, "x");
    if (t == NULL || t->dtype != TS_FLOAT32 || t->ndim != 1 || t->shape[0] != n)
        return 0;
    const float *f = t->data;
    for (int64_t i = 0; i < n; i++)
        if (f[i] != start + (float)i)
            return 0;
    return 1;
}

#endif /* TS_TEST_CLIENT_UTIL_H */
